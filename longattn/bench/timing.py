"""Timing, peak memory and failure classification for one implementation on one input.

- Time: on CUDA, ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs) with the 25/50/75% quantiles,
  falling back to CUDA events around warmed-up calls if Triton is missing; on a CPU, ``time.perf_counter`` around
  repeated calls after one warm-up (:func:`time_step`: the median and half the interquartile range). The suites
  time the implementations of one case in interleaved rounds (:func:`time_in_turns`): the median of the round
  medians, and as the spread half their range.
- Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` during one call minus what was allocated before it
  (the inputs, and for forward+backward the output gradient); on a CPU, the same quantity from the memory events
  of ``torch.profiler`` (approximate: it sees PyTorch's allocations only, and places an op's allocations at its
  start and its frees at its end, so it can overstate the peak a little).
- Failures: :func:`classify` turns an exception into ``"oom"``, ``"unsupported: ..."`` or ``"error: ..."``.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from longattn.bench.peers import AttnFn, Unsupported

if TYPE_CHECKING:
    from longattn.bench.results import Row

PASSES = ("fwd", "fwd_bwd")


@dataclass
class Timing:
    median_ms: float
    spread_ms: float
    reps: int


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Release cached memory (after an out-of-memory error, between sizes)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_step(fn: AttnFn, q: Tensor, k: Tensor, v: Tensor, pass_: str) -> Callable[[], None]:
    """A zero-argument call running ``fn`` forward (no autograd graph) or forward and backward."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    if pass_ == "fwd":
        def forward():
            with torch.no_grad():
                fn(q, k, v)
        return forward
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)

    def forward_backward():
        out = fn(qg, kg, vg)
        out.backward(do)
        qg.grad = kg.grad = vg.grad = None

    return forward_backward


def _quartiles(samples) -> Tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, statistics.median(samples), q3


def time_cuda(step: Callable[[], None], warmup_ms: float, rep_ms: float) -> Timing:
    try:
        import triton.testing

        q1, med, q3 = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, quantiles=[0.25, 0.5, 0.75])
        est_reps = -1  # do_bench chooses the count from its estimate
        return Timing(float(med), float(q3 - q1) / 2, est_reps)
    except ImportError:
        pass
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(0, int(warmup_ms / one) - 1)):
        step()
    samples = []
    for _ in range(max(5, min(1000, int(rep_ms / one)))):
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    q1, med, q3 = _quartiles(samples)
    return Timing(med, (q3 - q1) / 2, len(samples))


def time_cpu(step: Callable[[], None], budget_s: float, min_reps: int = 3, max_reps: int = 50,
             warmup: bool = True) -> Timing:
    if warmup:
        step()
    samples = []
    t_end = time.perf_counter() + budget_s
    while len(samples) < min_reps or (time.perf_counter() < t_end and len(samples) < max_reps):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    q1, med, q3 = _quartiles(samples)
    return Timing(med, (q3 - q1) / 2, len(samples))


def time_step(step: Callable[[], None], device: torch.device, quick: bool, share: int = 1) -> Timing:
    """Median and spread of ``step`` in milliseconds. ``share``: the number of rounds the caller splits one
    measurement's budget into (:func:`time_in_turns`); each call then gets that fraction of the warm-up, time and
    repeats, and on a CPU no warm-up call (the caller ran the step before)."""
    if share < 1:
        raise ValueError(f"share must be a positive number of rounds, got {share!r}")
    if device.type == "cuda":
        return time_cuda(step, warmup_ms=(10 if quick else 25) / share, rep_ms=(40 if quick else 100) / share)
    if share == 1:
        return time_cpu(step, budget_s=0.15 if quick else 1.0)
    return time_cpu(step, budget_s=(0.15 if quick else 1.0) / share, min_reps=1, max_reps=-(-50 // share),
                    warmup=False)


def peak_bytes(step: Callable[[], None], device: torch.device) -> Optional[int]:
    """Peak memory of one ``step`` beyond what was allocated before it (None if it cannot be measured)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    return _cpu_peak_bytes(step)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ log lines) for the duration of the block."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (e.g. captured by a test runner)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak_bytes(step: Callable[[], None]) -> Optional[int]:
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:  # pragma: no cover - very old torch
        return None
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side logs a line to stderr at every start and stop
        prof.start()
    try:
        step()
    finally:
        with _quiet_stderr():
            prof.stop()
    # An op's own allocations are placed at its start, the frees it does (outside its children) at its end.
    changes = []
    for e in prof.events():
        delta = getattr(e, "self_cpu_memory_usage", 0)
        if delta:
            changes.append((e.time_range.start if delta > 0 else e.time_range.end, delta))
    changes.sort()
    level = peak = 0
    for _, delta in changes:
        level += delta
        peak = max(peak, level)
    return peak


_OOM_WORDS = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")


def classify(err: BaseException) -> str:
    """Status text for a failed run: ``"oom"``, ``"unsupported: <why>"`` or ``"error: <type>: <message>"``."""
    if isinstance(err, Unsupported):
        return f"unsupported: {err}"
    if isinstance(err, MemoryError) or isinstance(err, getattr(torch.cuda, "OutOfMemoryError", ())):
        return "oom"
    text = str(err)
    if any(word in text.lower() for word in _OOM_WORDS):
        return "oom"
    if "No available kernel" in text or "No viable backend" in text:
        return "unsupported: no kernel for these inputs"
    first = text.strip().splitlines()[0] if text.strip() else ""
    if len(first) > 120:
        first = first[:117] + "..."
    return f"error: {type(err).__name__}: {first}"


def round_order(names: List[str], r: int) -> List[str]:
    """The order of ``names`` in round ``r`` of interleaved timing, from a Williams design: over ``n`` rounds (``2n``
    for an odd ``n``) every step runs right after every other one equally often and in every position; fewer rounds
    give part of that balance. What one step leaves behind then falls on the other steps in turn, not on the same
    one each round (on an H200, a host-bound step of ``auto`` running FA4 measured 0.69 ms after one step and 0.80
    ms after another, docs/benchmarks.md)."""
    n = len(names)
    if n == 0:
        return []
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    row = [(b + r) % n for b in base]
    if n % 2 and (r // n) % 2:
        row.reverse()
    return [names[i] for i in row]


def time_in_turns(steps: Dict, device: torch.device, quick: bool, rounds: int,
                  timer: Optional[Callable[[Callable[[], None]], float]] = None,
                  failed: Optional[Dict] = None) -> Dict:
    """Time the implementations of one case in interleaved rounds: each round times every step once, in the order
    :func:`round_order` gives for it;
    ``rounds`` rounds, each taking ``1 / rounds`` of one measurement's budget (:func:`time_step` with ``share``),
    so a drift of the machine (clock, heat, other processes) falls on every step alike instead of on whichever ran
    last, and the whole costs about what timing each step once did. The steps must have run once (warm).

    Returns ``{name: Timing}``: the median of the round medians, and as the spread half their range, the
    variation between rounds (which a drift shows up in), not the spread of the calls within one round.
    ``timer(step) -> ms`` replaces :func:`time_step` (tests). ``failed``: a dict that receives ``name -> exception``
    of a step raising in some round (it is left out of the result and of later rounds); without it the exception
    propagates."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds!r}")
    if timer is None:
        def timer(step):
            return time_step(step, device, quick, share=rounds).median_ms
    times: Dict[str, list] = {name: [] for name in steps}
    for r in range(rounds):
        for name in round_order(list(steps), r):
            step = steps[name]
            if failed is not None and name in failed:
                continue
            try:
                times[name].append(timer(step))
            except Exception as err:  # noqa: BLE001 - reported through ``failed``
                if failed is None:
                    raise
                failed[name] = err
    return {name: Timing(statistics.median(t), (max(t) - min(t)) / 2, len(t)) for name, t in times.items()
            if failed is None or name not in failed}


def measure_in_turns(cases: Sequence[Tuple["Row", Callable[[], Callable[[], None]]]], device: torch.device,
                     quick: bool, rounds: int, first_calls=None,
                     keys: Optional[Sequence[Optional[tuple]]] = None) -> List["Row"]:
    """``cases``: ``(row, make)`` pairs, ``make()`` giving a step. Each step is built and run once (a failure
    becomes its row's status, see :func:`classify`), then the ones that ran are timed taking turns
    (:func:`time_in_turns`) and their rows get the time and spread. Returns the rows, in order.

    ``first_calls`` (a :class:`longattn.bench.first_calls.FirstCalls`) runs the first calls, announcing those whose
    compile key (``keys[i]``, None: nothing compiles) is new, and learns their compiled time from the timing."""
    steps: Dict[int, Callable[[], None]] = {}
    keys = list(keys) if keys is not None else [None] * len(cases)
    for i, (row, make) in enumerate(cases):
        try:
            step = make()
            if first_calls is None:
                step()
                sync(device)
            else:
                first_calls.run(step, device, keys[i], f"{row.suite} {row.impl} {row.workload} N={row.n} {row.pass_}")
            steps[i] = step
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run gets a row saying so
            row.status = classify(err)
    times = time_in_turns(steps, device, quick, rounds)
    for i, t in times.items():
        cases[i][0].time_ms, cases[i][0].spread_ms = t.median_ms, t.spread_ms
        if first_calls is not None:
            first_calls.steady(keys[i], t.median_ms * 1e-3)
    return [row for row, _ in cases]
