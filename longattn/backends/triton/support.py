"""Why the Triton backend cannot run a call: the GPU's compute capability, the dtypes, head dims and block sizes the
kernels take. Imports no Triton (the package's ``__init__`` registers nothing), so it answers where Triton is absent."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from longattn._validation import FP8_DTYPES, MAX_HEAD_DIM
from longattn.backends.device import capability, interpret_mode, triton_available

# Head dims up to MAX_HEAD_DIM are padded to the next power of two (at least 16) inside the kernels.
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # on a GPU; the interpreter also runs float32
FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper or newer


def unsupported_reason(q: torch.Tensor, block_size: Optional[Tuple[int, int]] = None,
                       fp8_cache: bool = False) -> Optional[str]:
    """Why the Triton kernels cannot run on ``q`` (None when they can); ``block_size``: a block-sparse call's
    blocks; ``fp8_cache``: the call reads float8 KV caches (which GPUs before sm_89 cannot convert; the interpreter
    can)."""
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
    elif q.dtype == torch.bfloat16 and not fp8_cache:
        # Its tl.dot multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584): results of 1e8. (The
        # float8-cache decode kernels turn bfloat16 queries into float16 before any product.)
        return "bfloat16 inputs (the Triton interpreter computes bfloat16 products wrongly; use float16 or float32)"
    elif q.dtype not in KERNEL_DTYPES + (torch.float32,):
        return f"dtype {q.dtype} (the interpreted kernels take float16 and float32)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} (the kernels support up to {MAX_HEAD_DIM})"
    if block_size is not None:
        for name, b in zip(("block_q", "block_k"), block_size):
            if b < 16 or b & (b - 1):
                return f"{name}={b} (the kernels need a power of two >= 16)"
    return None


def call_unsupported_reason(call) -> Optional[str]:
    """Why the Triton kernels cannot run this :class:`~longattn.call.AttentionCall` for what it asks beyond the
    inputs (None when they can): score modifications the kernels do not compute yet."""
    if not call.softcap and call.alibi is None:
        return None
    if call.branches or call.descale is not None:
        return "soft-capping or ALiBi with dilated branches or float8 inputs (not implemented)"
    return None


def cache_layout_reason(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[str]:
    """Why the Triton decode kernels cannot take these KV caches (None when they can): they read and write them in
    place, rows of the head dim with unit stride."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1:
            return (f"{name} without unit stride along head_dim (strides {c.stride()}; the kernels read and write "
                    "the caches in place)")
    return None
