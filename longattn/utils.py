"""Small public helpers around the attention functions: the ``cu_seqlens`` of a packed batch, padding and
unpadding (FlashAttention's ``bert_padding`` convention), and which implementation ``backend="auto"`` picks."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn import _validation as V
from longattn.backends import dispatch


def cu_seqlens_of(lengths: Sequence[int], device: Union[str, torch.device, None] = None) -> Tensor:
    """int32 ``cu_seqlens`` ``(batch + 1,)`` of sequences of ``lengths``: ``[0, l0, l0 + l1, ...]`` (the packed
    batch's boundaries, as :func:`longattn.flash_attention_varlen` takes them)."""
    bounds = [0]
    for n in lengths:
        if not V._is_int(n) or n < 0:
            raise ValueError(f"cu_seqlens_of: lengths must be ints >= 0, got {n!r}")
        bounds.append(bounds[-1] + int(n))
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def unpad_input(x: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor, int]:
    """A padded batch ``x (B, L, ...)`` as a packed one: the rows where ``mask (B, L)`` (bool, or 0/1) is true,
    sequence after sequence. Returns ``(x_packed (total, ...), indices (total,), cu_seqlens (B + 1,) int32,
    max_seqlen)``; :func:`pad_input` puts the rows back. One host synchronisation (the lengths; two for a mask that
    is not bool, whose values are checked)."""
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"unpad_input: mask must be a (batch, seq) tensor like x's first two dims "
                         f"{tuple(x.shape[:2])}, got {getattr(mask, 'shape', type(mask).__name__)}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("unpad_input: mask must be bool or hold only 0 and 1 (True/1 keeps a row, as transformers' "
                         "attention_mask); an additive mask (0 keeps, -inf pads) is the opposite: pass mask == 0")
    keep = mask.to(torch.bool)
    lengths = keep.sum(1, dtype=torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    indices = keep.reshape(-1).nonzero().squeeze(1)
    packed = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, indices)
    return packed, indices, cu, int(lengths.max()) if lengths.numel() else 0


def pad_input(x: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of :func:`unpad_input`: ``x (total, ...)`` back to ``(batch, seqlen, ...)``, zeros at the padded
    rows (differentiable)."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:]).index_copy(0, indices, x)
    return out.reshape(batch, seqlen, *x.shape[1:])


def auto_backend(q: Tensor, k: Tensor, *, causal: bool = False, window: Tuple[int, int] = (-1, -1),
                 return_lse: bool = False, needs_grad: Optional[bool] = None, deterministic: bool = False,
                 v: Optional[Tensor] = None) -> str:
    """The implementation ``longattn.flash_attention(q, k, v, backend="auto", ...)`` runs for these inputs:
    ``"sdpa"`` (PyTorch's own kernel), ``"triton"`` or ``"torch"``. ``needs_grad`` defaults to whether q, k (or
    ``v``, when given) requires grad with grad mode on. ``deterministic``: the call's flag (also on under PyTorch's deterministic
    mode, as in ``flash_attention``): a call that needs gradients then never runs on SDPA."""
    deterministic = V.check_deterministic(deterministic, "auto_backend")
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v))
    sdpa = dispatch.sdpa_call(q, k, causal=causal, window=window, need_lse=return_lse, needs_grad=needs_grad)
    return dispatch.choose("auto", q, fn="auto_backend", sdpa=sdpa, deterministic=deterministic)
