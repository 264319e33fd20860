"""First calls that compile: a progress line naming what is compiling, and the compilation time, said once.

On a GPU the first call of each Triton/Gluon kernel variant (and of FlexAttention for each shape) compiles it,
seconds each on a fresh machine. Each row runs once before it is measured (a warm-up outside the measurements);
:meth:`FirstCalls.run` runs that call, announcing the compilation when the row's kernel variant (its *key*, from
:meth:`longattn.bench.peers.Peer.compile_key`) has not run yet, and :meth:`FirstCalls.steady` records a later
call's time: a first call's excess over it is compilation. :meth:`FirstCalls.summary` gives the total for the end
of the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Optional

import torch

from longattn.bench.progress import Progress

TRITON = "Triton/Gluon kernels"  # what compiles, the first element of a compile key
FLEX = "FlexAttention (torch.compile)"
FA4 = "FlashAttention-4 kernels (CuTe DSL)"


def announcement(what: str, label: str) -> str:
    """The progress line printed before a first call that compiles."""
    return f"compiling {what} for {label} (first call, once)..."


@dataclass
class FirstCalls:
    """The first calls of a run that compiled, by compile key: ``{key: [seconds of the first call, seconds of a
    later one]}``."""

    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    calls: Dict[Hashable, list] = field(default_factory=dict)

    def run(self, step: Callable[[], None], device: torch.device, key: Optional[tuple], label: str) -> None:
        """Run ``step`` once (synchronised). When ``key`` (``(what compiles, variant...)``, None: nothing compiles)
        is new, say first that it compiles, and time the call."""
        fresh = key is not None and key not in self.calls
        if fresh:
            self.progress.note(announcement(key[0], label))
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if fresh:
            self.calls[key] = [time.perf_counter() - t0, 0.0]

    def steady(self, key: Optional[tuple], seconds: float) -> None:
        """The time of a call after the first of ``key`` (its compiled kernel alone), once."""
        entry = self.calls.get(key) if key is not None else None
        if entry is not None and not entry[1]:
            entry[1] = seconds

    def total_s(self) -> float:
        """Seconds the first calls spent beyond the compiled kernels' own time: the compilation."""
        return sum(max(0.0, first - later) for first, later in self.calls.values())

    def summary(self, run_s: float) -> str:
        """The line said once at the end of a run ('' when nothing compiled)."""
        if not self.calls:
            return ""
        return (f"first-call compilation took {self.total_s():.1f} s of the {run_s:.1f} s "
                f"({len(self.calls)} kernel variants; a second run reuses Triton's cache)")
