"""The API's boolean flags: one check, for the argument checks (:mod:`longattn._validation`) and the modules below
them (:mod:`longattn._memo`), which cannot import those."""
from __future__ import annotations

import sys

import torch
from torch import Tensor


def check_flag(value, name: str, fn: str) -> bool:
    """A boolean flag: a ``bool``, a NumPy bool (``np.True_``) or a 0-d bool tensor (on a device with values);
    anything else is a TypeError.

    Truthy objects such as ``"False"``, ``1``, ``np.int64(1)`` or ``None`` are refused rather than silently read as
    a bool.
    """
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    if isinstance(value, Tensor) and value.dtype == torch.bool and value.dim() == 0:
        if value.device.type == "meta":
            raise TypeError(f"{fn}: {name} is a 0-d bool tensor on the meta device, which has no value; pass a bool")
        return bool(value.item())
    raise TypeError(f"{fn}: {name} must be a bool (or a 0-d bool tensor), got {type(value).__name__} {value!r}")


def _is_numpy_bool(value) -> bool:
    """Whether ``value`` is a NumPy bool scalar (without importing NumPy: only if it is loaded can one exist)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)
