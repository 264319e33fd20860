"""Facts about the device a call runs on, read by the backends and the dispatch: compute capability, the Triton
interpreter, whether Triton is installed. Nothing here decides anything."""
from __future__ import annotations

import functools
import os
from typing import Tuple

import torch


def interpret_mode() -> bool:
    """True when the Triton interpreter is requested (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device``: its own, or the current device's when it has none."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> Tuple[int, int]:
    """Compute capability of a CUDA ``device`` (the current device when it has no index); ``(0, 0)`` elsewhere."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device_index(device))


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton can be imported."""
    try:
        import triton  # noqa: F401 - the import is the check
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True
