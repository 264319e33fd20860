"""Packed variable-length attention: ``flash_attention_varlen`` (FlashAttention's ``cu_seqlens`` convention).

The semantics are :func:`longattn.reference.flash_attention_varlen`. This first version runs each sequence of the
packed batch as its own :func:`longattn.flash_attention` call (so each gets the backend ``auto`` picks for it:
SDPA's default kernel, our Triton kernels or PyTorch) and concatenates the results: exact, differentiable, on every
device, but one call per sequence. Running all sequences in one launch per pass (the Triton kernels reading the
boundaries through ``AttentionCall.seqlens``) is the open part of the variable-length issue.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from longattn import _validation as V
from longattn.call import accumulator_dtype
from longattn.functional import Window, flash_attention


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    causal: bool = False,
    window: Window = (-1, -1),
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a packed batch of sequences of different lengths, without padding.

    Args:
        q: ``(total_q, Hq, D)``; k, v: ``(total_k, Hk, D)`` with ``Hq % Hk == 0``: the sequences concatenated.
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) ``(batch + 1,)``, starting at 0, non-decreasing, ending at
            ``total_q`` / ``total_k``: sequence ``b`` is rows ``cu[b]:cu[b+1]``. Sequences may be empty. Reading
            them costs one device-to-host copy per call (they are checked, and the sequences sliced on the host).
        max_seqlen_q, max_seqlen_k: launch hints of FlashAttention's interface; optional, and when given they must
            be at least the longest sequence.
        causal, window: as in :func:`longattn.flash_attention`, aligned bottom-right per sequence (query ``i`` of a
            sequence with ``n`` queries and ``m`` keys sits at key position ``i + m - n``).
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp ``(Hq, total_q)``, float32 (float64 for float64 inputs).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, applied to each sequence.

    Returns:
        ``out (total_q, Hq, D)``; with ``return_lse``, ``(out, lse)``. Each sequence attends only within itself; a
        query that sees no key (an empty key sequence, or a band that leaves it none) outputs 0, lse ``-inf``.
    """
    fn = "flash_attention_varlen"
    causal = V.check_flag(causal, "causal", fn)
    return_lse = V.check_flag(return_lse, "return_lse", fn)
    cu_q, cu_k = V.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, fn=fn)
    for name, hint, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if hint is not None and (not V._is_int(hint) or hint < longest):
            raise ValueError(f"{fn}: {name} must be None or an int >= the longest sequence ({longest}), got "
                             f"{hint!r}")
    window = V.check_window(window, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    V.check_backend(backend, fn)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # Without the log-sum-exp, auto may run SDPA's default kernel on a sequence (it returns no lse).
        result = flash_attention(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=causal, window=window,
                                 scale=scale, return_lse=return_lse, backend=backend)
        out, lse = result if return_lse else (result, None)
        outs.append(out[0])
        lses.append(None if lse is None else lse[0])
    if not outs:  # no sequences: total_q is 0
        return (q * 0, q.new_empty((q.shape[1], 0), dtype=accumulator_dtype(q.dtype))) if return_lse else q * 0
    out = torch.cat(outs)
    return (out, torch.cat(lses, dim=1)) if return_lse else out
