"""Values computed from a tensor's contents (usually with a device-to-host copy), remembered while the tensor lives
and is not written in place: the layers of a model receive the same ``cu_seqlens``, mask or ``position_ids`` tensor,
so a host synchronisation they need is paid once per step, not once per layer."""
from __future__ import annotations

import functools
import weakref
from typing import Callable, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def per_tensor(size: int = 1) -> Callable[[Callable[[Tensor], T]], Callable[[Tensor], T]]:
    """Decorator: remember ``fn(t)`` for the last ``size`` tensors ``t`` it saw. An entry is used while its tensor is
    the same object (held weakly: it goes with the tensor, before the tensor's id can name another one) with the same
    version counter (bumped by every in-place write through PyTorch). Computed afresh, not remembered, for inference
    tensors (they have no version counter) and while ``torch.compile`` traces."""
    def decorate(fn: Callable[[Tensor], T]) -> Callable[[Tensor], T]:
        entries: dict = {}  # id(t) -> (weak reference to t, version, value)

        @functools.wraps(fn)
        def wrapper(t: Tensor) -> T:
            try:
                version = t._version
            except RuntimeError:
                return fn(t)
            if torch.compiler.is_compiling():
                return fn(t)
            key = id(t)
            hit = entries.get(key)
            if hit is not None and hit[0]() is t and hit[1] == version:
                return hit[2]
            value = fn(t)
            if len(entries) >= size:
                entries.clear()
            entries[key] = (weakref.ref(t, lambda _, key=key: entries.pop(key, None)), version, value)
            return value

        return wrapper

    return decorate
