"""The benchmark suites: what is measured, at which sizes, producing :class:`~longattn.bench.results.Row` lists.

- ``speed``: forward and forward+backward time, TFLOP/s, tokens/s (and peak memory) of every implementation on
  every workload at a few sequence lengths (batch x N kept constant on a GPU).
- ``memory``: peak memory beyond the inputs, per token, against N (batch 1), forward and forward+backward.
- ``maxlen``: the longest sequence each implementation runs at batch 1: N doubles until a run fails for lack of
  memory, then bisection; capped by a size limit and a time limit per probe and per implementation.
- ``scaling``: forward time against N (batch 1) and against the batch (fixed N).
- ``accuracy``: max error of output and gradients against the float64 reference (:mod:`longattn.reference`) at a
  small awkward size, in float32 and in the benchmark dtype (bfloat16 when that is float32).
- ``dispatch``: SDPA's default against our kernels on the calls both compute, the data behind ``backend="auto"``
  (:mod:`longattn.bench.dispatch_suite`).
- ``varlen``: a packed batch of long-tailed documents, ``flash_attention_varlen`` against SDPA on the padded batch
  (:mod:`longattn.bench.varlen_suite`).
- ``decode``: new tokens against a KV cache (contiguous and paged), ``flash_attention_with_kvcache`` against SDPA
  (:mod:`longattn.bench.decode_suite`).
- ``score_mods``: soft-capping, ALiBi and attention sinks in ``flash_attention`` against the plain kernel and
  against FlexAttention's equivalent ``score_mod`` (:mod:`longattn.bench.score_mods_suite`).
- ``models``: one training step of gpt-oss- and Gemma-2-shaped transformers models under ``attn_implementation``
  ``"longattn"``, ``"eager"``, ``"sdpa"`` and ``"flex_attention"`` (:mod:`longattn.bench.models_suite`).

The GPU tables of ``docs/benchmarks.md`` are scripts of the repository's ``benchmarks/`` folder (not installed);
they use the helpers of :mod:`longattn.bench.interleaved`.

No failure escapes a suite: an implementation that raises, runs out of memory or cannot run a case gets a row
saying so (see :func:`longattn.bench.timing.classify`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from longattn.bench import timing as T
from longattn.bench.peers import Peer
from longattn.bench.first_calls import FirstCalls
from longattn.bench.progress import Progress
from longattn.bench.quick import QuickCase, TimeBudget, plan_cases, quick_plan
from longattn.bench.results import Row
from longattn.bench.decode_suite import run_decode
from longattn.bench.dispatch_suite import run_dispatch
from longattn.bench.models_suite import run_models
from longattn.bench.score_mods_suite import run_score_mods
from longattn.bench.varlen_suite import run_varlen
from longattn.bench.workloads import (WORKLOADS, Workload, granularity, make_inputs, make_workload, pass_flops)

SUITES = ("speed", "memory", "maxlen", "scaling", "accuracy", "dispatch", "varlen", "decode", "score_mods",
          "models")
DEFAULT_WORKLOADS = {
    "speed": WORKLOADS, "accuracy": WORKLOADS, "memory": ("dense", "dilated"), "maxlen": ("dense", "dilated"),
    "scaling": ("dense", "dilated"),
}
SCALING_PEERS = ("longattn", "sdpa-flash", "materialized", "composition")


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run (chosen by device and ``--quick``)."""

    heads: int
    head_dim: int
    speed_n: Tuple[int, ...]
    speed_tokens: int  # batch = max(1, speed_tokens // N)
    memory_n: Tuple[int, ...]
    scaling_n: Tuple[int, ...]
    scaling_batch_n: int
    scaling_batches: Tuple[int, ...]
    maxlen_start: int
    maxlen_cap: int
    maxlen_probe_s: float  # stop doubling after a probe this slow
    maxlen_budget_s: float  # per implementation, workload and pass
    accuracy_n: int = 200
    accuracy_batch: int = 2
    accuracy_heads: int = 4


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if device.type == "cuda":
        if quick:
            return Sizes(16, 128, (4096,), 16384, (4096, 16384), (2048, 8192, 32768), 4096, (1, 4, 16),
                         4096, 1 << 24, 0.5, 5.0, accuracy_heads=4)
        return Sizes(16, 128, (4096, 16384), 16384, (4096, 16384, 65536), (2048, 4096, 8192, 16384, 32768, 65536),
                     4096, (1, 2, 4, 8, 16), 4096, 1 << 24, 1.0, 10.0, accuracy_heads=4)
    if quick:
        return Sizes(4, 32, (256, 1024), 1024, (256, 1024), (256, 512, 1024, 2048), 256, (1, 2, 4),
                     256, 2048, 0.5, 3.0, accuracy_n=96)
    return Sizes(8, 64, (512, 2048), 2048, (512, 1024, 2048, 4096), (512, 1024, 2048, 4096, 8192), 512,
                 (1, 2, 4, 8), 512, 16384, 2.0, 20.0)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


@dataclass
class BenchConfig:
    """Everything a suite needs: where, in which dtype, which implementations and workloads."""

    device: torch.device
    dtype: torch.dtype
    quick: bool
    peers: List[Peer]
    workloads: Optional[Tuple[str, ...]] = None  # None: each suite's default
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    sizes: Optional[Sizes] = None
    cpu_memory_limit: int = field(default_factory=lambda: _physical_memory() // 4)
    plan: Optional[Tuple[QuickCase, ...]] = None  # None: from the device and --quick (:func:`quick_plan`)
    impl_chosen: bool = False  # --impl named the implementations: the plan's choice of them does not apply
    budget: TimeBudget = field(default_factory=TimeBudget)  # no limit unless given one
    first_calls: Optional[FirstCalls] = None  # None: one announcing on ``progress``

    def __post_init__(self):
        if self.sizes is None:
            self.sizes = sizes_for(self.device, self.quick)
        if self.plan is None:
            self.plan = quick_plan(self.device, self.quick)
        if self.first_calls is None:
            self.first_calls = FirstCalls(self.progress)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def workloads_for(self, suite: str) -> Tuple[str, ...]:
        return tuple(self.workloads) if self.workloads else DEFAULT_WORKLOADS[suite]

    def planned(self, suite: str) -> Optional[List[QuickCase]]:
        """The quick plan's cases of ``suite`` (None without a plan: the suite's own sizes)."""
        return None if self.plan is None else plan_cases(self.plan, suite, self.workloads)

    def peers_for(self, case: QuickCase) -> List[Peer]:
        """The implementations of a planned case: the plan's, unless --impl chose them."""
        return list(self.peers) if self.impl_chosen else [p for p in self.peers if p.name in case.impls]


# ----------------------------------------------------------------------------------------------- one measurement
def _row(suite: str, peer: Peer, w: Workload, dtype: str, pass_: str, **extra) -> Row:
    return Row(suite=suite, impl=peer.name, workload=w.kind, n=w.n, batch=w.batch, heads=w.heads,
               head_dim=w.head_dim, dtype=dtype, pass_=pass_, **extra)


def _precheck(peer: Peer, w: Workload, cfg: BenchConfig, pass_: str) -> Optional[str]:
    """Status for a case that is not run (unsupported, or too large for this CPU's memory), else None."""
    reason = peer.unsupported(w, cfg.device, cfg.dtype)
    if reason:
        return f"unsupported: {reason}"
    if cfg.device.type == "cpu":
        need = peer.extra_bytes(w, cfg.dtype, pass_)
        if need > cfg.cpu_memory_limit:
            return f"skipped: needs ~{need / 2**30:.1f} GiB"
    return None


ROUNDS = 3  # interleaved timing rounds of the implementations of one case (speed, scaling)


def _same_kernel(peer: Peer, w: Workload, pass_: str, cfg: BenchConfig, names) -> Optional[str]:
    """The peer among ``names`` whose kernel ``peer`` runs on this case (``backend="auto"`` choosing it), or None."""
    try:
        target = peer.same_kernel_as(w, cfg.device, cfg.dtype, pass_)
    except Exception:  # noqa: BLE001 - no answer: the row is measured on its own
        return None
    return target if target in names and target != peer.name else None


def _set_time(row: Row, t: T.Timing, w: Workload, pass_: str) -> None:
    row.time_ms, row.spread_ms = t.median_ms, t.spread_ms
    row.tflops = pass_flops(w, pass_) / (t.median_ms * 1e-3) / 1e12
    row.tokens_per_s = w.batch * w.n / (t.median_ms * 1e-3)


def measure_case(suite: str, peers: Sequence[Peer], w: Workload, pass_: str, cfg: BenchConfig, *,
                 timed: bool = True, sweep: str = "", skip: Optional[Dict[str, str]] = None,
                 rounds: int = ROUNDS) -> List[Row]:
    """One row per peer on one case (``w``, ``pass_``): peak memory of each (one call after a warm-up), and, if
    ``timed``, their times measured in interleaved rounds (:func:`longattn.bench.timing.time_in_turns`: ± is the
    spread between rounds). A peer that runs another's kernel on this case (:meth:`Peer.same_kernel_as`) is not
    measured again: its row repeats that row's result and names it (``same_as``). ``skip``: peer name -> status of
    rows not to run. Failures become the rows' status."""
    skip = skip or {}
    names = {p.name for p in peers}
    same = {i: t for i, p in enumerate(peers) if (t := _same_kernel(p, w, pass_, cfg, names))}
    rows = [_row(suite, p, w, cfg.dtype_name, pass_, sweep=sweep) for p in peers]
    steps: Dict[int, Callable[[], None]] = {}
    keys: Dict[int, Optional[tuple]] = {}  # compile keys of the rows run
    inputs = None
    for i, (peer, row) in enumerate(zip(peers, rows)):
        cfg.progress.step(f"{peer.name} {w.kind} N={w.n} B={w.batch} {pass_}")
        if i in same:
            row.note = peer.note(w, cfg.device, cfg.dtype)  # which kernel it ran (same_kernel_as answered)
            continue
        row.status = skip.get(peer.name) or _precheck(peer, w, cfg, pass_) or "ok"
        if not row.ok:
            continue
        step = fn = None
        try:
            if inputs is None:
                inputs = make_inputs(w, cfg.device, cfg.dtype)
            fn = peer.prepare(w, cfg.device, cfg.dtype)
            row.note = peer.note(w, cfg.device, cfg.dtype)
            step = T.make_step(fn, *inputs, pass_)
            key = peer.compile_key(w, cfg.device, cfg.dtype, pass_)
            # warm-up (compilation, autotuning) outside the measurements; said when it compiles
            cfg.first_calls.run(step, cfg.device, key, f"{peer.name} {w.kind} N={w.n} {pass_}")
            keys[i] = key
            t_peak = time.perf_counter()
            peak = T.peak_bytes(step, cfg.device)
            if not timed and cfg.device.type == "cuda":  # a plain call there (a CPU's goes through the profiler)
                cfg.first_calls.steady(key, time.perf_counter() - t_peak)
            if peak is not None:
                row.peak_mb = peak / 1e6
                row.mb_per_token = peak / 1e6 / (w.batch * w.n)
            if timed:
                steps[i] = step
        except Exception as err:  # noqa: BLE001 - a failing implementation must never end the run
            row.status = T.classify(err)
            if row.status == "oom":
                step = fn = None  # noqa: F841 - drop references before freeing
                T.free_memory(cfg.device)
    if steps:
        failed: Dict[int, BaseException] = {}
        for i, t in T.time_in_turns(steps, cfg.device, cfg.quick, rounds, failed=failed).items():
            _set_time(rows[i], t, w, pass_)
            cfg.first_calls.steady(keys.get(i), t.median_ms * 1e-3)
        for i, err in failed.items():
            rows[i].status = T.classify(err)
            rows[i].peak_mb = rows[i].mb_per_token = None
    steps.clear()
    inputs = None
    if any(r.status == "oom" for r in rows):
        T.free_memory(cfg.device)
    by_name = {p.name: r for p, r in zip(peers, rows)}
    for i, target in same.items():
        rows[i].copy_measurement(by_name[target])
    return rows


def _sweep(suite: str, cases: Sequence[Tuple[Sequence[Peer], Callable[[], Workload], str, str]], cfg: BenchConfig,
           timed: bool = True) -> List[Row]:
    """Measure ``(peers, make_workload, pass, sweep)`` cases in order (:func:`measure_case`); once a peer runs out
    of memory on a workload and pass, its larger cases are skipped."""
    rows: List[Row] = []
    failed: Dict[tuple, int] = {}
    cfg.progress.begin(suite, sum(len(peers) for peers, _, _, _ in cases))
    for peers, make, pass_, sweep in cases:
        if not cfg.budget.allow(suite):
            continue
        w = make()
        size = w.n * w.batch
        skip = {p.name: "skipped: oom at a smaller size" for p in peers
                if size >= failed.get((p.name, w.kind, pass_, sweep), size + 1)}
        for row in measure_case(suite, peers, w, pass_, cfg, timed=timed, sweep=sweep, skip=skip):
            if row.status == "oom":
                key = (row.impl, w.kind, pass_, sweep)
                failed[key] = min(failed.get(key, size), size)
            rows.append(row)
    cfg.progress.end()
    return rows


def _workload_maker(cache: Dict[tuple, Workload], kind: str, n: int, batch: int, cfg: BenchConfig):
    """Lazy, shared workload construction (masks a peer builds are cached on the workload and reused)."""
    def make() -> Workload:
        key = (kind, n, batch)
        if key not in cache:
            cache.clear()  # one workload alive at a time: its cached masks can be large
            cache[key] = make_workload(kind, n, batch=batch, heads=cfg.sizes.heads, head_dim=cfg.sizes.head_dim)
        return cache[key]
    return make


def _applicable(peers: Sequence[Peer], kind: str) -> List[Peer]:
    return [p for p in peers if p.applies(kind)]


def _round_n(kind: str, n: int) -> int:
    g = granularity(kind, n)
    return max(g, n // g * g)


# ----------------------------------------------------------------------------------------------------- the suites
Case = Tuple[List[Peer], str, int, int, str]  # (peers, workload kind, N, batch, pass)


def speed_cases(cfg: BenchConfig) -> List[Case]:
    """The cases of the speed suite: every workload, N and pass, or the quick plan's."""
    s = cfg.sizes
    planned = cfg.planned("speed")
    if planned is not None:
        return [(_applicable(cfg.peers_for(c), c.workload), c.workload, n, max(1, s.speed_tokens // n), c.pass_)
                for c in planned for n in [_round_n(c.workload, c.n)]]
    return [(_applicable(cfg.peers, kind), kind, n, max(1, s.speed_tokens // n), pass_)
            for kind in cfg.workloads_for("speed") for n in (_round_n(kind, n) for n in s.speed_n)
            for pass_ in T.PASSES]


def memory_cases(cfg: BenchConfig) -> List[Case]:
    """The cases of the memory suite (batch 1): every workload, N and pass, or the quick plan's."""
    planned = cfg.planned("memory")
    if planned is not None:
        return [(_applicable(cfg.peers_for(c), c.workload), c.workload, _round_n(c.workload, c.n), 1, c.pass_)
                for c in planned]
    return [(_applicable(cfg.peers, kind), kind, _round_n(kind, n), 1, pass_)
            for kind in cfg.workloads_for("memory") for n in cfg.sizes.memory_n for pass_ in T.PASSES]


def _sweep_cases(cases: Sequence[Case], cfg: BenchConfig):
    cache: Dict[tuple, Workload] = {}
    return [(peers, _workload_maker(cache, kind, n, batch, cfg), pass_, "") for peers, kind, n, batch, pass_ in cases]


def run_speed(cfg: BenchConfig) -> List[Row]:
    return _sweep("speed", _sweep_cases(speed_cases(cfg), cfg), cfg)


def run_memory(cfg: BenchConfig) -> List[Row]:
    return _sweep("memory", _sweep_cases(memory_cases(cfg), cfg), cfg, timed=False)


def run_scaling(cfg: BenchConfig) -> List[Row]:
    s, cache, cases = cfg.sizes, {}, []
    peers = [p for p in cfg.peers if p.name in SCALING_PEERS] or cfg.peers
    for kind in cfg.workloads_for("scaling"):
        for n in s.scaling_n:
            cases.append((_applicable(peers, kind), _workload_maker(cache, kind, _round_n(kind, n), 1, cfg), "fwd",
                          "N"))
        for batch in s.scaling_batches:
            cases.append((_applicable(peers, kind),
                          _workload_maker(cache, kind, _round_n(kind, s.scaling_batch_n), batch, cfg), "fwd", "batch"))
    return _sweep("scaling", cases, cfg)


def _probe(peer: Peer, kind: str, n: int, pass_: str, cfg: BenchConfig) -> Tuple[str, float]:
    """Run one call at length ``n`` (batch 1): ``(status, seconds of the call)``. A first call slower than the
    per-call limit (or any first call of a compiling peer) is followed by a second one, whose time counts: the first
    may have compiled for this shape (Triton's JIT, autotuning), which says nothing of the longest N the kernel
    runs."""
    status, secs = "ok", 0.0
    oom = False
    try:
        w = make_workload(kind, n, batch=1, heads=cfg.sizes.heads, head_dim=cfg.sizes.head_dim)
        skip = _precheck(peer, w, cfg, pass_)
        if skip:
            return skip, 0.0
        fn = peer.prepare(w, cfg.device, cfg.dtype)
        q, k, v = make_inputs(w, cfg.device, cfg.dtype)
        step = T.make_step(fn, q, k, v, pass_)
        for call in range(2):
            t0 = time.perf_counter()
            step()
            T.sync(cfg.device)
            secs = time.perf_counter() - t0
            if not (call == 0 and (peer.compiles or secs > cfg.sizes.maxlen_probe_s)):
                break
    except Exception as err:  # noqa: BLE001
        status = T.classify(err)
        oom = status == "oom"
    finally:
        w = fn = q = k = v = step = None  # noqa: F841
        if oom or cfg.device.type == "cuda":
            T.free_memory(cfg.device)
    return status, secs


TIME_CAP = "time budget, not memory"  # a maxlen search stopped by its time limits: the true limit is higher


def _maxlen_start(peer: Peer, kind: str, pass_: str, cfg: BenchConfig) -> Tuple[Row, Workload]:
    s = cfg.sizes
    w = make_workload(kind, _round_n(kind, s.maxlen_start), batch=1, heads=s.heads, head_dim=s.head_dim)
    return Row(suite="maxlen", impl=peer.name, workload=kind, n=w.n, batch=1, heads=s.heads, head_dim=s.head_dim,
               dtype=cfg.dtype_name, pass_=pass_), w


def find_maxlen(peer: Peer, kind: str, pass_: str, cfg: BenchConfig) -> Row:
    """Longest N (batch 1) that ``peer`` runs: doubling until out of memory, then bisection to 1/8 of N. A search
    that its time limits stop (a slow call, the budget) says so in the note: :data:`TIME_CAP`."""
    s = cfg.sizes
    row, w = _maxlen_start(peer, kind, pass_, cfg)
    start = w.n
    reason = peer.unsupported(w, cfg.device, cfg.dtype)
    if reason:
        row.status = f"unsupported: {reason}"
        return row
    t_begin = time.perf_counter()
    over_budget = lambda: time.perf_counter() - t_begin > s.maxlen_budget_s  # noqa: E731
    last_ok, first_bad, stop = None, None, ""
    n = start
    while True:
        if n > s.maxlen_cap:
            stop = f"size cap {s.maxlen_cap}"
            break
        status, secs = _probe(peer, kind, n, pass_, cfg)
        if status == "ok":
            last_ok = n
            if secs > s.maxlen_probe_s:
                stop = f"{TIME_CAP}: one call at N={n} took {secs:.2f} s (limit {s.maxlen_probe_s:g} s per call)"
                break
            if over_budget():
                stop = f"{TIME_CAP}: the search used its {s.maxlen_budget_s:g} s"
                break
            n = _round_n(kind, 2 * n)
        elif status == "oom":
            first_bad = n
            break
        elif status.startswith("skipped"):
            stop = f"size cap ({status[len('skipped: '):]})"
            break
        else:
            row.status = status
            break
    if first_bad is not None and last_ok is not None:
        lo, hi = last_ok, first_bad
        cut = ""
        while True:
            mid = _round_n(kind, (lo + hi) // 2)
            if mid <= lo or mid >= hi or hi - lo <= lo // 8:
                break
            if over_budget():
                cut = f" (bisection stopped by the {s.maxlen_budget_s:g} s time budget)"
                break
            status, _ = _probe(peer, kind, mid, pass_, cfg)
            if status == "ok":
                lo = mid
            elif status == "oom":
                hi = mid
            else:
                break
        last_ok, first_bad = lo, hi
        stop = f"oom at {first_bad}{cut}"
    elif first_bad is not None:
        row.status = "oom"
        stop = f"oom at {first_bad}"
    row.max_n = last_ok
    if last_ok is not None:
        row.n = last_ok
    row.note = stop
    return row


CPU_MAXLEN_SKIP = ("skipped: on a CPU the longest sequence is set by time, not memory (the linear-memory "
                   "implementations reach millions of tokens only after hours), so no search fits the run's time "
                   "budget; run maxlen on a GPU")


def run_maxlen(cfg: BenchConfig) -> List[Row]:
    if cfg.device.type == "cpu":
        return [Row(suite="maxlen", impl="all", workload=kind, n=0, batch=1, heads=cfg.sizes.heads,
                    head_dim=cfg.sizes.head_dim, dtype=cfg.dtype_name, pass_="fwd", status=CPU_MAXLEN_SKIP)
                for kind in cfg.workloads_for("maxlen")]
    cases = [(peer, kind, pass_) for kind in cfg.workloads_for("maxlen") for pass_ in T.PASSES
             for peer in _applicable(cfg.peers, kind)]
    # A peer running another's kernel here (backend="auto" choosing it) is not searched again: its row repeats that
    # row's answer, so one kernel gets one longest N whichever row spent its time budget compiling.
    same: Dict[int, int] = {}
    for i, (peer, kind, pass_) in enumerate(cases):
        peers = {p.name: j for j, (p, k, ps) in enumerate(cases) if (k, ps) == (kind, pass_)}
        target = _same_kernel(peer, _maxlen_start(peer, kind, pass_, cfg)[1], pass_, cfg, peers)
        if target is not None:
            same[i] = peers[target]
    same = {i: j for i, j in same.items() if j not in same}  # repeat searched rows only
    cfg.progress.begin("maxlen", len(cases))
    rows: Dict[int, Row] = {}
    for i in sorted(range(len(cases)), key=lambda i: i in same):  # searched rows first
        peer, kind, pass_ = cases[i]
        cfg.progress.step(f"{peer.name} {kind} {pass_}")
        if i not in same and not cfg.budget.allow("maxlen"):
            continue
        if i in same:
            if same[i] not in rows:
                continue
            rows[i] = _maxlen_start(peer, kind, pass_, cfg)[0]
            rows[i].copy_measurement(rows[same[i]])
        else:
            rows[i] = find_maxlen(peer, kind, pass_, cfg)
    cfg.progress.end()
    return [rows[i] for i in range(len(cases)) if i in rows]


def _reference(w: Workload, q, k, v):
    from longattn import reference as R

    if w.kind == "dilated":
        return R.dilated_attention(q, k, v, segment_lengths=w.segments, dilation_rates=w.rates, causal=w.causal)
    if w.kind == "block_sparse":
        return R.block_sparse_attention(q, k, v, block_mask=w.block_mask.to(q.device), block_size=w.block_size)
    return R.flash_attention(q, k, v, causal=w.causal, window=w.window)


def accuracy_row(peer: Peer, w: Workload, dtype: torch.dtype, cfg: BenchConfig, ref) -> Row:
    """Max error of ``peer``'s output and gradients against ``ref = (q, k, v, do, out, grads)`` in float64."""
    q64, k64, v64, do64, out64, grads64 = ref
    row = _row("accuracy", peer, w, str(dtype).replace("torch.", ""), "fwd_bwd")
    reason = peer.unsupported(w, cfg.device, dtype)
    if reason:
        row.status = f"unsupported: {reason}"
        return row
    try:
        fn = peer.prepare(w, cfg.device, dtype)
        row.note = peer.note(w, cfg.device, dtype)
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q64, k64, v64))
        out = fn(q, k, v)
        row.err_out = (out.double() - out64).abs().max().item()
        out.backward(do64.to(dtype))
        row.err_grad = max((x.grad.double() - g).abs().max().item() for x, g in zip((q, k, v), grads64))
    except Exception as err:  # noqa: BLE001
        row.status = T.classify(err)
    return row


def run_accuracy(cfg: BenchConfig) -> List[Row]:
    s = cfg.sizes
    low = cfg.dtype if cfg.dtype != torch.float32 else torch.bfloat16
    dtypes = [torch.float32, low]
    kinds = cfg.workloads_for("accuracy")
    cfg.progress.begin("accuracy", sum(len(_applicable(cfg.peers, k)) for k in kinds) * len(dtypes))
    rows = []
    for kind in kinds:
        if not cfg.budget.allow("accuracy"):
            continue
        w = make_workload(kind, _round_n(kind, s.accuracy_n), batch=s.accuracy_batch, heads=s.accuracy_heads,
                          head_dim=min(s.head_dim, 64))
        q, k, v = (x.requires_grad_() for x in make_inputs(w, cfg.device, torch.float64, seed=1))
        do = torch.randn_like(q)
        out = _reference(w, q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref = (q.detach(), k.detach(), v.detach(), do, out.detach(), grads)
        for dtype in dtypes:
            for peer in _applicable(cfg.peers, kind):
                cfg.progress.step(f"{peer.name} {kind} {str(dtype)[6:]}")
                if peer.compiles and dtype != low and not peer.unsupported(w, cfg.device, dtype):
                    # A compiled peer (FlexAttention) costs a compilation per case: checked in the run's dtype only.
                    row = _row("accuracy", peer, w, str(dtype).replace("torch.", ""), "fwd_bwd")
                    row.status = f"skipped: compiled, checked in {str(low).replace('torch.', '')} only"
                    rows.append(row)
                    continue
                rows.append(accuracy_row(peer, w, dtype, cfg, ref))
    cfg.progress.end()
    return rows


def planned_jobs(cfg: BenchConfig, suites: Sequence[str]) -> List[Tuple[str, str, str, str, int]]:
    """``(suite, impl, workload, pass, n)`` of the rows ``suites`` would measure with ``cfg``, found without
    running anything (on any device description): speed, memory, varlen and decode row by row, any other suite
    as one ``(suite, "all", "", "", 0)`` entry."""
    from longattn.bench import decode_suite as DS
    from longattn.bench import varlen_suite as VS

    jobs: List[Tuple[str, str, str, str, int]] = []
    for suite in suites:
        if suite in ("speed", "memory"):
            cases = speed_cases(cfg) if suite == "speed" else memory_cases(cfg)
            jobs += [(suite, p.name, kind, pass_, n) for peers, kind, n, _, pass_ in cases for p in peers]
        elif suite == "varlen":
            jobs += [(suite, impl, VS.workload_name(causal), pass_, case[0]) for case, causal, pass_ in VS.todo(cfg)
                     for impl in VS.IMPLS]
        elif suite == "decode":
            impls = DS.planned_impls(cfg) or DS.impl_names(cfg.device.type == "cuda")
            jobs += [(suite, impl, f"decode-nq{n_q}", "fwd", m) for _, m, n_q, *_ in DS.cases(cfg.device, cfg.quick)
                     for impl in impls]
        else:
            jobs.append((suite, "all", "", "", 0))
    return jobs


RUNNERS: Dict[str, Callable[[BenchConfig], List[Row]]] = {
    "speed": run_speed, "memory": run_memory, "maxlen": run_maxlen, "scaling": run_scaling,
    "accuracy": run_accuracy, "dispatch": run_dispatch, "varlen": run_varlen, "decode": run_decode,
    "score_mods": run_score_mods, "models": run_models,
}


def run_suites(suites: Sequence[str], cfg: BenchConfig) -> List[Row]:
    """Run ``suites`` in order and return all their rows."""
    rows: List[Row] = []
    for name in suites:
        rows.extend(RUNNERS[name](cfg))
    return rows
