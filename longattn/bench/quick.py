"""``longattn bench --quick`` on a GPU: a user's first look, JIT compilation included, within a time budget.

A fresh GPU machine compiles every Triton/Gluon kernel variant on its first call (seconds each) and FlexAttention
once per shape, pattern and pass: the full suites at quick sizes compile dozens of them. On a GPU, ``--quick``
without named suites therefore runs :data:`GPU_QUICK_PLAN`, a handful of rows whose first calls compile five
variants of our kernels (:func:`triton_variants` counts them; about nine kernels, a backward being several) and
no FlexAttention, and every ``--quick`` run on a GPU stops starting new cases once
:data:`GPU_QUICK_BUDGET_S` seconds are spent (:class:`TimeBudget`; ``--time-budget`` changes it), so that it cannot
run long: the cases it skipped are listed at the end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# What the suites of the plan stand for: one row of each kind a user asks about first.
OUR_KERNELS = ("longattn", "longattn-triton", "longattn-paged")  # rows that may run (and compile) our kernels


@dataclass(frozen=True)
class QuickCase:
    """One case of the GPU ``--quick`` plan: a suite's workload, pass and size, and the implementations run."""

    suite: str
    workload: str
    pass_: str
    n: int  # speed, memory: the sequence length; varlen: total tokens; decode: cached keys
    impls: Tuple[str, ...]


QUICK_PEERS = ("longattn", "longattn-triton", "sdpa")
GPU_QUICK_PLAN: Tuple[QuickCase, ...] = (
    QuickCase("speed", "dense", "fwd", 4096, QUICK_PEERS),
    QuickCase("speed", "causal", "fwd_bwd", 4096, QUICK_PEERS),
    QuickCase("memory", "dense", "fwd", 16384, ("longattn-triton", "sdpa", "materialized")),
    QuickCase("varlen", "varlen-causal", "fwd", 16384, ("longattn", "sdpa")),
    QuickCase("decode", "decode-nq1", "fwd", 32768, ("longattn", "longattn-triton", "longattn-paged", "sdpa",
                                                     "copy")),
)
GPU_QUICK_BUDGET_S = 60.0  # measuring stops starting cases after this; start-up, a last case and plots fit in 90 s
LEFT_OUT = "flex (compiles per shape), maxlen, scaling, accuracy, dispatch"


def describe(plan: Sequence[QuickCase]) -> str:
    """The plan in one line, for the terminal and the report."""
    def size(c: QuickCase) -> str:
        unit = {"varlen": " tokens", "decode": " cached keys"}.get(c.suite, "")
        return f"{c.n // 1024}k{unit}" if c.n % 1024 == 0 else f"{c.n}{unit}"

    cases = "; ".join(f"{c.suite} {c.workload} {c.pass_} N={size(c)}: {', '.join(c.impls)}" for c in plan)
    return (f"--quick on a GPU, a first look: {cases}. Not run: {LEFT_OUT} (`longattn bench` runs every suite; "
            f"measuring stops starting cases after the time budget)")


def quick_plan(device: torch.device, quick: bool) -> Optional[Tuple[QuickCase, ...]]:
    """The plan of a ``--quick`` run on ``device``: :data:`GPU_QUICK_PLAN` on a GPU, None elsewhere (a CPU runs
    every suite at its quick sizes: nothing compiles there)."""
    return GPU_QUICK_PLAN if quick and device.type == "cuda" else None


def default_suites(device: torch.device, quick: bool, all_suites: Sequence[str]) -> List[str]:
    """The suites a run without named suites runs: the plan's on a GPU with ``--quick``, else ``all_suites``."""
    plan = quick_plan(device, quick)
    if plan is None:
        return list(all_suites)
    return list(dict.fromkeys(c.suite for c in plan))


def default_budget(device: torch.device, quick: bool) -> Optional[float]:
    """Seconds a run may spend measuring before it stops starting cases: :data:`GPU_QUICK_BUDGET_S` for
    ``--quick`` on a GPU, None (no limit) otherwise."""
    return GPU_QUICK_BUDGET_S if quick and device.type == "cuda" else None


def plan_cases(plan: Sequence[QuickCase], suite: str, workloads: Optional[Sequence[str]] = None) -> List[QuickCase]:
    """The plan's cases of ``suite``; with ``workloads`` (``--workload``), those workloads instead, at the suite's
    size, pass and implementations (the first case of the suite as the template)."""
    cases = [c for c in plan if c.suite == suite]
    if not workloads or not cases or suite not in ("speed", "memory"):
        return cases
    chosen = [c for c in cases if c.workload in workloads]
    have = {c.workload for c in chosen}
    return chosen + [replace(cases[0], workload=w) for w in workloads if w not in have]


def triton_variants(jobs: Sequence[Tuple[str, str, str, str, int]]) -> List[Tuple[str, str, str]]:
    """Distinct ``(workload, pass, layout)`` of the planned ``(suite, impl, workload, pass, n)`` jobs that run our
    kernels (counting ``longattn`` as if ``backend="auto"`` chose them): each compiles its own Triton/Gluon kernel
    variant on its first call, whatever the size (a forward and backward counted as one; layout ``paged`` for a
    paged KV cache)."""
    return sorted({(w, p, "paged" if impl.endswith("-paged") else "") for _, impl, w, p, _ in jobs
                   if impl in OUR_KERNELS})


@dataclass
class TimeBudget:
    """Seconds a run may spend; :meth:`allow` is asked before each case and counts the cases refused per suite."""

    seconds: Optional[float] = None
    start: float = field(default_factory=time.perf_counter)
    skipped: Dict[str, int] = field(default_factory=dict)

    def spent(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start > self.seconds

    def allow(self, suite: str) -> bool:
        """True while time is left; else counts one case of ``suite`` as skipped and returns False."""
        if not self.spent():
            return True
        self.skipped[suite] = self.skipped.get(suite, 0) + 1
        return False

    def summary(self) -> str:
        """One line naming what the budget left out ('' when nothing)."""
        if not self.skipped:
            return ""
        parts = ", ".join(f"{suite} {n} case{'s' if n > 1 else ''}" for suite, n in self.skipped.items())
        return (f"time budget of {self.seconds:g} s used up: not run: {parts} (--time-budget 0 lifts the limit; "
                f"`longattn bench SUITE` without --quick runs a suite in full)")
