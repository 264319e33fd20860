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
  (:mod:`longattn.bench.dispatch`).
- ``varlen``: a packed batch of long-tailed documents, ``flash_attention_varlen`` against SDPA on the padded batch
  (:mod:`longattn.bench.varlen`).
- ``decode``: new tokens against a KV cache (contiguous and paged), ``flash_attention_with_kvcache`` against SDPA
  (:mod:`longattn.bench.decode`).

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
from longattn.bench.progress import Progress
from longattn.bench.results import Row
from longattn.bench.decode import run_decode
from longattn.bench.dispatch import run_dispatch
from longattn.bench.varlen import run_varlen
from longattn.bench.workloads import (WORKLOADS, Workload, granularity, make_inputs, make_workload, pass_flops)

SUITES = ("speed", "memory", "maxlen", "scaling", "accuracy", "dispatch", "varlen", "decode")
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

    def __post_init__(self):
        if self.sizes is None:
            self.sizes = sizes_for(self.device, self.quick)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def workloads_for(self, suite: str) -> Tuple[str, ...]:
        return tuple(self.workloads) if self.workloads else DEFAULT_WORKLOADS[suite]


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


def measure(suite: str, peer: Peer, w: Workload, pass_: str, cfg: BenchConfig, *, timed: bool = True,
            sweep: str = "") -> Row:
    """Time (if ``timed``) and peak memory of ``peer`` on ``w``; failures become the row's status."""
    row = _row(suite, peer, w, cfg.dtype_name, pass_, sweep=sweep)
    skip = _precheck(peer, w, cfg, pass_)
    if skip:
        row.status = skip
        return row
    oom = False
    try:
        fn = peer.prepare(w, cfg.device, cfg.dtype)
        row.note = peer.note(w, cfg.device, cfg.dtype)
        q, k, v = make_inputs(w, cfg.device, cfg.dtype)
        step = T.make_step(fn, q, k, v, pass_)
        step()  # warm-up (compilation, autotuning) outside the measurements
        T.sync(cfg.device)
        peak = T.peak_bytes(step, cfg.device)
        if peak is not None:
            tokens = w.batch * w.n
            row.peak_mb = peak / 1e6
            row.mb_per_token = peak / 1e6 / tokens
        if timed:
            t = T.time_step(step, cfg.device, cfg.quick)
            row.time_ms, row.spread_ms = t.median_ms, t.spread_ms
            row.tflops = pass_flops(w, pass_) / (t.median_ms * 1e-3) / 1e12
            row.tokens_per_s = w.batch * w.n / (t.median_ms * 1e-3)
    except Exception as err:  # noqa: BLE001 - a failing implementation must never end the run
        row.status = T.classify(err)
        oom = row.status == "oom"
    finally:
        q = k = v = step = fn = None  # noqa: F841 - drop references before freeing
        if oom:
            T.free_memory(cfg.device)
    return row


def _sweep(suite: str, cases: Sequence[Tuple[Peer, Callable[[], Workload], str, str]], cfg: BenchConfig,
           timed: bool = True) -> List[Row]:
    """Measure ``(peer, make_workload, pass, sweep)`` cases in order; once a peer runs out of memory on a
    workload and pass, its larger cases are skipped."""
    rows: List[Row] = []
    failed: Dict[tuple, int] = {}
    cfg.progress.begin(suite, len(cases))
    for peer, make, pass_, sweep in cases:
        w = make()
        cfg.progress.step(f"{peer.name} {w.kind} N={w.n} B={w.batch} {pass_}")
        key = (peer.name, w.kind, pass_, sweep)
        size = w.n * w.batch
        if key in failed and size >= failed[key]:
            row = _row(suite, peer, w, cfg.dtype_name, pass_, sweep=sweep)
            row.status = "skipped: oom at a smaller size"
        else:
            row = measure(suite, peer, w, pass_, cfg, timed=timed, sweep=sweep)
            if row.status == "oom":
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
def run_speed(cfg: BenchConfig) -> List[Row]:
    s, cache, cases = cfg.sizes, {}, []
    for kind in cfg.workloads_for("speed"):
        for n in s.speed_n:
            n = _round_n(kind, n)
            batch = max(1, s.speed_tokens // n)
            for pass_ in T.PASSES:
                for peer in _applicable(cfg.peers, kind):
                    cases.append((peer, _workload_maker(cache, kind, n, batch, cfg), pass_, ""))
    return _sweep("speed", cases, cfg)


def run_memory(cfg: BenchConfig) -> List[Row]:
    s, cache, cases = cfg.sizes, {}, []
    for kind in cfg.workloads_for("memory"):
        for n in s.memory_n:
            n = _round_n(kind, n)
            for pass_ in T.PASSES:
                for peer in _applicable(cfg.peers, kind):
                    cases.append((peer, _workload_maker(cache, kind, n, 1, cfg), pass_, ""))
    return _sweep("memory", cases, cfg, timed=False)


def run_scaling(cfg: BenchConfig) -> List[Row]:
    s, cache, cases = cfg.sizes, {}, []
    peers = [p for p in cfg.peers if p.name in SCALING_PEERS] or cfg.peers
    for kind in cfg.workloads_for("scaling"):
        for n in s.scaling_n:
            for peer in _applicable(peers, kind):
                cases.append((peer, _workload_maker(cache, kind, _round_n(kind, n), 1, cfg), "fwd", "N"))
        for batch in s.scaling_batches:
            for peer in _applicable(peers, kind):
                cases.append((peer, _workload_maker(cache, kind, _round_n(kind, s.scaling_batch_n), batch, cfg),
                              "fwd", "batch"))
    return _sweep("scaling", cases, cfg)


def _probe(peer: Peer, kind: str, n: int, pass_: str, cfg: BenchConfig) -> Tuple[str, float]:
    """Run one call at length ``n`` (batch 1): ``(status, seconds)``."""
    t0 = time.perf_counter()
    status = "ok"
    oom = False
    try:
        w = make_workload(kind, n, batch=1, heads=cfg.sizes.heads, head_dim=cfg.sizes.head_dim)
        skip = _precheck(peer, w, cfg, pass_)
        if skip:
            return skip, 0.0
        fn = peer.prepare(w, cfg.device, cfg.dtype)
        q, k, v = make_inputs(w, cfg.device, cfg.dtype)
        step = T.make_step(fn, q, k, v, pass_)
        step()
        T.sync(cfg.device)
        if peer.compiles:  # time a second call: the first one compiled for this shape
            t0 = time.perf_counter()
            step()
            T.sync(cfg.device)
    except Exception as err:  # noqa: BLE001
        status = T.classify(err)
        oom = status == "oom"
    finally:
        w = fn = q = k = v = step = None  # noqa: F841
        if oom or cfg.device.type == "cuda":
            T.free_memory(cfg.device)
    return status, time.perf_counter() - t0


def find_maxlen(peer: Peer, kind: str, pass_: str, cfg: BenchConfig) -> Row:
    """Longest N (batch 1) that ``peer`` runs: doubling until out of memory, then bisection to 1/8 of N."""
    s = cfg.sizes
    start = _round_n(kind, s.maxlen_start)
    row = Row(suite="maxlen", impl=peer.name, workload=kind, n=start, batch=1, heads=s.heads, head_dim=s.head_dim,
              dtype=cfg.dtype_name, pass_=pass_)
    reason = peer.unsupported(make_workload(kind, start, batch=1, heads=s.heads, head_dim=s.head_dim),
                              cfg.device, cfg.dtype)
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
            if secs > s.maxlen_probe_s or over_budget():
                stop = "time cap"
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
        while not over_budget():
            mid = _round_n(kind, (lo + hi) // 2)
            if mid <= lo or mid >= hi or hi - lo <= lo // 8:
                break
            status, _ = _probe(peer, kind, mid, pass_, cfg)
            if status == "ok":
                lo = mid
            elif status == "oom":
                hi = mid
            else:
                break
        last_ok, first_bad = lo, hi
        stop = f"oom at {first_bad}"
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
    cfg.progress.begin("maxlen", len(cases))
    rows = []
    for peer, kind, pass_ in cases:
        cfg.progress.step(f"{peer.name} {kind} {pass_}")
        rows.append(find_maxlen(peer, kind, pass_, cfg))
    cfg.progress.end()
    return rows


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


RUNNERS: Dict[str, Callable[[BenchConfig], List[Row]]] = {
    "speed": run_speed, "memory": run_memory, "maxlen": run_maxlen, "scaling": run_scaling,
    "accuracy": run_accuracy, "dispatch": run_dispatch, "varlen": run_varlen, "decode": run_decode,
}


def run_suites(suites: Sequence[str], cfg: BenchConfig) -> List[Row]:
    """Run ``suites`` in order and return all their rows."""
    rows: List[Row] = []
    for name in suites:
        rows.extend(RUNNERS[name](cfg))
    return rows
