"""Backends: what runs an :class:`~longattn.call.AttentionCall`.

Each backend offers the same small interface: ``attention(q, k, v, call)`` with autograd, ``forward`` /
``backward`` without (the ring code's building blocks), and ``decode(q, call, return_lse)`` for KV-cache calls.
``torch`` (:mod:`longattn.backends.torch`) runs anywhere; ``triton`` (:mod:`longattn.backends.triton`) runs our
kernels, each pass planned by :mod:`.triton.planner` (a :class:`.plan.Plan`, from the :mod:`.routing` settings);
``sdpa`` (:mod:`.sdpa`) is PyTorch's own attention for the calls it computes exactly (``attention`` and ``decode``
only); ``fa4`` (:mod:`.fa4`) is FlashAttention-4 where it is installed (``attention`` only). :mod:`.dispatch` orders
them; :mod:`longattn.runner` runs the choice; :mod:`.device` holds the device facts they read.
"""
from __future__ import annotations

from types import ModuleType

from torch.compiler import is_compiling  # (by name: this package's submodule `torch` would shadow the module)

IMPLS = ("triton", "torch", "sdpa", "fa4")


def backend_module(impl: str) -> ModuleType:
    """The module of backend ``impl``: ``attention(q, k, v, call)`` and ``decode(q, call, return_lse)`` for the
    calls it takes (``"triton"`` is imported on first use: it needs Triton). Under ``torch.compile``'s tracing the
    module comes from its import, the cache neither read nor filled (Dynamo would guard on the cache's contents,
    which the first traced call of a process changes: one more compilation on the next call)."""
    if is_compiling():
        return _import(impl)
    module = _MODULES.get(impl) if type(impl) is str else None
    if module is None:
        module = _import(impl)
        _MODULES[impl] = module  # (an import statement per call costs a small call's host time)
    return module


_MODULES: dict = {}


def _import(impl: str) -> ModuleType:
    if impl == "triton":
        from longattn.backends.triton import entry

        return entry
    if impl == "torch":
        from longattn.backends import torch as torch_backend

        return torch_backend
    if impl == "sdpa":
        from longattn.backends import sdpa

        return sdpa
    if impl == "fa4":
        from longattn.backends import fa4

        return fa4
    raise ValueError(f"unknown backend implementation {impl!r}; expected one of {IMPLS}")
