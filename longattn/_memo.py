"""Values computed from a tensor's contents (usually with a device-to-host copy), and when they are reused.

A read of a GPU tensor's values stalls the host until the GPU has caught up, so the layers of a model that share
one ``cu_seqlens`` (or mask, or ``position_ids``) tensor should pay it once, not once per layer. What is reused,
exactly:

- **CPU tensors are read on every call** (a read costs nothing, and a NumPy array sharing the memory, through
  ``torch.from_numpy``, may be rewritten at any time), except tensors the library created itself (:func:`own`).
- **Other tensors (CUDA) are read once per tensor object, version counter and data pointer**: writes through
  PyTorch's in-place operations (``copy_``, ``+=``, indexing assignment, ``set_``) bump the version counter and are
  seen; so is new memory under the same object (``t.data = other``: a new data pointer); a new tensor is read
  afresh. A write into the *same memory* that bypasses the version counter cannot be detected without reading the
  memory, and is not seen: ``t.data.copy_(...)``, DLPack / CuPy / a custom kernel writing a reused buffer, a CUDA
  graph replay. For those, pass a new tensor, or turn reuse off inside ``with longattn.remember_host_reads(False):``,
  where every such tensor is read on every call.
- Tensors the library created itself (:func:`own`: the padding mask the transformers plug-in builds once per
  forward pass and hands to every layer) are remembered while they live and their version is unchanged.
- Nothing is remembered while ``torch.compile`` traces, nor for inference tensors (no version counter).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Callable, Iterator, TypeVar

import torch
from torch import Tensor

from longattn._flags import check_flag

T = TypeVar("T")

_REMEMBER = contextvars.ContextVar("longattn_remember_host_reads", default=True)
_OWNED: dict = {}  # id(t) -> weak reference to t, for tensors the library created
_CACHES: list = []  # the clear() of every per_tensor memo


def own(t: Tensor) -> Tensor:
    """Mark ``t`` as created by the library (no user code holds it to write): values computed from it are
    remembered while it lives and its version counter is unchanged, on any device. Returns ``t``."""
    key = id(t)
    _OWNED[key] = weakref.ref(t, lambda _, key=key: _OWNED.pop(key, None))
    return t


def _owned(t: Tensor) -> bool:
    ref = _OWNED.get(id(t))
    return ref is not None and ref() is t


@contextlib.contextmanager
def remember_host_reads(enabled: bool = True) -> Iterator[None]:
    """Inside ``with longattn.remember_host_reads(False):``, what longattn reads on the host from a GPU tensor's
    contents (the boundaries of a ``cu_seqlens``, the documents of ``position_ids``) is read on every call, so
    writes that bypass PyTorch's version counter (``.data``, DLPack, another library) are always seen, at the cost
    of one device-to-host synchronisation per call. ``True`` (the default outside any block) reads once per tensor
    object, version counter and data pointer (see :mod:`longattn._memo`). What was remembered is dropped when a
    block exits."""
    enabled = check_flag(enabled, "enabled", "remember_host_reads")
    token = _REMEMBER.set(enabled)
    try:
        yield
    finally:
        _REMEMBER.reset(token)
        for clear in _CACHES:
            clear()


def per_tensor(size: int = 1) -> Callable[[Callable[[Tensor], T]], Callable[[Tensor], T]]:
    """Decorator: ``fn(t)``, remembered for the last ``size`` tensors ``t`` it saw where the module docstring allows
    it. An entry is used while its tensor is the same object (held weakly: it goes with the tensor, before the
    tensor's id can name another one) with the same version counter and data pointer."""
    def decorate(fn: Callable[[Tensor], T]) -> Callable[[Tensor], T]:
        entries: dict = {}  # id(t) -> (weak reference to t, (version, data pointer), value)
        _CACHES.append(entries.clear)

        @functools.wraps(fn)
        def wrapper(t: Tensor) -> T:
            if torch.compiler.is_compiling():
                return fn(t)
            if not _owned(t) and (t.device.type == "cpu" or not _REMEMBER.get()):
                return fn(t)
            try:
                version = (t._version, t.data_ptr())
            except RuntimeError:
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
