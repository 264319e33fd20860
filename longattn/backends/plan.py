"""What runs a call, as one value: a :class:`Plan` names the backend, and for each pass (forward, backward, decode)
the kernel chosen with its tiles and options, and every candidate not chosen with the reason. Plans are made by
the planner of the backend (:mod:`longattn.backends.triton.planner`) from its ordered candidate tables, kept by the
call's signature, and run as they are: a launcher runs the kernel its plan names. ``longattn.explain`` returns the
plan of a call without running it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Tuple, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Choice:
    """The kernel that runs a pass, and its settings as ``(name, value)`` pairs (tiles, the view it walks)."""

    kernel: str
    options: Tuple[Tuple[str, object], ...] = ()

    def option(self, name: str, default=None):
        for k, v in self.options:
            if k == name:
                return v
        return default

    def __str__(self) -> str:
        return self.kernel + (f" ({', '.join(f'{k}={v}' for k, v in self.options)})" if self.options else "")


@dataclass(frozen=True)
class Rejected:
    """A candidate not chosen, and why."""

    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"not {self.kernel}: {self.reason}"


@dataclass(frozen=True)
class PassPlan:
    """One pass: ``name`` (``"fwd"``, ``"bwd"``, ``"dkdv"``, ``"dq"``, ``"decode"``; a dilated call's later
    branches ``"fwd[1]"``, ...; ``"bwd+dlse"``: the backward that runs instead where the loss also reads a returned
    log-sum-exp, named only where its kernel differs), the :class:`Choice` and the candidates before it that were
    :class:`Rejected`."""

    name: str
    chosen: Choice
    rejected: Tuple[Rejected, ...] = ()


@dataclass(frozen=True)
class Plan:
    """A call's plan: ``backend`` (``"sdpa"``, ``"triton"`` or ``"torch"``), the backends not chosen and why
    (``rejected``), the ``device`` planned for, and the passes the backend runs (none named for SDPA and the
    PyTorch backend, which run the call whole)."""

    backend: str
    passes: Tuple[PassPlan, ...] = ()
    rejected: Tuple[Rejected, ...] = ()
    device: str = ""

    def pass_(self, name: str) -> PassPlan:
        """The pass called ``name``; KeyError if the plan has none."""
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r} in the plan; it has {[p.name for p in self.passes]}")

    def kernel(self, name: str) -> str:
        """The kernel chosen for pass ``name``."""
        return self.pass_(name).chosen.kernel

    def __str__(self) -> str:
        lines = [f"backend {self.backend}" + (f" on {self.device}" if self.device else "")]
        lines += [f"  {r}" for r in self.rejected]
        for p in self.passes:
            lines.append(f"{p.name}: {p.chosen}")
            lines += [f"  {r}" for r in p.rejected]
        return "\n".join(lines)


class Kept:
    """Values made once per key and kept, at most ``size`` of them, the oldest going first: plans by call signature
    (a training loop or a generation asks for the same few every step)."""

    def __init__(self, size: int):
        self.size = size
        self._kept: Dict[Hashable, object] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value kept for ``key``, made by ``make()`` on its first request."""
        found = self._kept.get(key)
        if found is None:
            found = make()
            if len(self._kept) >= self.size:
                try:  # (threads may evict at once: the oldest may be gone, or the dict change under the iterator)
                    self._kept.pop(next(iter(self._kept)), None)
                except (RuntimeError, StopIteration):
                    pass
            self._kept[key] = found
        return found

    def find(self, key: Hashable) -> Optional[object]:
        """The value kept for ``key``, or None."""
        return self._kept.get(key)

    def values(self) -> List[object]:
        return list(self._kept.values())

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
