"""Packed variable-length attention (FlashAttention's ``cu_seqlens`` convention): ``flash_attention_varlen`` and
``dilated_attention_varlen``.

The semantics are :func:`longattn.reference.flash_attention_varlen` and
:func:`longattn.reference.dilated_attention_varlen`: each sequence of the packed batch is attended on its own. The
call is described once (:class:`longattn.call.AttentionCall` with :class:`longattn.call.SeqLens`) and run by one
backend: the Triton kernels run every sequence in one launch per pass (a program past the end of its sequence
returns at once); the PyTorch backend runs them one after another. There is no SDPA path: SDPA takes no packed
batch.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from longattn import _autocast, _fp8
from longattn import _validation as V
from longattn import runner
from longattn.call import AttentionCall, SeqLens, dilated_branches, int32_index, longest_sequence
from longattn.functional import Window


def _check_hint(hint, longest: int, name: str, fn: str) -> None:
    if hint is not None and not V._is_int(hint):
        raise TypeError(f"{fn}: {name} must be None or a Python int (>= the longest sequence, {longest}), got "
                        f"{type(hint).__name__} {hint!r}")
    if hint is not None and hint < longest:
        raise ValueError(f"{fn}: {name} must be None or an int >= the longest sequence ({longest}), got {hint!r}")


def _seqlens(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, cu_q: List[int], cu_k: List[int]) -> SeqLens:
    return SeqLens(int32_index(cu_seqlens_q), int32_index(cu_seqlens_k), longest_sequence(cu_q), longest_sequence(cu_k))


def _run(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, backend: str, fn: str,
         return_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``call`` on the packed q, k, v (given one batch row for the backends); drops that row from the results."""
    out, lse = runner.run(q[None], k[None], v[None], call, backend=backend, fn=fn)
    # squeeze, not out[0]: indexing's backward would zero-fill a q-sized gradient and copy the incoming one into it
    return (out.squeeze(0), lse.squeeze(0)) if return_lse else out.squeeze(0)


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
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    sinks: Optional[Tensor] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a packed batch of sequences of different lengths, without padding.

    Args:
        q: ``(total_q, Hq, D)``; k, v: ``(total_k, Hk, D)`` with ``Hq % Hk == 0``: the sequences concatenated.
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) ``(batch + 1,)`` on the inputs' device, starting at 0,
            non-decreasing, ending at ``total_q`` / ``total_k``: sequence ``b`` is rows ``cu[b]:cu[b+1]``.
            Sequences may be empty. They are checked on every call.
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).
        max_seqlen_q, max_seqlen_k: FlashAttention's launch hints; optional (the longest lengths are known from the
            check), and when given they must be at least the longest sequence.
        causal, window: as in :func:`longattn.flash_attention`, aligned bottom-right per sequence (query ``i`` of a
            sequence with ``n`` queries and ``m`` keys sits at key position ``i + m - n``).
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp ``(Hq, total_q)``, float32 (float64 for float64 inputs).
        backend: ``"auto"`` (the Triton kernels on a GPU that runs them, else PyTorch), ``"triton"`` or ``"torch"``.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs (forward only), as in
            :func:`longattn.flash_attention`, per-head factors being ``(batch, Hk)``: one row per sequence.
        sinks: attention sinks ``(Hq,)``, as in :func:`longattn.flash_attention`.
        softcap, alibi_slopes: as in :func:`longattn.flash_attention`, per sequence (``(batch, Hq)`` slopes: a row
            per sequence; distances within the sequence, bottom-right aligned).
        deterministic: bitwise-identical gradients from run to run, as in :func:`longattn.flash_attention` (also
            on under PyTorch's deterministic mode). A packed batch's backward (the two Triton passes, or the PyTorch
            backend) sums in a fixed order already, so this costs nothing today.

    Returns:
        ``out (total_q, Hq, D)``; with ``return_lse``, ``(out, lse)``. Each sequence attends only within itself; a
        query that sees no key (an empty key sequence, or a band that leaves it none) outputs 0, lse ``-inf``.
    """
    fn = "flash_attention_varlen"
    q, k, v = _autocast.cast_inputs(q, k, v)
    causal = V.check_flag(causal, "causal", fn)
    return_lse = V.check_flag(return_lse, "return_lse", fn)
    cu_q, cu_k = V.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, fn=fn, fp8=True)
    _check_hint(max_seqlen_q, longest_sequence(cu_q), "max_seqlen_q", fn)
    _check_hint(max_seqlen_k, longest_sequence(cu_k), "max_seqlen_k", fn)
    window = V.check_window(window, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    V.check_backend(backend, fn)
    descale, out_dtype = _fp8.check(q, k, v, (q_descale, k_descale, v_descale), out_dtype, batch=len(cu_q) - 1,
                                    fn=fn)
    sinks = V.check_sinks(sinks, q.shape[1], q.device, fn=fn)
    softcap = V.check_softcap(softcap, fn=fn)
    alibi = V.check_alibi(alibi_slopes, len(cu_q) - 1, q.shape[1], q.device, fn=fn)
    deterministic = V.check_deterministic(deterministic, fn)
    call = AttentionCall(scale=scale, causal=causal, window=window,
                         seqlens=_seqlens(cu_seqlens_q, cu_seqlens_k, cu_q, cu_k), descale=descale,
                         out_dtype=out_dtype, sinks=sinks, softcap=softcap, alibi=alibi, deterministic=deterministic,
                         need_lse=return_lse)
    return _run(q, k, v, call, backend, fn, return_lse)


def dilated_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    head_split: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """LongNet dilated attention over a packed batch: :func:`longattn.dilated_attention` applied to each sequence
    on its own (self-attention).

    Args:
        q, k, v: ``(total, Hq, D)`` and ``(total, Hk, D)``, ``Hq % Hk == 0``: the sequences concatenated.
        cu_seqlens: int32 (or int64) ``(batch + 1,)``, as in :func:`flash_attention_varlen` (queries and keys
            alike); checked on every call, as there.
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).
        segment_lengths, dilation_rates, causal, head_split, scale: as in :func:`longattn.dilated_attention`; a
            sequence's segments start at its first row, its last segment may be shorter, and a segment longer than
            the sequence is the sequence.
        return_lse: also return the merged log-sum-exp ``(Hq, total)``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        deterministic: as in :func:`flash_attention_varlen` (costs nothing today).

    Returns:
        ``out (total, Hq, D)``; with ``return_lse``, ``(out, lse)``.
    """
    fn = "dilated_attention_varlen"
    q, k, v = _autocast.cast_inputs(q, k, v)
    causal = V.check_flag(causal, "causal", fn)
    head_split = V.check_flag(head_split, "head_split", fn)
    return_lse = V.check_flag(return_lse, "return_lse", fn)
    V.check_packed_inputs(q, k, v, fn=fn)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{fn}: self-attention needs k and v as long as q (total_q == total_k), got "
                         f"{q.shape[0]} and {k.shape[0]}")
    cu = V.check_cu_seqlens(cu_seqlens, q.shape[0], "cu_seqlens", fn, q.device)  # (checked as its own name)
    segment_lengths, dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    V.check_backend(backend, fn)
    deterministic = V.check_deterministic(deterministic, fn)
    seqlens = _seqlens(cu_seqlens, cu_seqlens, cu, cu)
    branches = dilated_branches(seqlens.max_q, q.shape[1], segment_lengths, dilation_rates, head_split, fn=fn)
    call = AttentionCall(scale=scale, causal=causal, branches=branches, seqlens=seqlens, deterministic=deterministic)
    return _run(q, k, v, call, backend, fn, return_lse)
