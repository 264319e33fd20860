"""Backend selection: which implementation runs a call.

``"torch"`` always works. ``"triton"`` needs a CUDA GPU of compute capability 8.0 or newer (or the Triton
interpreter, ``TRITON_INTERPRET=1``, with CPU tensors) and inputs the kernels support; otherwise it raises.
``"auto"``: for a call PyTorch's ``scaled_dot_product_attention`` computes exactly, SDPA's default kernel unless
the dispatch table (:mod:`longattn.backends.auto_table`) measured ours faster for that kind of call on that device;
for any other call, Triton for CUDA tensors the kernels support and PyTorch otherwise, warning once per reason
when a CUDA input falls back.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple, Optional, Tuple

import torch

from longattn._validation import BACKENDS, FP8_DTYPES, MAX_HEAD_DIM, check_backend
from longattn.backends import auto_table, sdpa

# Head dims up to MAX_HEAD_DIM are padded to the next power of two (at least 16) inside the kernels.
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # on a GPU; the interpreter also runs float32
FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper or newer
_warned: set = set()


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
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def triton_unsupported_reason(q: torch.Tensor, block_size: Optional[Tuple[int, int]] = None,
                              fp8_cache: bool = False) -> Optional[str]:
    """Why the Triton kernels cannot run on ``q`` (None when they can); ``fp8_cache``: the call reads float8 KV
    caches (which GPUs before sm_89 cannot convert; the interpreter can)."""
    if not triton_available():
        return "triton is not installed"
    fp8 = q.dtype in FP8_DTYPES
    if q.is_cuda:
        major, minor = capability(q.device)
        if major < 8:
            return f"the GPU has compute capability {major}.x; the kernels need 8.0 (Ampere) or newer"
        if (fp8 or fp8_cache) and (major, minor) < FP8_CAPABILITY:
            return (f"float8 {'inputs' if fp8 else 'caches'} need compute capability 8.9 or newer, the GPU has "
                    f"{major}.{minor}")
        if q.dtype not in KERNEL_DTYPES and not fp8:
            return f"dtype {q.dtype} (the GPU kernels take float16, bfloat16 and float8_e4m3fn)"
    elif not interpret_mode():
        return "the tensors are not on a CUDA GPU (set TRITON_INTERPRET=1 to run the kernels in the interpreter)"
    elif fp8:
        return "float8 inputs (the Triton interpreter does not round to float8 as the GPU does)"
    elif q.dtype not in KERNEL_DTYPES + (torch.float32,):
        return f"dtype {q.dtype} (the interpreted kernels take float16, bfloat16 and float32)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} (the kernels support up to {MAX_HEAD_DIM})"
    if block_size is not None:
        for name, b in zip(("block_q", "block_k"), block_size):
            if b < 16 or b & (b - 1):
                return f"{name}={b} (the kernels need a power of two >= 16)"
    return None


class SdpaCall(NamedTuple):
    """A call SDPA can compute exactly (see :func:`longattn.backends.sdpa.unsupported_reason`), described for the
    dispatch table."""

    causal: bool
    grouped: bool  # Hq != Hk
    needs_grad: bool  # the call builds an autograd graph (the table's fwd_bwd pass)


def sdpa_call(q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: Tuple[int, int], need_lse: bool,
              needs_grad: bool) -> Optional[SdpaCall]:
    """The :class:`SdpaCall` of a ``flash_attention`` call, or None when SDPA cannot compute it exactly."""
    if sdpa.unsupported_reason(q, k, causal=causal, window=window, need_lse=need_lse) is not None:
        return None
    return SdpaCall(causal, q.shape[2] != k.shape[2], needs_grad)


def choose(backend: str, q: torch.Tensor, *, fn: str, block_size: Optional[Tuple[int, int]] = None,
           sdpa: Optional[SdpaCall] = None, fp8_cache: bool = False) -> str:
    """Resolve ``backend`` to ``"sdpa"``, ``"triton"`` or ``"torch"`` for a call of ``fn`` on ``q``.

    ``sdpa`` describes the call when PyTorch's SDPA computes it exactly; ``auto`` then runs SDPA unless our
    kernels run it and the dispatch table says they are faster. Without it, ``auto`` runs our kernels where they
    run and the PyTorch backend elsewhere. ``fp8_cache``: the call reads float8 KV caches.
    """
    check_backend(backend, fn)
    if backend == "torch":
        return "torch"
    reason = triton_unsupported_reason(q, block_size, fp8_cache)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"{fn}: backend='triton' cannot run: {reason}")
        return "triton"
    if not q.is_cuda:
        reason = "not a CUDA tensor"  # the interpreter is for testing the kernels, never an automatic choice
    if sdpa is not None:
        if reason is not None:
            return "sdpa"
        pass_ = "fwd_bwd" if sdpa.needs_grad else "fwd"
        return auto_table.choice(auto_table.device_class(q.device), pass_, sdpa.causal, sdpa.grouped,
                                 q.shape[-1])
    if reason is None:
        return "triton"
    if q.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"longattn.{fn}: falling back to the PyTorch backend: {reason}", stacklevel=3)
    return "torch"
