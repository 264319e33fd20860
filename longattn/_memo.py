"""Values computed from a tensor's contents (usually with a device-to-host copy), and when they may be reused.

A value is reused for a tensor only where nothing can have written the tensor behind PyTorch's back since it was
computed, which the library cannot see in general: a tensor that shares memory with a NumPy array
(``torch.from_numpy``), one written through ``.data`` or by another library (DLPack) keeps its version counter
while its contents change. So a value is remembered only

- for tensors the library created itself (:func:`own`: the padding mask the transformers plug-in builds once per
  forward pass and hands to every layer), while the tensor lives and its version counter is unchanged; and
- for any tensor inside :func:`reuse_host_reads`, where the caller promises not to write the tensors it passes
  except through PyTorch's in-place operations (which bump the version counter).

Everything else is computed afresh on every call: a ``cu_seqlens`` tensor the user passes is read on every call.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Callable, Iterator, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

_REUSE = contextvars.ContextVar("longattn_reuse_host_reads", default=False)
_OWNED: dict = {}  # id(t) -> weak reference to t, for tensors the library created


def own(t: Tensor) -> Tensor:
    """Mark ``t`` as created by the library (no user code holds it to write): values computed from it are
    remembered while it lives and its version counter is unchanged. Returns ``t``."""
    key = id(t)
    _OWNED[key] = weakref.ref(t, lambda _, key=key: _OWNED.pop(key, None))
    return t


def _owned(t: Tensor) -> bool:
    ref = _OWNED.get(id(t))
    return ref is not None and ref() is t


@contextlib.contextmanager
def reuse_host_reads() -> Iterator[None]:
    """Inside this block, what longattn reads from a tensor's contents on the host (the boundaries of a
    ``cu_seqlens``, a padding mask's row counts, the documents of ``position_ids``) is read once per tensor object
    and version counter and reused by later calls given the same tensor, so the layers of a model sharing one
    ``cu_seqlens`` on a GPU synchronise once instead of once per layer.

    The promise the caller makes: inside the block, the tensors it passes are not written except through PyTorch's
    in-place operations (``copy_``, ``+=``, indexing assignment: these bump the version counter). Writes through
    ``.data``, through a NumPy array sharing the memory (``torch.from_numpy``) or by another library are not seen
    and would leave the old values in use. Remembered values are dropped when the outermost block exits.
    """
    token = _REUSE.set(True)
    try:
        yield
    finally:
        _REUSE.reset(token)
        if not _REUSE.get():
            for clear in _CACHES:
                clear()


_CACHES: list = []  # the clear() of every per_tensor memo


def per_tensor(size: int = 1) -> Callable[[Callable[[Tensor], T]], Callable[[Tensor], T]]:
    """Decorator: ``fn(t)``, remembered for the last ``size`` tensors ``t`` it saw where the module docstring allows
    it (``t`` created by the library, or inside :func:`reuse_host_reads`). An entry is used while its tensor is the
    same object (held weakly: it goes with the tensor, before the tensor's id can name another one) with the same
    version counter. Computed afresh for inference tensors (they have no version counter) and while
    ``torch.compile`` traces."""
    def decorate(fn: Callable[[Tensor], T]) -> Callable[[Tensor], T]:
        entries: dict = {}  # id(t) -> (weak reference to t, version, value)
        _CACHES.append(entries.clear)

        @functools.wraps(fn)
        def wrapper(t: Tensor) -> T:
            if not (_REUSE.get() or _owned(t)) or torch.compiler.is_compiling():
                return fn(t)
            try:
                version = t._version
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
