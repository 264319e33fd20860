"""Launch a Triton kernel many times with arguments of one specialisation, at a fraction of the host cost.

A ``kernel[grid](...)`` call binds and specialises every argument, looks the compiled kernel up and checks the
globals it captured: about 30 µs of host time per launch on an H100 host with Triton 3.6, which is most of a decode
step. :class:`CachedLaunch` makes the first launch that way (Triton compiles or finds the kernel by its own rules)
and then launches the compiled kernel directly.

That is only right while the arguments keep the specialisation of the first launch: the owner must key its
``CachedLaunch`` objects by everything Triton specialises on (:func:`launch` does so for any kernel, with
:func:`spec_key`; the decode plans key theirs by call signature, see :func:`longattn._validation.tensor_key`). The
direct launch uses Triton's compiled-kernel object (``CompiledKernel[grid](*args)``: it takes every argument, the
constexprs too, in the kernel's order, and allocates the global scratch device-side descriptors need, as the JIT's
launch does); where a Triton release does not offer it, or in the interpreter, every launch goes through the JIT as
usual, and a direct launch that raises falls back to the JIT for good, with a warning.
``LONGATTN_DIRECT_LAUNCH=0`` turns the direct launches off.

What Triton specialises on (``triton/runtime/jit.py``: ``JITFunction.run``, ``create_function_from_signature``,
``compute_cache_key``; per argument ``triton._C.libtriton.native_specialize_impl`` with the CUDA backend's
``BaseBackend.get_int_specialization`` / ``get_tensor_specialization``, ``triton/backends/compiler.py``; read and
probed alike in Triton 3.6 and 3.9): a compiled kernel is filed, per current device, under the specialisation of
every parameter and ``str(options)`` (the launch options given, ``num_warps`` and the like, and the debug and
instrumentation knobs). Per parameter: a constexpr by its value (kept apart by type here too: ``True``, ``1`` and
``1.0``); ``None`` as the constexpr ``None``; a bool as ``u1`` and a float as ``fp32``, nothing more (NaN and inf
alike); an int by type (``i32`` in ``[-2**31, 2**31)``, ``i64`` up to ``2**63 - 1``, ``u64`` beyond), ``== 1``
(then the constexpr 1) and ``% 16 == 0`` (the ``D`` attribute); a tensor by dtype and ``data_ptr() % 16 == 0``,
nothing else (not shape, strides or contents). ``do_not_specialize`` leaves a parameter its type alone (an int's, a
tensor's dtype), ``do_not_specialize_on_alignment`` drops its ``% 16`` class. :func:`spec_key` keys exactly that
(``tests/test_cached_launch.py`` checks it against the installed Triton's binder); a host-side tensor descriptor
(``TensorDescriptor``, Triton's or Gluon's) by its type string alone (element type, block shape, shared layout: not
its base, shape or strides, which the launcher encodes on every launch); other argument types (tuples, dtypes) are
not keyed: such launches go through the JIT, as all do on ROCm (its tensor specialisation adds a within-2-GB
class). A direct launch skips what the JIT checks on every launch besides the key:
that the globals a kernel captured keep their values, pre-run hooks, knobs changed after the first launch
(``TRITON_DEBUG`` and the like) and Triton 3.9's stage-inspection hook.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from longattn.backends.device import env
from longattn.backends.plan import Kept
from longattn.backends.replay import JitLaunch, active, is_descriptor, note


def _direct_enabled() -> bool:
    return env("LONGATTN_DIRECT_LAUNCH", "1") != "0" and env("TRITON_INTERPRET", "0") != "1"


class CachedLaunch:
    """``fn`` with fixed compile-time arguments and launch options, on ``grid`` (``__call__``) or any grid
    (:meth:`on`); call it with the runtime arguments (positional, in the kernel's order). Parameters after them that
    ``kwargs`` leaves out take their defaults. The first launch goes through Triton's JIT and keeps the compiled
    kernel it returns; later ones launch that kernel directly (its runner reads the current stream each time)."""

    def __init__(self, fn: Any, grid: Tuple[int, ...], **kwargs: Any):
        self.fn, self.grid, self.kwargs = fn, _grid3(grid), kwargs
        self._kernel: Any = None
        self._runners: Dict[tuple, Callable] = {}  # the compiled kernel's runner by grid
        self._tail: tuple = ()
        self._disabled = False
        self._proven = False  # a direct launch went through

    def __call__(self, *args: Any) -> None:
        self.on(self.grid, *args)

    def on(self, grid: Tuple[int, ...], *args: Any) -> None:
        """Launch on ``grid`` (one to three dimensions)."""
        grid = _grid3(grid)
        if self._kernel is not None:
            run = self._runners.get(grid)
            if run is None:
                if len(self._runners) >= 16:
                    self._runners.clear()
                run = self._runners[grid] = self._kernel[grid]
            try:
                run(*args, *self._tail)
                self._proven = True
                return
            except (TypeError, IndexError, ValueError) as e:
                if self._proven:  # (the form of the call is right: this error is the arguments', not ours)
                    raise
                # a Triton whose compiled kernels launch otherwise: found on the first direct launch
                warnings.warn(f"longattn: direct launch of {getattr(self.fn, '__name__', self.fn)} failed ({e}); "
                              "launching through Triton's JIT from now on", stacklevel=3)
                self._kernel = None
                self._runners.clear()
                self._disabled = True
        kernel = self.fn[grid](*args, **self.kwargs)
        if not self._disabled and _direct_enabled() and callable(getattr(kernel, "__getitem__", None)) and hasattr(kernel, "function"):
            params = getattr(self.fn, "signature", None)
            tail = list(params.parameters.values())[len(args):] if params is not None else ()
            if all(p.name in self.kwargs or p.default is not p.empty for p in tail):
                self._tail = tuple(self.kwargs.get(p.name, p.default) for p in tail)
                self._kernel = kernel


def _grid3(grid: Tuple[int, ...]) -> tuple:
    grid = tuple(grid)
    return grid if len(grid) == 3 else grid + (1,) * (3 - len(grid))


class _Unkeyed(Exception):
    """An argument :func:`spec_key` does not key: the launch goes through the JIT."""


def _arg_class(a: Any, specialize: bool = True, align: bool = True) -> Any:
    """What Triton's specialisation reads of a runtime argument (the module's docstring): an int's class as a small
    int (0 for the constexpr 1, else 2, 4 or 6 for ``i32``, ``i64``, ``u64``, plus 1 where it is ``% 16 == 0``);
    ``(dtype, aligned)`` of a tensor; the type of None, a bool or a float; a host-side tensor descriptor's type
    string. :func:`_keyer`'s code computes the same
    inline."""
    cls = a.__class__
    if cls is int:
        if specialize and a == 1:
            return 0
        return (2 if -2 ** 31 <= a < 2 ** 31 else 4 if a < 2 ** 63 else 6) + (specialize and align and a % 16 == 0)
    if a is None or cls is bool or cls is float:
        return cls
    if isinstance(a, torch.Tensor):
        return a.dtype, specialize and align and a.data_ptr() % 16 == 0
    if is_descriptor(a):
        from triton.runtime.jit import mangle_type
        return "tensordesc", mangle_type(a)
    raise _Unkeyed(cls.__name__)


_BY_VALUE = frozenset((int, bool, str, type(None)))


def _constexpr_class(v: Any) -> Any:
    """A constexpr's (or launch option's) value as Triton files it: by ``repr`` (``str`` of the specialisation list
    and of the options dict), so ``0.0`` and ``-0.0``, ``(1,)`` and ``(True,)`` stay apart and lists are keyed;
    plain ints, bools, strings and None by value (their ``repr`` follows from value and type)."""
    return (v, v.__class__) if v.__class__ in _BY_VALUE else (v.__class__, repr(v))


def _int_code(a: str, specialize: bool, align: bool) -> str:
    """:func:`_arg_class` of the int named ``a``, as an expression."""
    code = f"(2 if -2147483648 <= {a} <= 2147483647 else 4 if {a} <= 9223372036854775807 else 6)"
    if align and specialize:
        code = f"({code} + ({a} % 16 == 0))"
    return f"(0 if {a} == 1 else {code})" if specialize else code


def _keyer(modes: tuple) -> Callable[..., tuple]:
    """A function of the positional arguments (one per mode of ``modes``) giving :func:`_arg_class` of each
    runtime argument and :func:`_constexpr_class` of each constexpr, as straight-line code: a launch keys some 40
    arguments, and a Python call per argument cost more than the test itself (about 16 against 6 us a launch on a
    slow CPU). Arguments of other types than int, tensor, float, bool and None go to :func:`_arg_class`, which
    refuses them."""
    names = [f"a{i}" for i in range(len(modes))]
    parts = []
    for a, m in zip(names, modes):
        if m is None:
            parts.append(f"_constexpr_class({a})")
            continue
        specialize, align = m
        tensor = f"({a}.dtype, {a}.data_ptr() % 16 == 0)" if specialize and align else f"({a}.dtype, False)"
        parts.append(f"({_int_code(a, specialize, align)} if {a}.__class__ is int else {tensor} "
                     f"if isinstance({a}, Tensor) else {a}.__class__ if {a} is None or {a}.__class__ is float "
                     f"or {a}.__class__ is bool else _arg_class({a}, {specialize}, {align}))")
    namespace = {"Tensor": torch.Tensor, "_arg_class": _arg_class, "_constexpr_class": _constexpr_class}
    exec(f"def keyer({', '.join(names)}):\n    return ({''.join(p + ', ' for p in parts)})\n", namespace)
    return namespace["keyer"]


class _Params:
    """A kernel's parameters as :func:`spec_key` reads them: ``modes``, per parameter None (a constexpr, keyed by
    value) or ``(specialize, align)``; ``runtime``, the names of the runtime ones; the key functions of the
    positional arguments by their count (:func:`_keyer`)."""

    def __init__(self, fn: Any):
        self.fn = fn  # (kept alive, so that its id stays its own)
        self.modes = tuple(None if p.is_constexpr else (not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                           for p in getattr(fn, "params", ()))
        self.runtime = frozenset(p.name for p in getattr(fn, "params", ()) if not p.is_constexpr)
        self.keyers: Dict[int, Callable[..., tuple]] = {}

    def keyer(self, n: int) -> Callable[..., tuple]:
        found = self.keyers.get(n)
        if found is None:
            found = self.keyers[n] = _keyer(self.modes[:n])
        return found


_PARAMS: Dict[int, _Params] = {}


def spec_key(fn: Any, args: tuple, kwargs: Dict[str, Any]) -> Optional[tuple]:
    """What ``fn[grid](*args, **kwargs)`` is specialised on besides the device (see the module's docstring): the
    class of each positional argument (a constexpr's value and type), and the keyword arguments (constexprs, launch
    options; hashable) by name, value and type. None where an argument is of a type not keyed here."""
    params = _PARAMS.get(id(fn))
    if params is None:
        params = _PARAMS[id(fn)] = _Params(fn)
    if len(args) > len(params.modes):  # (not a Triton kernel, or too many arguments: the JIT says so)
        return None
    try:
        classes = params.keyer(len(args))(*args)
    except _Unkeyed:
        return None
    if not params.runtime.isdisjoint(kwargs):  # a runtime argument by name: through the JIT (not kept by value)
        return None
    values = tuple(kwargs.values())
    types = tuple(map(type, values))
    if _BY_VALUE.issuperset(types):  # (the usual launch: ints, bools, strings; one test for all of them)
        return classes, tuple(kwargs), values, types
    return classes, tuple((name, _constexpr_class(v)) for name, v in kwargs.items())


def _current_device() -> int:
    return torch.cuda.current_device()


# The key follows the CUDA backend's specialisation (ROCm's adds whether a tensor lies within 2 GB: not keyed here)
_KEYED_HERE = torch.version.hip is None
LAUNCHES = Kept(512)  # CachedLaunch objects by kernel, device and spec_key (the compiled kernel takes any grid)


def launch(fn: Any, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``fn[grid](*args, **kwargs)`` (runtime arguments positional), through a kept :class:`CachedLaunch`: the
    first launch of a specialisation goes through Triton's JIT, the next ones straight to the compiled kernel.
    Through the JIT every time where direct launches are off (the interpreter, ``LONGATTN_DIRECT_LAUNCH=0``) or an
    argument is not keyed."""
    key = spec_key(fn, args, kwargs) if _KEYED_HERE and _direct_enabled() else None
    if key is None:
        fn[grid](*args, **kwargs)
        if active():
            note(JitLaunch(fn, kwargs), grid, args)
        return
    launcher = LAUNCHES.get((id(fn), _current_device(), key), lambda: CachedLaunch(fn, grid, **kwargs))
    launcher.on(grid, *args)
    note(launcher, grid, args)
