"""Facts about the device a call runs on, read by the backends and the dispatch: compute capability, the Triton
interpreter, whether Triton is installed, and :class:`Device`, those facts as one value a plan is made from. Nothing
here decides anything."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch


def env(name: str, default: Optional[str] = None) -> Optional[str]:
    """``os.environ.get(name, default)``, read on every call (a launch or a plan lookup reads its settings now, so a
    variable changed at run time takes effect on the next call)."""
    return os.environ.get(name, default)


def interpret_mode() -> bool:
    """True when the Triton interpreter is requested (kernels then run on CPU tensors)."""
    return env("TRITON_INTERPRET", "0") not in ("", "0")


# What the driver says once per device index, and whether Triton imports, kept in dicts rather than behind
# functools.lru_cache: Dynamo warns of "silent incorrectness" at every lru_cache it traces through (once a process,
# on a user's first compiled call). Dynamo does not trace the functions that read them (:func:`_constant_to_dynamo`:
# it calls them and takes the answer as a constant): tracing a read of a dict guards on its keys, and the first
# compiled call, whose trace fills them, would then be compiled again on the second.
_CAPABILITY: Dict[int, Tuple[int, int]] = {}
_SM_COUNT: Dict[int, int] = {}
_TRITON: Dict[str, bool] = {}


def _remembered(memo: dict, key, ask):
    """``memo[key]``, asked of ``ask()`` the first time."""
    found = memo.get(key)
    if found is None:
        found = memo[key] = ask()
    return found


def _constant_to_dynamo(fn):
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it (the attribute Dynamo reads), without
    that function's import of ``torch._dynamo`` (about 2 s), which ``import longattn`` does not pay."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_to_dynamo
def _capability(index: int) -> Tuple[int, int]:
    return _remembered(_CAPABILITY, index, lambda: torch.cuda.get_device_capability(index))


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device``: its own, or the current device's when it has none. ``ValueError`` for
    another device: a GPU kernel was asked to run on its tensors, as under made-up device facts."""
    if device.type != "cuda":
        raise ValueError(f"a GPU kernel cannot run on {device.type} tensors: the plan was made for made-up device "
                         "facts (longattn.routing(device=...)), which plan calls for longattn.explain; run the call "
                         "outside that routing")
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> Tuple[int, int]:
    """Compute capability of a CUDA ``device`` (the current device when it has no index); ``(0, 0)`` elsewhere."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device_index(device))


@_constant_to_dynamo
def triton_available() -> bool:
    """Whether Triton can be imported."""
    return _remembered(_TRITON, "available", _imports_triton)


def _imports_triton() -> bool:
    try:
        import triton  # noqa: F401 - the import is the check
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return _sm_count(device_index(device))


@_constant_to_dynamo
def _sm_count(index: int) -> int:
    return _remembered(_SM_COUNT, index, lambda: torch.cuda.get_device_properties(index).multi_processor_count)


@dataclass(frozen=True)
class Device:
    """The facts a plan is made from: whether the tensors are on a CUDA GPU, its compute capability (``(0, 0)``
    elsewhere), whether the Triton interpreter runs the kernels, and whether the Gluon kernels import (None: ask
    them). :func:`facts` reads them for a device; a test or ``longattn.explain`` may give made-up ones through
    ``longattn.routing(device=Device(...))`` to plan the Triton backend's passes, say, as on an sm_90 GPU on CPU
    tensors (with ``backend="triton"`` under the Triton interpreter; ``"auto"`` follows the tensors' device)."""

    cuda: bool = True
    capability: Tuple[int, int] = (9, 0)
    interpret: bool = False
    gluon: Optional[bool] = None

    def __post_init__(self):
        # (made-up facts come from users: ``gluon="no"`` would count as Gluon available, ``capability=(9,)`` fail
        # in the middle of a plan)
        for name in ("cuda", "interpret", "gluon"):
            x = getattr(self, name)
            if not (isinstance(x, bool) or (name == "gluon" and x is None)):
                raise TypeError(f"Device: {name} must be True or False{' or None' if name == 'gluon' else ''}, "
                                f"got {x!r}")
        c = self.capability
        if not (isinstance(c, tuple) and len(c) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in c)):
            raise TypeError(f"Device: capability must be a (major, minor) pair of ints >= 0, got {c!r}")

    @property
    def arch(self) -> str:
        """``"sm90"`` (Hopper and newer) or ``"sm80"`` (Ampere, Ada, and the interpreter)."""
        return "sm90" if self.capability[0] >= 9 else "sm80"

    def __str__(self) -> str:
        where = f"sm_{self.capability[0]}{self.capability[1]}" if self.cuda else "cpu"
        return where + (" (interpreter)" if self.interpret else "")


_FACTS: dict = {}  # (device, TRITON_INTERPRET) -> Device: a device's capability does not change


def facts(device: torch.device) -> Device:
    """The :class:`Device` facts of ``device`` as this process sees them (``TRITON_INTERPRET`` read each call)."""
    interpret = env("TRITON_INTERPRET", "0")
    found = _FACTS.get((device, interpret))
    if found is None:
        found = Device(device.type == "cuda", capability(device), interpret not in ("", "0"))
        if device.type != "cuda" or device.index is not None:  # (no index: the current device's, which may change)
            _FACTS[(device, interpret)] = found
    return found
