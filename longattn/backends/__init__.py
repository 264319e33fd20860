"""Backends: what runs an :class:`~longattn.call.AttentionCall`.

Each backend offers the same small interface: ``attention(q, k, v, call)`` with autograd, and ``forward`` /
``backward`` without (the ring code's building blocks). ``torch`` (:mod:`longattn.backends.torch`) runs anywhere;
``triton`` (:mod:`longattn.backends.triton`) runs our kernels, each pass looked up in :mod:`.registry`; ``sdpa``
(:mod:`.sdpa`) is PyTorch's own attention for the calls it computes exactly. :mod:`.dispatch` chooses between them.
"""
from __future__ import annotations

from types import ModuleType

IMPLS = ("triton", "torch")  # the backends that take a call (sdpa takes its own arguments)


def backend_module(impl: str) -> ModuleType:
    """The module of backend ``impl`` (``"triton"`` is imported on first use: it needs Triton)."""
    if impl == "triton":
        from longattn.backends.triton import ops

        return ops
    if impl == "torch":
        from longattn.backends import torch as torch_backend

        return torch_backend
    raise ValueError(f"unknown backend implementation {impl!r}; expected one of {IMPLS}")
