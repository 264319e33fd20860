"""Input checks shared by the attention layers of :mod:`longattn.nn`."""
from __future__ import annotations

import torch
from torch import Tensor


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


def check_layer_input(x, embed_dim: int, weight: Tensor, fn: str) -> None:
    """``x`` is a ``(batch, seq, embed_dim)`` tensor of the layer's parameter dtype (any dtype under autocast)."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != embed_dim:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{fn}: x must have shape (batch, seq, {embed_dim}), got {got}")
    if x.dtype != weight.dtype and not _autocast_on(x.device.type):
        raise TypeError(f"{fn}: x has dtype {x.dtype} but the layer's parameters are {weight.dtype}; convert one "
                        f"of them (e.g. layer.to({x.dtype})) or run under torch.autocast")
