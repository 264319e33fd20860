"""Is this machine steady enough for its timings to mean something?

Two signs, both recorded in the report's metadata: the machine's load before the run (other processes competing
for the cores), and timed rows whose spread between repeats (between the rounds of interleaved timing) is large
against their median. A run showing either is
marked unstable: the report says so, and ``--compare`` refuses to call rows of such a run (or of such a baseline)
regressions. It refuses as well runs of a setup whose timings differ between runs beyond any threshold
(:data:`UNCOMPARABLE`: a CPU with ``--quick``).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

from longattn.bench.results import Row

MAX_LOAD_PER_CPU = 0.5  # 1-minute load average per core before the run, beyond the one process measuring
MAX_SPREAD = 0.15  # spread (the row's ±: half the range of its timing rounds) over its median
MAX_NOISY_SHARE = 0.5  # share of timed rows above MAX_SPREAD
# (device type, --quick, why): setups whose runs --compare refuses whatever their own spreads say. Two back-to-back
# CPU --quick runs of one build on an idle machine differed by up to +250% on rows of a few milliseconds.
UNCOMPARABLE = (
    ("cpu", True, "CPU --quick: calls of a few milliseconds timed for 0.15 s each differ between two runs of the "
                  "same build by more than any threshold (compare runs without --quick)"),
)


def machine_load() -> Dict[str, Any]:
    """The 1-minute load average and the core count, read before a run starts."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover - not on every platform
        load = None
    return {"load_1min": load, "cpus": os.cpu_count() or 1}


def assess(before: Dict[str, Any], rows: Sequence[Row]) -> Dict[str, Any]:
    """``{"unstable": bool, "reasons": [...], ...}`` from the load before the run and the rows' spreads."""
    timed = [r for r in rows if r.ok and r.time_ms and r.spread_ms is not None and not r.same_as]
    noisy = [r for r in timed if r.spread_ms / r.time_ms > MAX_SPREAD]
    reasons: List[str] = []
    load, cpus = before.get("load_1min"), before.get("cpus") or 1
    if load is not None and load - 1 > MAX_LOAD_PER_CPU * cpus:
        reasons.append(f"load average {load:.1f} on {cpus} cores before the run (other processes were busy)")
    if timed and len(noisy) > MAX_NOISY_SHARE * len(timed):
        reasons.append(f"{len(noisy)} of {len(timed)} timed rows spread more than {MAX_SPREAD:.0%} between repeats")
    return dict(before, timed_rows=len(timed), noisy_rows=len(noisy), unstable=bool(reasons), reasons=reasons)


def warning_lines(meta: Dict[str, Any]) -> List[str]:
    st = meta.get("stability") or {}
    if not st.get("unstable"):
        return []
    return ["WARNING: unstable machine, timings unreliable: " + "; ".join(st.get("reasons", []))]


def refusal(meta: Dict[str, Any]) -> str:
    """Why a run's timings must not be compared ('' when they may): marked unstable, or an :data:`UNCOMPARABLE`
    setup."""
    st = meta.get("stability") or {}
    if st.get("unstable"):
        return "; ".join(st.get("reasons", [])) or "marked unstable"
    for device, quick, why in UNCOMPARABLE:
        if meta.get("device_type") == device and bool(meta.get("quick")) == quick:
            return why
    return ""
