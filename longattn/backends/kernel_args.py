"""Launch helpers shared by the Triton and the Gluon launchers: the ALiBi form a forward kernel computes, the
scratch allocator device-side tensor descriptors need, grid arithmetic (:func:`cdiv`), and the constants both
families of kernels compute with (each kernel module makes its ``constexpr`` of them: :data:`LOG2E`, :data:`LN2`)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from torch import Tensor

LOG2E = 1 / math.log(2)  # log2(e) = 1.4426950408889634: scores are scaled into base 2 once, for exp2
LN2 = math.log(2)  # 0.6931471805599453: base-2 log-sum-exps back to natural units
# FP8 forwards store the probabilities times 2**P_SHIFT before their float8 rounding (P <= 1 would otherwise lose
# the bits below float8's smallest normal) and divide the product by it; the Triton and Gluon forwards share it
P_SHIFT = 8.0


def alibi_kind(slopes: Optional[Tensor], band, alibi_offset: int) -> int:
    """The forward kernels' ``ALIBI``: 0 without slopes; 2 where no visible key of a query lies right of ALiBi's
    diagonal (``right <= alibi_offset``: causal calls; ``band`` the kernels' band arguments), so that the distances
    split into a row and a column term (one operation per score instead of several); else 1."""
    if slopes is None:
        return 0
    return 2 if band.has_right and band.right <= alibi_offset else 1


try:  # (imported once: a launch asks on every call)
    from triton.runtime._allocation import NullAllocator as _NullAllocator, _allocator
except ImportError:  # pragma: no cover - a Triton without this module: ensure_allocator sets ours
    _NullAllocator = _allocator = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``, on the host (``triton.cdiv``'s value, without its constexpr-function call)."""
    return -(-a // b)


def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: launches run under its guard


def ensure_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch from Triton's allocator. Triton keeps it in a
    context variable (unset in autograd's worker thread, for one); install one from torch's caching allocator where
    none is set, leaving a user's own in place."""
    if _allocator is not None and not isinstance(_allocator.get(), _NullAllocator):
        return
    triton.set_allocator(_torch_scratch)
