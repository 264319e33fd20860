"""Launch a Triton kernel many times with arguments of one specialisation, at a fraction of the host cost.

A ``kernel[grid](...)`` call binds and specialises every argument, looks the compiled kernel up and checks the
globals it captured: about 30 µs of host time per launch on an H100 host with Triton 3.6, which is most of a decode
step. :class:`CachedLaunch` makes the first launch that way (Triton compiles or finds the kernel by its own rules)
and then launches the compiled kernel directly.

That is only right while the arguments keep the specialisation of the first launch: the owner must key its
``CachedLaunch`` objects by everything Triton specialises on (shapes, strides and other integers, dtypes, and
whether each pointer is 16-byte aligned; see :func:`longattn._validation.tensor_key`). The direct launch uses
Triton's compiled-kernel object (``CompiledKernel[grid](*args)``); where a Triton release does not offer it, or in
the interpreter, every launch goes through the JIT as usual, and a direct launch that raises falls back to the JIT
for good, with a warning. ``LONGATTN_DIRECT_LAUNCH=0`` turns the direct launches off.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional, Tuple


def _direct_enabled() -> bool:
    return os.environ.get("LONGATTN_DIRECT_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"


class CachedLaunch:
    """``fn`` on ``grid`` with fixed compile-time arguments and launch options; call it with the runtime arguments
    (positional, in the kernel's order)."""

    def __init__(self, fn: Any, grid: Tuple[int, ...], **kwargs: Any):
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self._runner: Optional[Callable] = None
        self._tail: tuple = ()
        self._disabled = False

    def __call__(self, *args: Any) -> None:
        if self._runner is not None:
            try:
                self._runner(*args, *self._tail)
                return
            except (TypeError, IndexError, ValueError) as e:  # a Triton whose compiled kernels launch otherwise
                warnings.warn(f"longattn: direct launch of {getattr(self.fn, '__name__', self.fn)} failed ({e}); "
                              "launching through Triton's JIT from now on", stacklevel=2)
                self._runner = None
                self._disabled = True
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if not self._disabled and _direct_enabled() and callable(getattr(kernel, "__getitem__", None)) and hasattr(kernel, "function"):
            names = list(getattr(self.fn, "arg_names", ()))
            tail = names[len(args):]
            if all(n in self.kwargs for n in tail):
                self._tail = tuple(self.kwargs[n] for n in tail)
                self._runner = kernel[self.grid]
