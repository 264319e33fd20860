"""Sequence-parallel check on 2 GPUs (NCCL): correctness of the distributed attention functions in bf16, and
context-parallel training steps of a small Llama through the transformers plug-in, timed against one GPU.

    torchrun --nproc_per_node=2 tools/gpu_sp_check.py     # 2 GPUs, NCCL
    python tools/gpu_sp_check.py --cpu-smoke              # 2 gloo processes on the CPU, tiny sizes: that it runs

1. Correctness (bf16, backend "auto"; the smoke run: float32 against float64, backend "torch"). Each case draws the
   full inputs with the same seed on every rank, cuts them (``shard``, ``shard(..., cu_seqlens=)``,
   ``shard_hybrid``), runs the distributed function forward and backward, gathers the output and the gradients
   (``unshard``; the sinks' gradient summed over the ranks) and compares them with the single-device
   ``longattn.flash_attention`` / ``flash_attention_varlen`` on the full tensors (bf16) and with ``backend="torch"``
   on float32 copies. Errors are relative: ``max |x - ref| / max |ref|``. A tensor FAILs when the distributed
   error against float32 exceeds twice the single-device error plus 1e-2 (1e-5 in the CPU smoke run). Cases (Hq 8, Hk 2, D 128, 8k tokens per
   rank unless said): ring_attention zigzag, causal, softcap 30, ALiBi, sinks; ring_attention on a packed batch
   (17 documents of 87..9883 rows, 16k rows per rank), balanced layout, causal, sinks; ulysses_attention, causal,
   softcap, ALiBi, sinks; hybrid_attention on the degenerate grids (ring = the world, Ulysses groups of one rank,
   and the converse), the same options; ring_attention with ``deterministic=True``: two runs give bitwise-equal
   output and gradients; ulysses_attention and ring_attention through NCCL and through the copy engines
   (``ParallelOptions.transport``): bitwise-equal output, lse and gradients (:func:`transport_rows`).
2. Context-parallel training (``longattn.integrations.transformers.context_parallel``, docs/context_parallel.md):
   a Llama (hidden 512, 4 layers, 8 heads, 2 key/value heads, vocab 4096, bf16 weights,
   ``attn_implementation="longattn"``) on one sequence of 131072 tokens split over the ranks, ``mode="ring"``
   (zigzag) and ``mode="ulysses"``: a first step (forward, backward, ``all_reduce_gradients``) whose loss and
   gradients are compared with one GPU running the whole sequence (rank 0, the others waiting; an OOM is reported),
   then 3 timed steps. Speedup ``t1 / tP`` and efficiency ``t1 / (P tP)``.
3. A summary table; the exit status is 1 if any case FAILs.

Timing: fixed-count loops, the same on every rank (never ``triton.testing.do_bench``, whose call counts differ
between ranks and hang NCCL), behind a barrier and synchronized; the slowest rank's mean per step.
NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # (symmetric memory: Ulysses' copy-engine transfers)

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Callable, List, NamedTuple, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import Tensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn.bench.varlen_suite import document_lengths  # noqa: E402
from longattn.distributed import (  # noqa: E402
    ContextParallel, ParallelOptions, hybrid_attention, ring_attention, shard, shard_hybrid, ulysses_attention,
    unshard, unshard_hybrid,
)
from longattn.utils import cu_seqlens_of  # noqa: E402

HQ, HK = 8, 2
SOFTCAP = 30.0
GRAD_NAMES = ("out", "dq", "dk", "dv", "dsinks")
# training: relative loss difference, relative norm of the gradients' difference; bf16 on GPUs, float32 in the CPU
# smoke run (which CI runs), where the split sequence must agree to float32 rounding
LOSS_TOL, GRAD_TOL = 1e-2, 0.1
SMOKE_LOSS_TOL, SMOKE_GRAD_TOL = 1e-5, 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU processes, tiny sizes (checks it runs)")
    p.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun (default 2)")
    p.add_argument("--tokens-per-rank", type=int, default=None, help="correctness cases (default 8192)")
    p.add_argument("--packed-tokens-per-rank", type=int, default=None, help="packed-batch case (default 16384)")
    p.add_argument("--train-tokens", type=int, default=None, help="training sequence, whole (default 131072)")
    p.add_argument("--iters", type=int, default=3, help="timed training steps, the same on every rank (default 3)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: check, train, single (the 1-GPU run)")
    p.add_argument("--timeout-min", type=float, default=10.0, help="process-group timeout (default 10)")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    a.tokens_per_rank = a.tokens_per_rank or (16 if smoke else 8192)
    a.packed_tokens_per_rank = a.packed_tokens_per_rank or (48 if smoke else 16384)
    a.train_tokens = a.train_tokens or (64 if smoke else 131072)
    a.head_dim = 16 if smoke else 128
    a.model = (dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2) if smoke else
               dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2))
    a.skip = {s for s in a.skip.split(",") if s}
    bad = a.skip - {"check", "train", "single"}
    if bad:
        p.error(f"--skip: {sorted(bad)} not among check, train, single")
    return a


class Env:
    """This rank, its device and dtypes: ``low`` (the one checked: bf16; float32 in the smoke run) and ``high`` (the
    reference: float32; float64)."""

    def __init__(self, rank: int, world: int, a: argparse.Namespace):
        self.a, self.rank, self.world = a, rank, world
        self.cuda = not a.cpu_smoke
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.low, self.high = (torch.bfloat16, torch.float32) if self.cuda else (torch.float32, torch.float64)
        self.backend = "auto" if self.cuda else "torch"

    def log(self, *msg) -> None:
        if self.rank == 0:
            print(*msg, flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def max_over_ranks(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_true(self, ok: bool) -> bool:
        t = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())


def timed(env: Env, fn: Callable[[], object], iters: int, collective: bool = True) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls (warmed up before); ``collective``: behind a barrier,
    the slowest rank's."""
    env.sync()
    if collective:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    env.sync()
    dt = (time.perf_counter() - t0) / iters
    return env.max_over_ranks(dt) if collective else dt


# ---------------------------------------------------------------------------------------------------------------
# 1. correctness

class Case(NamedTuple):
    """A correctness case: ``attend(q, k, v, sinks)`` on this rank's parts, ``full(q, k, v, sinks, backend)`` on
    the full tensors; ``cut``/``join`` take a full tensor to this rank's part and back (collective)."""

    name: str
    shape_q: tuple
    shape_kv: tuple
    attend: Callable[..., Tensor]
    full: Callable[..., Tensor]
    cut: Callable[[Tensor], Tensor]
    join: Callable[[Tensor], Tensor]


class Row(NamedTuple):
    case: str
    what: str
    e_dist: float
    e_single: float
    status: str  # OK, FAIL or SKIP
    note: str = ""


def _randn(env: Env, seed: int, *shape, scale: float = 1.0) -> Tensor:
    g = torch.Generator(device=env.device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=env.device, dtype=env.high) * scale


def _alibi(env: Env) -> Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / HQ) for h in range(HQ)], device=env.device)


def _rel(got: Tensor, want: Tensor) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _run_full(fn, tensors, sinks, do, dtype) -> List[Tensor]:
    """``[out, dq, dk, dv, dsinks]`` of ``fn`` on copies of ``tensors`` (and the sinks) in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    s = sinks.detach().clone().requires_grad_()
    out = fn(*leaves, s)
    out.backward(do.to(dtype))
    return [out.detach()] + [t.grad for t in leaves] + [s.grad]


def _run_dist(env: Env, case: Case, tensors, sinks, do, deterministic_leaves=None) -> List[Tensor]:
    """``[out, dq, dk, dv, dsinks]`` of the distributed call, gathered (the sinks' gradient summed over the ranks)."""
    parts = [case.cut(t.to(env.low)).detach().clone().requires_grad_() for t in tensors]
    s = sinks.detach().clone().requires_grad_()
    out = case.attend(*parts, s)
    out.backward(case.cut(do.to(env.low)))
    ds = s.grad.clone() if s.grad is not None else torch.zeros_like(s)  # (a case without sinks)
    if deterministic_leaves is not None:  # this rank's own results, before any gathering
        deterministic_leaves.extend([out.detach(), *(p.grad for p in parts), ds.clone()])
    dist.all_reduce(ds)
    return [case.join(out.detach())] + [case.join(p.grad) for p in parts] + [ds]


def check_case(env: Env, case: Case, seed: int) -> List[Row]:
    """The case's rows: each of out, dq, dk, dv, dsinks, distributed and single-device against the reference."""
    q = _randn(env, seed, *case.shape_q, scale=2.0)
    k, v = (_randn(env, seed + i, *case.shape_kv) for i in (1, 2))
    do = _randn(env, seed + 3, *case.shape_q)
    sinks = _randn(env, seed + 4, HQ).float()
    t0 = time.perf_counter()
    want = _run_full(lambda *x: case.full(*x, "torch"), (q, k, v), sinks.to(env.high), do, env.high)
    single = _run_full(lambda *x: case.full(*x, env.backend), (q, k, v), sinks, do, env.low)
    got = _run_dist(env, case, (q, k, v), sinks, do)
    rows = []
    for what, g, s, w in zip(GRAD_NAMES, got, single, want):
        e_dist, e_single = _rel(g, w), _rel(s, w)
        slack = 1e-5 if env.a.cpu_smoke else 1e-2  # float32 against float64 on the CPU; bf16 on GPUs
        rows.append(Row(case.name, what, e_dist, e_single, "OK" if e_dist <= 2 * e_single + slack else "FAIL"))
    env.log(f"\n{case.name}  ({time.perf_counter() - t0:.1f} s)")
    for r in rows:
        env.log(f"  {r.what:6s} dist vs fp32 {r.e_dist:9.2e}   1-dev vs fp32 {r.e_single:9.2e}   {r.status}")
    del q, k, v, do, want, single, got
    env.free()
    return rows


def _unpacked(env: Env, name: str, n_total: int, attend, full, cut, join) -> Case:
    D = env.a.head_dim
    return Case(name, (1, n_total, HQ, D), (1, n_total, HK, D), attend, full, cut, join)


def _mods(env: Env) -> dict:
    return dict(causal=True, softcap=SOFTCAP, alibi_slopes=_alibi(env))


def ring_case(env: Env) -> Case:
    mods = _mods(env)
    return _unpacked(
        env, f"ring zigzag causal softcap+alibi+sinks GQA {HQ}/{HK}, {env.a.tokens_per_rank}/rank",
        env.a.tokens_per_rank * env.world,
        lambda q, k, v, s: ring_attention(q, k, v, layout="zigzag", backend=env.backend, sinks=s, **mods),
        lambda q, k, v, s, backend: longattn.flash_attention(q, k, v, backend=backend, sinks=s, **mods),
        lambda t: shard(t, layout="zigzag"), lambda t: unshard(t, layout="zigzag"))


def packed_case(env: Env) -> Case:
    total = env.a.packed_tokens_per_rank * env.world
    lens = document_lengths(total, low=2, high=32, seed=2) if env.a.cpu_smoke else document_lengths(total, seed=2)
    cu = cu_seqlens_of(lens, env.device)
    D = env.a.head_dim

    def full(q, k, v, s, backend):
        return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, sinks=s,
                                               backend=backend)

    return Case(f"ring packed balanced causal sinks, {len(lens)} docs {min(lens)}..{max(lens)}, {total} rows",
                (total, HQ, D), (total, HK, D),
                lambda q, k, v, s: ring_attention(q, k, v, cu_seqlens=cu, layout="balanced", causal=True, sinks=s,
                                                  backend=env.backend),
                full,
                lambda t: shard(t, layout="balanced", dim=0, cu_seqlens=cu),
                lambda t: unshard(t, layout="balanced", dim=0, cu_seqlens=cu))


def ulysses_case(env: Env) -> Case:
    mods = _mods(env)
    return _unpacked(
        env, f"ulysses causal softcap+alibi+sinks GQA {HQ}/{HK}, {env.a.tokens_per_rank}/rank",
        env.a.tokens_per_rank * env.world,
        lambda q, k, v, s: ulysses_attention(q, k, v, layout="contiguous", backend=env.backend, sinks=s, **mods),
        lambda q, k, v, s, backend: longattn.flash_attention(q, k, v, backend=backend, sinks=s, **mods),
        lambda t: shard(t, layout="contiguous"), lambda t: unshard(t, layout="contiguous"))


def hybrid_case(env: Env, ring_group, ulysses_group, label: str) -> Case:
    mods = _mods(env)
    groups = dict(ring_group=ring_group, ulysses_group=ulysses_group)
    return _unpacked(
        env, f"hybrid {label} causal softcap+alibi+sinks GQA {HQ}/{HK}, {env.a.tokens_per_rank}/rank",
        env.a.tokens_per_rank * env.world,
        lambda q, k, v, s: hybrid_attention(q, k, v, layout="zigzag", backend=env.backend, sinks=s, **groups,
                                            **mods),
        lambda q, k, v, s, backend: longattn.flash_attention(q, k, v, backend=backend, sinks=s, **mods),
        lambda t: shard_hybrid(t, layout="zigzag", **groups), lambda t: unshard_hybrid(t, layout="zigzag", **groups))


def hybrid_rows(env: Env) -> List[Row]:
    """hybrid_attention on the two degenerate grids of the world: ring over all ranks with Ulysses groups of one,
    and one Ulysses group of all ranks with rings of one."""
    singles = [dist.new_group([r]) for r in range(env.world)]  # every rank creates every group
    world, own = dist.group.WORLD, singles[env.rank]
    rows: List[Row] = []
    for ring_group, ulysses_group, label in ((world, own, f"ring {env.world} x ulysses 1"),
                                             (own, world, f"ring 1 x ulysses {env.world}")):
        case = hybrid_case(env, ring_group, ulysses_group, label)
        try:
            rows += check_case(env, case, seed=300)
        except (ValueError, NotImplementedError) as e:  # refused on every rank alike (the calls check together)
            env.log(f"\n{case.name}: skipped, hybrid_attention refused the grid: {e}")
            rows.append(Row(case.name, "-", math.nan, math.nan, "SKIP", f"refused: {e}"[:100]))
            env.free()
    return rows


def deterministic_rows(env: Env) -> List[Row]:
    """ring_attention(deterministic=True) twice on the same inputs: bitwise-equal output and gradients. Without
    soft-capping and ALiBi, so that without the flag the blocks' backward would be the fused Hopper kernel (whose dQ
    sums arrive in a varying order): the flag is what makes the runs equal. Two cases: GQA {HQ}/{HK} at the run's
    head dim with sinks, and 16/16 heads at D=64 without (where 2 x H200 gave dK differing between runs, session of
    2026-11-29, sixth)."""
    rows = []
    n = env.a.tokens_per_rank
    for hq, hk, D, with_sinks in ((HQ, HK, env.a.head_dim, True), (16, 16, 64, False)):
        name = (f"ring deterministic=True, 2 runs bitwise equal, {hq}/{hk} heads D={D}"
                f"{' +sinks' if with_sinks else ''}, {n}/rank")
        N = n * env.world
        q = _randn(env, 400, 1, N, hq, D, scale=2.0)
        k, v = (_randn(env, 400 + i, 1, N, hk, D) for i in (1, 2))
        do = _randn(env, 403, 1, N, hq, D)
        sinks = _randn(env, 404, hq).float()
        case = Case(name, (1, N, hq, D), (1, N, hk, D),
                    lambda q, k, v, s: ring_attention(q, k, v, layout="zigzag", backend=env.backend,
                                                      sinks=s if with_sinks else None, causal=True,
                                                      deterministic=True),
                    None, lambda t: shard(t, layout="zigzag"), lambda t: unshard(t, layout="zigzag"))
        runs: List[List[Tensor]] = [[], []]
        for mine in runs:
            _run_dist(env, case, (q, k, v), sinks, do, deterministic_leaves=mine)
        same = [torch.equal(a, b) for a, b in zip(*runs)]
        every = [env.all_true(s) for s in same]
        env.log(f"\n{case.name}")
        for what, ok, a, b in zip(GRAD_NAMES, every, *runs):
            diff = env.max_over_ranks(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0)
            env.log(f"  {what:6s} bitwise equal on every rank: {ok}   max |difference| {diff:.2e}")
            rows.append(Row(case.name, what, math.nan, math.nan, "OK" if ok else "FAIL", "bitwise"))
        del q, k, v, do, runs
        env.free()
    return rows


def transport_rows(env: Env) -> List[Row]:
    """ulysses_attention and ring_attention through NCCL and through the copy engines
    (``ParallelOptions.transport``: "nccl" and "copy_engine"), ``deterministic=True``, on the same inputs: bitwise-equal
    output, lse and gradients on every rank. Cases: Ulysses contiguous, GQA 8/2 (the key/value heads shared by the
    head groups), a log-sum-exp gradient; Ulysses zigzag, two batch rows, 8/8 heads in 4 groups; the ring zigzag,
    GQA 8/2, a log-sum-exp gradient. SKIP where the copy engines cannot run (the CPU smoke run)."""
    n, D, rows = env.a.tokens_per_rank, env.a.head_dim, []
    for method, label, B, hk, layout, chunks, with_lse in (
            ("ulysses", "contiguous GQA 8/2 +lse", 1, HK, "contiguous", 2, True),
            ("ulysses", "zigzag B=2 8/8, 4 head groups", 2, HQ, "zigzag", 4, False),
            ("ring", "zigzag GQA 8/2 +lse", 1, HK, "zigzag", 2, True)):
        name = f"{method} transports nccl = copy_engine, {label}, causal, {n}/rank"
        N = n * env.world
        full = [_randn(env, 500 + i, B, N, h, D, scale=2.0 if i == 0 else 1.0).to(env.low)
                for i, h in enumerate((HQ, hk, hk, HQ))]
        d_lse = _randn(env, 505, B, HQ, n).float() if with_lse else None
        attend = ulysses_attention if method == "ulysses" else ring_attention
        results = {}
        for transport in ("nccl", "copy_engine"):
            options = ParallelOptions(transport=transport, head_chunks=chunks)
            try:
                parts = [shard(t, layout=layout).detach().clone().requires_grad_() for t in full[:3]]
                res = attend(*parts, layout=layout, causal=True, backend=env.backend, return_lse=with_lse,
                             deterministic=True, options=options)
                out, lse = res if with_lse else (res, None)
                loss = (out.float() * shard(full[3], layout=layout).float()).sum()
                if with_lse:
                    loss = loss + (lse * d_lse).sum()
                loss.backward()
                results[transport] = [out.detach()] + ([lse.detach()] if with_lse else []) + [p.grad for p in parts]
            except RuntimeError as e:  # copy engines unavailable: refused on every rank alike
                results[transport] = str(e)
        names = ["out"] + (["lse"] if with_lse else []) + ["dq", "dk", "dv"]
        env.log(f"\n{name}")
        if isinstance(results["copy_engine"], str):
            env.log(f"  skipped: {results['copy_engine'][:120]}")
            rows.append(Row(name, "-", math.nan, math.nan, "SKIP", "copy engines unavailable"))
            continue
        for what, a, b in zip(names, results["nccl"], results["copy_engine"]):
            ok = env.all_true(torch.equal(a, b))
            e = env.max_over_ranks(_rel(b, a))
            env.log(f"  {what:6s} bitwise equal on every rank: {ok}   max rel diff {e:.2e}")
            rows.append(Row(name, what, e, math.nan, "OK" if ok else "FAIL", "bitwise"))
        del full, results
        env.free()
    return rows


def correctness(env: Env) -> List[Row]:
    what = "bf16 vs float32" if env.cuda else "float32 vs float64 (smoke)"
    env.log(f"\n== 1. correctness, {env.world} ranks, {what}, relative errors max|x - ref| / max|ref| ==")
    rows: List[Row] = []
    for make in (ring_case, packed_case, ulysses_case):
        rows += check_case(env, make(env), seed=100)
    rows += hybrid_rows(env)
    rows += deterministic_rows(env)
    rows += transport_rows(env)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# 2. context-parallel training

class Train(NamedTuple):
    case: str
    loss_p: float
    loss_1: Optional[float]
    loss_rel: float
    grad_rel: float
    worst: str
    status: str
    t_p: float
    t_1: Optional[float]
    peak_p: float


def _peak_gib(env: Env) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if env.cuda else math.nan


def _reset_peak(env: Env) -> None:
    if env.cuda:
        torch.cuda.reset_peak_memory_stats()


def _grads(model) -> List[Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters()]


def _grad_errors(model, want: List[Tensor]):
    """The relative norm of the gradients' difference over all parameters, and the worst parameter's."""
    num = den = 0.0
    worst, worst_name = 0.0, ""
    for (name, p), w in zip(model.named_parameters(), want):
        d = float((p.grad.float() - w).norm() ** 2)
        n = float(w.norm() ** 2)
        num, den = num + d, den + n
        rel = math.sqrt(d / n) if n > 0 else (0.0 if d == 0 else math.inf)
        if rel > worst:
            worst, worst_name = rel, name
    return math.sqrt(num / max(den, 1e-300)), f"{worst_name} {worst:.2e}"


def training(env: Env) -> List[Train]:
    a = env.a
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        env.log(f"\n== 2. context-parallel training: skipped, transformers is not installed ({e}) ==")
        return []
    from longattn.integrations.transformers import context_parallel, register

    register()
    n, cfg = a.train_tokens, a.model
    config = LlamaConfig(**cfg, max_position_embeddings=n, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=env.device, dtype=env.low).train()
    model.set_attn_implementation("longattn")
    ids = torch.randint(1, cfg["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1)).to(env.device)
    batch = {"input_ids": ids, "labels": ids}
    env.log(f"\n== 2. context-parallel training: Llama hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
            f"layers, {cfg['num_attention_heads']} heads, {cfg['num_key_value_heads']} kv heads, vocab "
            f"{cfg['vocab_size']}, {str(env.low).replace('torch.', '')} weights, {n} tokens over {env.world} ranks; "
            f"a first step compared, then {a.iters} timed steps (forward, backward, gradient all-reduce) ==")

    one = None  # rank 0: (loss, grads, seconds per step, peak GiB), or the reason it did not run
    if env.rank == 0 and "single" not in a.skip:
        def step1():
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            return loss.detach()

        oom = False
        try:
            _reset_peak(env)
            t0 = time.perf_counter()
            loss1 = float(step1())
            env.sync()
            first = time.perf_counter() - t0
            want = _grads(model)
            t1 = timed(env, step1, a.iters, collective=False)
            one = (loss1, want, t1, _peak_gib(env))
            env.log(f"1 rank, whole sequence: loss {loss1:.6f}, first step {first:.2f} s, {t1:.3f} s/step"
                    + (f", peak {one[3]:.1f} GiB" if env.cuda else ""))
        except torch.cuda.OutOfMemoryError as e:
            oom = str(e).splitlines()[0][:160]
        if oom:
            one = f"1 GPU OOM on the whole sequence: {oom}"
            env.log(one)
        model.zero_grad(set_to_none=True)
        env.free()
    elif "single" in a.skip:
        one = "1-GPU run skipped (--skip single)"
    dist.barrier()

    results = []
    for mode in ("ring", "ulysses"):
        plan = ContextParallel(mode=mode)
        part = plan.shard_batch(batch)

        def step():
            model.zero_grad(set_to_none=True)
            with context_parallel(plan=plan):
                loss = model(**part).loss
                loss.backward()
            plan.all_reduce_gradients(model)
            return loss.detach()

        _reset_peak(env)
        t0 = time.perf_counter()
        loss_p = float(plan.reduce_loss(step()))
        env.sync()
        first = time.perf_counter() - t0
        name = f"CP {mode} ({plan.layout_for(False)}), {n} tokens"
        loss_1 = t_1 = None
        loss_rel = grad_rel = math.nan
        worst, status = "", "OK"
        if env.rank == 0 and isinstance(one, tuple):
            loss_1, want, t_1 = one[0], one[1], one[2]
            loss_rel = abs(loss_p - loss_1) / abs(loss_1)
            grad_rel, worst = _grad_errors(model, want)
            loss_tol, grad_tol = (SMOKE_LOSS_TOL, SMOKE_GRAD_TOL) if env.a.cpu_smoke else (LOSS_TOL, GRAD_TOL)
            status = "OK" if loss_rel <= loss_tol and grad_rel <= grad_tol else "FAIL"
        elif env.rank == 0:
            status, worst = "n/a", str(one)
        t_p = timed(env, step, a.iters)
        peak = env.max_over_ranks(_peak_gib(env)) if env.cuda else math.nan
        env.log(f"{name}: loss {loss_p:.6f}" + (f" (1 rank {loss_1:.6f})" if loss_1 is not None else "")
                + f", first step {first:.2f} s, {t_p:.3f} s/step" + (f", peak {peak:.1f} GiB/rank" if env.cuda else ""))
        results.append(Train(name, loss_p, loss_1, loss_rel, grad_rel, worst, status, t_p, t_1, peak))
        model.zero_grad(set_to_none=True)
        env.free()
    return results


# ---------------------------------------------------------------------------------------------------------------

def summary(env: Env, rows: List[Row], train: List[Train]) -> bool:
    """Print the tables; whether every case passed (on rank 0: the training comparisons are made there)."""
    ok = True
    if rows:
        env.log("\n== summary: correctness (max over out, dq, dk, dv, dsinks; relative errors) ==")
        env.log(f"| {'case':78s} | {'dist vs fp32':>12s} | {'1-dev vs fp32':>13s} | status |")
        env.log(f"|{'-' * 80}|{'-' * 14}|{'-' * 15}|--------|")
        for name in dict.fromkeys(r.case for r in rows):
            mine = [r for r in rows if r.case == name]
            status = "FAIL" if any(r.status == "FAIL" for r in mine) else mine[0].status
            ok &= status != "FAIL"
            e_d = max((r.e_dist for r in mine), default=math.nan)
            e_s = max((r.e_single for r in mine), default=math.nan)
            cells = ("bitwise", "-") if mine[0].note == "bitwise" else (f"{e_d:.2e}", f"{e_s:.2e}")
            if status == "SKIP":
                cells = ("skipped", "-")
            env.log(f"| {name[:78]:78s} | {cells[0]:>12s} | {cells[1]:>13s} | {status:6s} |")
    if train:
        loss_tol, grad_tol = (SMOKE_LOSS_TOL, SMOKE_GRAD_TOL) if env.a.cpu_smoke else (LOSS_TOL, GRAD_TOL)
        env.log(f"\n== summary: context-parallel training (first step against 1 GPU: loss |diff|/loss <= {loss_tol}, "
                f"gradients |diff|/|grad| over all parameters <= {grad_tol}) ==")
        env.log(f"| {'case':36s} | {'loss P GPUs':>11s} | {'loss 1 GPU':>10s} | {'loss rel':>8s} | {'grad rel':>8s} "
                f"| status | worst parameter")
        env.log(f"|{'-' * 38}|{'-' * 13}|{'-' * 12}|{'-' * 10}|{'-' * 10}|--------|----")
        for t in train:
            ok &= t.status != "FAIL"
            loss_1 = f"{t.loss_1:.5f}" if t.loss_1 is not None else "-"
            env.log(f"| {t.case:36s} | {t.loss_p:11.5f} | {loss_1:>10s} | {t.loss_rel:8.1e} | {t.grad_rel:8.1e} | "
                    f"{t.status:6s} | {t.worst}")
        env.log("\ntiming (mean per training step, the slowest rank's):")
        for t in train:
            units = ("GPUs", "1 GPU") if env.cuda else ("processes", "1 process")
            line = f"  {t.case}: {env.world} {units[0]} {t.t_p:.3f} s/step"
            if t.t_1 is not None:
                line += (f", {units[1]} {t.t_1:.3f} s/step: speedup {t.t_1 / t.t_p:.2f}, efficiency "
                         f"{t.t_1 / (env.world * t.t_p):.3f}")
            if env.cuda:
                line += f"; peak {t.peak_p:.1f} GiB/rank"
            env.log(line)
    return ok


def run(env: Env) -> bool:
    a = env.a
    device = f"{env.world} x {torch.cuda.get_device_name(env.device)}" if env.cuda else f"{env.world} CPU processes"
    env.log(f"sequence-parallel check: {device}, {dist.get_backend()}, torch {torch.__version__}, backend "
            f"{env.backend}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    t0 = time.perf_counter()
    rows = correctness(env) if "check" not in a.skip else []
    env.log(f"\n(correctness took {time.perf_counter() - t0:.1f} s)")
    train = training(env) if "train" not in a.skip else []
    mine = summary(env, rows, train)
    failing = ([f"{r.case} / {r.what} ({r.e_dist:.2e} vs 1-dev {r.e_single:.2e})" for r in rows if r.status == "FAIL"]
               + [t.case for t in train if t.status == "FAIL"])
    every: List[Optional[List[str]]] = [None] * env.world
    dist.all_gather_object(every, failing)
    for r, names in enumerate(every):
        if names:
            env.log(f"rank {r} FAILs: " + "; ".join(names))
    ok = env.all_true(mine)
    env.log(f"\nresult: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s)")
    return ok


def worker(rank: int, world: int, a: argparse.Namespace, store: str) -> None:
    """One rank (spawned, or started by torchrun when ``store`` is empty). Exits 1 if a case failed; on an error,
    prints it and leaves at once (torchrun or the spawning process then stops the other ranks)."""
    cuda = not a.cpu_smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = dict(init_method=f"file://{store}/store", rank=rank, world_size=world) if store else {}
    extra = {"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=a.timeout_min), **init, **extra)
    try:
        if dist.get_world_size() < 2:
            raise ValueError(f"needs 2 or more ranks, got {dist.get_world_size()}")
        ok = run(Env(rank, world, a))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no waiting in collectives the other ranks will never join
    if not ok:
        sys.exit(1)


def main() -> None:
    a = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a, "")
        return
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory() as store:
        try:
            mp.spawn(worker, args=(a.world, a, store), nprocs=a.world)
        except ProcessException as e:
            raise SystemExit(f"gpu_sp_check: {e}") from None


if __name__ == "__main__":
    main()
