"""Autocast: every attention function follows SDPA's rule, whatever route runs the call.

Under ``torch.autocast(device_type, dtype)`` PyTorch's ``F.scaled_dot_product_attention`` casts its floating
inputs (float16, bfloat16 and float32; not float64) to the autocast dtype and returns that dtype. longattn's
functions do the same on every route (SDPA, the Triton kernels, the PyTorch backend), so a model's attention output
has one dtype under autocast whichever call runs: :func:`cast_inputs` at the public entry, before the arguments are
checked, then the call runs with autocast off (:func:`off`), so the PyTorch backend keeps its own float32
accumulation instead of having its products recast. FP8 inputs are never cast (their ``out_dtype`` decides), nor
float64 ones, nor tensors of another device type than the queries'.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``."""
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta, ...)
        return False


def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast casts ``x`` to (its device type's autocast dtype), or None where autocast is off for that
    device type or does not cast ``x``'s dtype."""
    if x.dtype not in _CASTABLE or not enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


def cast_inputs(q: Tensor, *others: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """``(q, *others)`` cast to the autocast dtype of ``q``'s device type where autocast is on, as SDPA casts its
    inputs (what is not a tensor autocast would cast is returned unchanged, for the argument checks that follow to
    name); unchanged where it is off."""
    dtype = autocast_dtype(q) if isinstance(q, Tensor) else None
    if dtype is None:
        return (q,) + others
    return tuple(x.to(dtype) if isinstance(x, Tensor) and x.device.type == q.device.type and x.dtype in _CASTABLE
                 else x for x in (q,) + others)


def off(x: Tensor):
    """A context in which autocast is off for ``x``'s device type (a null context where it is not on)."""
    if not enabled(x.device.type):
        return _NULL
    return torch.autocast(x.device.type, enabled=False)


_NULL = contextlib.nullcontext()  # (stateless and reentrant: one serves every call)
