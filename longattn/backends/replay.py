"""A call's kernel launches recorded on its first run and replayed on the next runs of the same signature.

Short calls spend much of their time on the host: building each launch's forty-odd arguments (strides, sizes,
flags), keying its specialisation and finding the compiled kernel costs tens of microseconds a launch, several
times a call, and where the GPU would finish first that host time is the call's time. A caller that keys its
calls by everything the arguments are computed from (shapes, strides, dtypes, alignment, the options, the
routing) records the launches of one run (:func:`recording`, with :func:`note` called by
:func:`longattn.backends.cached_launch.launch`) and turns them into a :class:`Replay`: each launch's
:class:`~longattn.backends.cached_launch.CachedLaunch`, grid and arguments, the tensors among them named by the
caller's slots. Later runs with that key pass their own tensors for the slots; every other argument is the
recorded value, which the key determines.

A recording is refused (None) where an argument cannot be named: a tensor that is none of the named ones (made
inside the recorded code: its replay would read a stale tensor), or an argument of a type that is not a plain
value (a launch through Triton's JIT is replayed through the JIT: :class:`JitLaunch`), or a tensor passed by keyword
or in the grid (only positional tensors are substituted). A host-side TMA descriptor (``TensorDescriptor``) of a named
tensor is kept without its tensor and replayed as a copy over the slot's tensor (its shape and strides are what the key
determines); one by keyword or in the grid, of a class without a ``__dict__``, or with a field besides the known ones
(:data:`_DESCRIPTOR_FIELDS`), is refused. The caller then runs its
code as usual. One tensor under two names (``q`` passed as ``k`` too) is recorded under the first; callers key replays
by :func:`aliasing` too, so that a recording is replayed only where the same names share tensors.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from torch import Tensor

_PLAIN = (int, float, bool, str, type(None))
_ACTIVE = threading.local()  # (autograd runs a backward in its own thread: recordings are per thread)


class Recording:
    """The launches made while :func:`recording` is active: ``(launcher, grid, args)``, ``launcher`` an object
    whose ``on(grid, *args)`` makes the launch again (a ``CachedLaunch``, or :class:`JitLaunch`)."""

    def __init__(self):
        self.launches: List[Tuple[Any, tuple, tuple]] = []


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Record the launches :func:`longattn.backends.cached_launch.launch` makes in this thread, inside the block."""
    rec, before = Recording(), getattr(_ACTIVE, "rec", None)
    _ACTIVE.rec = rec
    try:
        yield rec
    finally:
        _ACTIVE.rec = before


def active() -> bool:
    """Whether a recording is active in this thread."""
    return getattr(_ACTIVE, "rec", None) is not None


def note(launcher: Any, grid: tuple, args: tuple) -> None:
    """A launch on ``grid`` with positional ``args`` through ``launcher`` (``launcher.on(grid, *args)`` launches
    it again), kept where a recording is active in this thread."""
    rec = getattr(_ACTIVE, "rec", None)
    if rec is not None:
        rec.launches.append((launcher, grid, args))


class JitLaunch:
    """A launch through Triton's JIT (``fn[grid](*args, **kwargs)``), which specialises and finds the kernel each
    time: what launches of arguments :func:`~longattn.backends.cached_launch.spec_key` does not key, the
    interpreter's and ``LONGATTN_DIRECT_LAUNCH=0``'s replay through."""

    def __init__(self, fn: Any, kwargs: dict):
        self.fn, self.kwargs = fn, kwargs

    def on(self, grid: tuple, *args: Any) -> None:
        self.fn[grid](*args, **self.kwargs)


def aliasing(slots: Sequence[Tensor]) -> tuple:
    """Which slots hold one tensor: each slot's first slot holding the same tensor (part of a replay's key)."""
    ids = [id(t) for t in slots]
    return tuple(map(ids.index, ids))


class Replay:
    """Recorded launches with their tensor arguments as slots: :meth:`run` launches each with the tensors given."""

    def __init__(self, launches: Sequence[Tuple[Any, tuple, list, Tuple[Tuple[int, int, Any], ...]]]):
        self._launches = tuple(launches)

    @staticmethod
    def of(rec: Recording, slots: Sequence[Tensor]) -> Optional["Replay"]:
        """The replay of ``rec`` with its tensor arguments taken from ``slots`` (by identity), or None where it
        cannot be replayed (the module's docstring)."""
        names: dict = {}
        for i, t in enumerate(slots):
            names.setdefault(id(t), i)
        if not rec.launches:
            return None
        launches = []
        for launcher, grid, args in rec.launches:
            if any(isinstance(a, Tensor) or is_descriptor(a)
                   for a in (*getattr(launcher, "kwargs", {}).values(), *(grid if isinstance(grid, tuple) else ()))):
                return None  # (a tensor or descriptor by keyword, or in the grid: never substituted)
            values, patches = list(args), []
            for pos, a in enumerate(args):
                if isinstance(a, Tensor):
                    slot = names.get(id(a))
                    if slot is None or slots[slot] is not a:
                        return None
                    patches.append((pos, slot, None))
                    values[pos] = None
                elif is_descriptor(a):
                    slot = names.get(id(a.base))
                    if (slot is None or slots[slot] is not a.base or not hasattr(a, "__dict__")
                            or not _DESCRIPTOR_FIELDS.issuperset(a.__dict__)):
                        return None  # (unnamed, a class with slots, or a field whose meaning is unknown here)
                    patches.append((pos, slot, _over(a, None)))  # (kept without its base: no tensor held)
                    values[pos] = None
                elif a.__class__ not in _PLAIN:
                    return None
            launches.append((launcher, grid, values, tuple(patches)))
        return Replay(launches)

    def run(self, slots: Sequence[Tensor]) -> None:
        """Launch every recorded launch, in order, with ``slots`` in place of the recorded tensors."""
        for launcher, grid, values, patches in self._launches:
            args = values.copy()
            for pos, slot, desc in patches:
                args[pos] = slots[slot] if desc is None else _over(desc, slots[slot])
            launcher.on(grid, *args)


# The fields of Triton's and Gluon's host-side ``TensorDescriptor`` (3.6 to 3.9), all of them values the replay's key
# determines once the base is replaced. A descriptor with any other field is not replayed: a later Triton could keep
# state made from the base there (an encoded tensor map, an address), which a copy would carry to another tensor.
_DESCRIPTOR_FIELDS = frozenset(("base", "shape", "strides", "block_shape", "layout", "padding", "round_f32_to_tf32"))


def is_descriptor(a: Any) -> bool:
    """Whether ``a`` is a host-side TMA descriptor (Triton's or Gluon's ``TensorDescriptor``)."""
    return a.__class__.__name__ == "TensorDescriptor" and isinstance(getattr(a, "base", None), Tensor)


def _over(desc: Any, t: Optional[Tensor]) -> Any:
    """``desc`` over ``t``: a shallow copy with ``t`` as its base (the recorded shape, strides, block and layout;
    None: a template that holds no tensor, what a replay keeps)."""
    d = desc.__class__.__new__(desc.__class__)  # (a quarter of copy.copy's host time; no __post_init__ rerun)
    d.__dict__.update(desc.__dict__)
    d.base = t
    return d
