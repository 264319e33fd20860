"""FP8 inputs of the forward functions: their descale factors, output dtype and the forward-only rule.

``flash_attention``, ``flash_attention_varlen`` and ``dilated_attention`` take ``float8_e4m3fn`` q, k and v (all
three) with float32 descale factors in FlashAttention-3's convention: the true values are ``x.float() * descale``,
one factor for the tensor ``(1,)`` or one per (batch, key/value head) ``(B, Hk)`` (per sequence of a packed batch);
a query head uses its key/value head's factor. The output is bfloat16 unless ``out_dtype`` says otherwise, the
log-sum-exp float32. FP8 attention is forward only (an inference path): inputs that require grad are an error.
The semantics are the operation on the dequantised values (:func:`longattn.reference.dequantize_fp8`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from longattn._validation import DTYPES, FP8_DTYPES, check_flag
from longattn.call import Descale

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8(t: Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def check(q: Tensor, k: Tensor, v: Tensor, descales: Tuple[Optional[Tensor], ...], out_dtype, *, batch: int,
          fn: str) -> Tuple[Optional[Descale], Optional[torch.dtype]]:
    """The :class:`~longattn.call.Descale` and output dtype of a call on checked inputs (``(None, None)`` for
    inputs that are not FP8; the output of FP8 inputs is bfloat16 unless ``out_dtype`` says otherwise).

    ``batch`` is the number of rows a per-head factor has (the batch, or the sequences of a packed batch); the
    inputs' key/value heads are ``k.shape[-2]``. Descales and ``out_dtype`` given with inputs that are not FP8 are
    an error, as are FP8 inputs that require grad (with grad mode on)."""
    if not is_fp8(q):
        given = [name for name, d in zip(_NAMES, descales) if d is not None]
        if out_dtype is not None:
            given.append("out_dtype")
        if given:
            raise ValueError(f"{fn}: {', '.join(given)} apply to float8_e4m3fn inputs only; q, k, v have dtype "
                             f"{q.dtype}")
        return None, None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"{fn}: FP8 attention is forward only, but q, k or v requires grad; detach them (or run "
                         "under torch.no_grad()), or train in bfloat16")
    hk = k.shape[-2]
    factors = []
    for name, d in zip(_NAMES, descales):
        if d is None:
            factors.append(torch.ones((batch, hk), dtype=torch.float32, device=q.device))
        else:
            check_descale(d, name, batch, hk, q.device, fn)
            factors.append(d.expand(batch, hk))
    if out_dtype is None:
        out_dtype = torch.bfloat16
    elif out_dtype not in OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got "
                        f"{out_dtype!r}")
    return Descale(torch.stack(factors).contiguous()), out_dtype


def check_descale(d, name: str, batch: int, kv_heads: int, device: torch.device, fn: str) -> None:
    """A descale factor: a float32 tensor ``(1,)`` (per tensor) or ``(batch, kv_heads)`` on ``device``."""
    if not isinstance(d, Tensor):
        raise TypeError(f"{fn}: {name} must be a float32 torch.Tensor or None, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise TypeError(f"{fn}: {name} must have dtype float32, got {d.dtype}")
    if d.device != device:
        raise ValueError(f"{fn}: {name} must be on the inputs' device {device}, got {d.device}")
    if tuple(d.shape) not in ((1,), (batch, kv_heads)):
        raise ValueError(f"{fn}: {name} must have shape (1,) (per tensor) or ({batch}, {kv_heads}) (per batch row "
                         f"or sequence, and key/value head), got {tuple(d.shape)}")


def quantize(x: Tensor, per_head: bool = False, kv_heads: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``(x_fp8, descale)``: ``x (B, S, H, D)`` scaled into float8_e4m3fn's range (its largest magnitude to 448)
    and rounded, with the float32 factor that gives the values back, ``(1,)`` for the tensor or ``(B, H)`` with
    ``per_head``. ``kv_heads`` (with ``per_head``, for the queries of a grouped-query call, whose descale is per
    key/value head as FlashAttention-3's): one factor per group of ``H / kv_heads`` query heads, ``(B, kv_heads)``.
    A helper for callers that hold bfloat16/float16 tensors; an all-zero tensor or head gets factor 1. ``x`` must
    be finite (an ``inf`` or NaN has no finite factor): checked with one device-to-host copy.
    """
    fn = "quantize_fp8"
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{fn}: x must have 4 dims (batch, seq, heads, head_dim), got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{fn}: x must have dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    per_head = check_flag(per_head, "per_head", fn)
    heads = x.shape[2]
    if kv_heads is not None:
        if not per_head:
            raise ValueError(f"{fn}: kv_heads groups the per-head factors: pass per_head=True with it")
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"{fn}: kv_heads must be a positive int dividing x's {heads} heads, got {kv_heads!r}")
    groups = kv_heads or heads
    top = torch.finfo(torch.float8_e4m3fn).max
    if x.numel() == 0:  # nothing to scale: factor 1
        amax = torch.zeros((x.shape[0], groups) if per_head else (1,), dtype=torch.float32, device=x.device)
    elif per_head:
        amax = x.abs().float().amax(dim=(1, 3)).reshape(x.shape[0], groups, heads // groups).amax(dim=2)
    else:
        amax = x.abs().float().amax().reshape(1)
    if _has_values(amax) and not bool(torch.isfinite(amax).all()):  # amax is inf or NaN where x is
        raise ValueError(f"{fn}: x has non-finite values (inf or NaN), which float8 cannot represent with a finite "
                         "scale; replace them (e.g. torch.nan_to_num) before quantising")
    descale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    shaped = descale.repeat_interleave(heads // groups, dim=1)[:, None, :, None] if per_head else descale
    return (x.float() / shaped).clamp(-top, top).to(torch.float8_e4m3fn), descale


def _has_values(t: Tensor) -> bool:
    """Whether ``t``'s values can be read (not a meta or fake tensor, as under ``torch.compile``'s tracing)."""
    return t.device.type != "meta" and not is_fake(t)
