"""Input checks shared by the attention layers of :mod:`longattn.nn`."""
from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor

from longattn import _validation as V
from longattn._validation import DTYPES

_AUTOCAST_DTYPES = {torch.float16, torch.bfloat16, torch.float32}


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


def check_layer_input(x, embed_dim: int, weight: Tensor, fn: str) -> None:
    """``x`` is a ``(batch, seq, embed_dim)`` floating-point tensor of the layer's parameter dtype (under autocast,
    float16, bfloat16 or float32 when the parameters are one of those)."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != embed_dim:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{fn}: x must have shape (batch, seq, {embed_dim}), got {got}")
    if x.dtype not in DTYPES:  # not even under autocast: the projections take floating inputs only
        raise TypeError(f"{fn}: x must be a floating-point tensor (float16, bfloat16, float32 or float64), got "
                        f"{x.dtype}; convert it to the layer's dtype with x.to({weight.dtype})")
    castable = {x.dtype, weight.dtype} <= _AUTOCAST_DTYPES  # autocast leaves float64 alone
    if x.dtype != weight.dtype and not (castable and _autocast_on(x.device.type)):
        raise TypeError(f"{fn}: x has dtype {x.dtype} but the layer's parameters are {weight.dtype}; convert one "
                        f"of them (x.to({weight.dtype}) or layer.to({x.dtype}))"
                        + (" or run under torch.autocast" if castable else ""))


def check_module_backend(backend, fn: str, what: str) -> str:
    """The ``backend`` of a module computing ``what`` (dilated or block-sparse attention): ``"auto"``, ``"triton"``
    or ``"torch"``. FlashAttention-4 computes neither, so ``"fa4"``, which every call would refuse, is refused here,
    at construction."""
    V.check_backend(backend, fn)
    if backend == "fa4":
        raise ValueError(f"{fn}: backend must be 'auto', 'triton' or 'torch', got 'fa4': FlashAttention-4 computes no "
                         f"{what}")
    return backend


def check_dropout(dropout, fn: str) -> float:
    """A dropout probability: a real number (a NumPy float too) in ``[0, 1)``; returned as a float."""
    if isinstance(dropout, bool) or not isinstance(dropout, Real) or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"{fn}: dropout must be a float in [0, 1), got {dropout!r}")
    return float(dropout)


def check_not_a_mask(cu_seqlens, fn: str, hint: str) -> None:
    """``TypeError`` where ``cu_seqlens`` is a floating-point or bool tensor: not packed boundaries but what a port
    from ``nn.MultiheadAttention`` or SDPA passes in its place (a key, an ``attn_mask``, a ``key_padding_mask``),
    which the packed path would misread as a shape error of the inputs. ``hint`` says what the layer takes instead."""
    if isinstance(cu_seqlens, Tensor) and (cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool):
        raise TypeError(f"{fn}: cu_seqlens must be an int32 (or int64) tensor of packed sequence boundaries, got "
                        f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}: {hint}")
