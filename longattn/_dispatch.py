"""Backend selection: which implementation runs a call.

``"torch"`` always works. ``"triton"`` needs a CUDA GPU of compute capability 8.0 or newer (or the Triton
interpreter, ``TRITON_INTERPRET=1``, with CPU tensors) and inputs the kernels support; otherwise it raises.
``"auto"`` takes Triton for CUDA tensors the kernels support and PyTorch otherwise, warning once per reason when
a CUDA input falls back.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Optional, Tuple

import torch

BACKENDS = ("auto", "triton", "torch")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # other head dims are padded to the next power of two (at least 16) inside the kernels
_warned: set = set()


def interpret_mode() -> bool:
    """True when the Triton interpreter is requested (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def triton_unsupported_reason(q: torch.Tensor, block_size: Optional[Tuple[int, int]] = None) -> Optional[str]:
    """Why the Triton kernels cannot run on ``q`` (None when they can)."""
    if not triton_available():
        return "triton is not installed"
    if q.is_cuda:
        major, _ = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
        if major < 8:
            return f"the GPU has compute capability {major}.x; the kernels need 8.0 (Ampere) or newer"
        if q.dtype == torch.float32:
            return "float32 inputs (the GPU kernels take float16 and bfloat16)"
    elif not interpret_mode():
        return "the tensors are not on a CUDA GPU (set TRITON_INTERPRET=1 to run the kernels in the interpreter)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (supported: float16, bfloat16)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} (the kernels support up to {MAX_HEAD_DIM})"
    if block_size is not None:
        for name, b in zip(("block_q", "block_k"), block_size):
            if b < 16 or b & (b - 1):
                return f"{name}={b} (the kernels need a power of two >= 16)"
    return None


def choose(backend: str, q: torch.Tensor, *, fn: str, block_size: Optional[Tuple[int, int]] = None) -> str:
    """Resolve ``backend`` to ``"triton"`` or ``"torch"`` for a call of ``fn`` on ``q``."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto" and not q.is_cuda:
        return "torch"  # the interpreter is for testing the kernels, never an automatic choice
    reason = triton_unsupported_reason(q, block_size)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"{fn}: backend='triton' cannot run: {reason}")
        return "triton"
    if reason is None:
        return "triton"
    if q.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"longattn.{fn}: falling back to the PyTorch backend: {reason}", stacklevel=3)
    return "torch"
