"""Scaling efficiency of ring and Ulysses attention on 2+ GPUs (NCCL), or CPU processes (gloo) as a smoke run.

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --nproc-per-node 2 tools/gpu_sp_efficiency.py \
        --tokens-per-gpu 32768,65536 --rounds 7 --budget-s 280
    python -m torch.distributed.run --nproc-per-node 2 tools/gpu_sp_efficiency.py --cpu     # gloo, tiny sizes

For n tokens per rank (N = P n), H query heads (Hk key/value heads, default H), head size D, bf16:
ring_attention (zigzag) and ulysses_attention (--ulysses-layout, default zigzag, as in the 2026-11-26 table of
docs/benchmarks.md; ulysses:C with C head groups, ulysses:C:T and ring:T with transport T, see docs/distributed.md)
with each backend of
--backends, forward (no_grad) and forward+backward, causal and not: T_P, the slowest rank's mean per call. T_1:
longattn.flash_attention on the whole sequence on one GPU with the same backend ("same") and with "auto"; the
single-GPU configurations are dealt out over the ranks (a different GPU each round). Efficiency = T_1 / (P T_P).

Inputs: the full tensors are drawn with the same seed on every rank and cut with longattn.distributed.shard. A
warm-up pass (compiles the kernels) also checks the distributed forward output against the single-GPU one.
Timing: fixed-count loops, the same on every rank, behind a barrier and synchronized (no do_bench); rounds
interleave all methods; medians over rounds. The rounds stop early once --budget-s (from process start) would be
passed. NCCL_NVLS_ENABLE=0.
"""
from __future__ import annotations

import time

T_START = time.perf_counter()

import os  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # (symmetric memory: Ulysses' copy-engine transfers)

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn.distributed import ParallelOptions, ring_attention, shard, ulysses_attention, unshard  # noqa: E402
from longattn.utils import auto_backend  # noqa: E402
from gpu_ring_check import Env as RingEnv  # noqa: E402  (tools/ is the script's folder)
from gpu_sp_check import timed  # noqa: E402

PASSES = ("fwd", "fwd+bwd")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes, tiny sizes, backend torch")
    p.add_argument("--tokens-per-gpu", default=None, help="comma list (default 32768,65536; cpu 64,128)")
    p.add_argument("--heads", type=int, default=None, help="H (default 16; cpu 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="Hk (default H)")
    p.add_argument("--head-dim", type=int, default=None, help="D (default 128; cpu 16)")
    p.add_argument("--backends", default=None, help="comma list for the distributed calls (default triton,auto)")
    p.add_argument("--methods", default="ring,ulysses",
                   help="ring, ring:T, ulysses, ulysses:C (C head groups pipelined), ulysses:C:T (transport T: "
                        "auto, nccl, copy_engine)")
    p.add_argument("--ulysses-layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per measurement before the rounds")
    p.add_argument("--iters", type=int, default=3, help="fewest timed calls per measurement and round")
    p.add_argument("--min-ms", type=float, default=150.0,
                   help="more calls for short measurements: at least this long per measurement and round")
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="most rounds (at least 1 runs)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no round that would end after this")
    p.add_argument("--out", default="", help="rank 0 writes the summary here after every round")
    p.add_argument("--timeout-min", type=float, default=6.0, help="process-group timeout")
    a = p.parse_args()
    a.tokens_per_gpu = [int(x) for x in (a.tokens_per_gpu or ("64,128" if a.cpu else "32768,65536")).split(",")]
    a.heads = a.heads or (4 if a.cpu else 16)
    a.kv_heads = a.kv_heads or a.heads
    a.head_dim = a.head_dim or (16 if a.cpu else 128)
    a.backends = (a.backends or ("torch" if a.cpu else "triton,auto")).split(",")
    a.methods = a.methods.split(",")
    return a


class Env(RingEnv):
    """:mod:`gpu_ring_check`'s process set-up (rank, device, process group, logging, the slowest rank's time) with
    this tool's arguments (``a``) and dtype."""

    def __init__(self, a):
        a.device = "cpu" if a.cpu else "cuda"
        if a.cpu:
            torch.set_num_threads(1)
        super().__init__(a)
        self.a = a
        self.dtype = torch.bfloat16 if self.cuda else torch.float32


def once(env, f):
    """Seconds of one call of ``f`` (synchronized; local)."""
    env.sync()
    t0 = time.perf_counter()
    f()
    env.sync()
    return time.perf_counter() - t0


def leaves(ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def fwd_fns(attn, q, k, v, do):
    """The forward (no_grad) and forward+backward calls of ``attn`` on leaves q, k, v."""
    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        attn(q, k, v).backward(do)

    return fwd, fwdbwd


class Size:
    """The full tensors of one size (the same on every rank) and this rank's shards in each layout."""

    def __init__(self, env, n):
        a = env.a
        self.n, self.N = n, n * env.world
        g = torch.Generator(device=env.device).manual_seed(1234 + n)
        full = [torch.randn(1, self.N, h, a.head_dim, generator=g, device=env.device, dtype=torch.float32).to(env.dtype)
                for h in (a.heads, a.kv_heads, a.kv_heads, a.heads)]
        self.full = leaves(full[:3]) + [full[3]]
        self.parts = {}
        for layout in {"zigzag", a.ulysses_layout}:
            cut = [shard(t.detach(), layout=layout) for t in full]
            self.parts[layout] = leaves(cut[:3]) + [cut[3]]


def dist_attn(env, method, backend, causal):
    a = env.a
    default = ParallelOptions()
    if method.split(":")[0] == "ring":  # "ring[:T]": transport T (ParallelOptions.transport)
        options = ParallelOptions(transport=method.split(":")[1] if ":" in method else default.transport)

        def ring_attn(q, k, v):
            return ring_attention(q, k, v, causal=causal, layout="zigzag", backend=backend, options=options)

        return "zigzag", ring_attn
    if method.split(":")[0] == "ulysses":  # "ulysses:C[:T]": C head groups, transport T (ParallelOptions' fields)
        lay = a.ulysses_layout
        fields = method.split(":")
        options = ParallelOptions(head_chunks=int(fields[1]) if len(fields) > 1 and fields[1] else default.head_chunks,
                                  transport=fields[2] if len(fields) > 2 else default.transport)

        def attn(q, k, v):
            return ulysses_attention(q, k, v, causal=causal, layout=lay, backend=backend, options=options)

        return lay, attn
    raise ValueError(f"method {method!r}: ring, ring:T, ulysses, ulysses:C or ulysses:C:T (C head groups, "
                     f"transport T)")


def single_attn(backend, causal):
    return lambda q, k, v: longattn.flash_attention(q, k, v, causal=causal, backend=backend)


def main():
    a = parse_args()
    env = Env(a)
    P = env.world
    single_backends = list(dict.fromkeys(a.backends + (["auto"] if not a.cpu else [])))
    dev = (f"{P} x {torch.cuda.get_device_name(env.device)}" if env.cuda else f"{P} CPU processes (gloo)")
    tv = ""
    try:
        import triton
        tv = f", triton {triton.__version__}"
    except ImportError:
        pass
    env.log(f"sp_eff: {dev}, torch {torch.__version__}{tv}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, "
            f"H={a.heads}/{a.kv_heads} D={a.head_dim} {str(env.dtype).replace('torch.', '')}, n/GPU {a.tokens_per_gpu}, "
            f"methods {a.methods} (ulysses layout {a.ulysses_layout}), backends {a.backends}, single "
            f"{single_backends}, iters >= {a.iters} (>= {a.min_ms:.0f} ms), rounds <= {a.rounds}, budget {a.budget_s:.0f} s")
    sizes = {n: Size(env, n) for n in a.tokens_per_gpu}
    dists = [(n, c, m, b) for n in a.tokens_per_gpu for c in (False, True) for m in a.methods for b in a.backends]
    singles = [(n, c, b) for n in a.tokens_per_gpu for c in (False, True) for b in single_backends]

    def dist_fns(n, c, m, b):
        layout, attn = dist_attn(env, m, b, c)
        q, k, v, do = sizes[n].parts[layout]
        return fwd_fns(attn, q, k, v, do)

    def single_fns(n, c, b):
        q, k, v, do = sizes[n].full
        return fwd_fns(single_attn(b, c), q, k, v, do)

    # warm-up (compiles) and a forward check of every distributed call against the single-GPU call
    t0 = time.perf_counter()
    if env.cuda:
        for n in a.tokens_per_gpu:
            q, k = sizes[n].full[:2]
            for c in (False, True):
                env.log(f"auto routes the single-GPU call at N={n * P} causal={c}: fwd "
                        f"{auto_backend(q, k, causal=c, needs_grad=False)}, fwd+bwd "
                        f"{auto_backend(q, k, causal=c, needs_grad=True)}")
    ref, est = {}, {}  # est: seconds of one call after the warm-up, per measurement
    for n, c, b in singles:
        for p, f in zip(PASSES, single_fns(n, c, b)):
            for _ in range(a.warmup):
                f()
            est[(n, c, b, p)] = once(env, f)
        q, k, v, _ = sizes[n].full
        with torch.no_grad():
            ref[(n, c, b)] = single_attn(b, c)(q, k, v)
        env.sync()
    dist.barrier()
    env.log(f"single-GPU warm-up done ({time.perf_counter() - t0:.1f} s)")
    for n, c, m, b in dists:
        t1 = time.perf_counter()
        for p, f in zip(PASSES, dist_fns(n, c, m, b)):
            for _ in range(a.warmup):
                f()
            dist.barrier()
            est[(n, c, m, b, p)] = once(env, f)
        layout, attn = dist_attn(env, m, b, c)
        q, k, v, _ = sizes[n].parts[layout]
        with torch.no_grad():
            out = unshard(attn(q, k, v), layout=layout)
        want = ref[(n, c, b)]
        err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
        env.sync()
        env.log(f"warm-up {m:7s} {b:6s} n/GPU={n} causal={str(c):5s}: fwd max rel err vs 1 GPU {err:.2e} "
                f"({time.perf_counter() - t1:.1f} s)")
        del out
    ref.clear()
    keys = sorted(est, key=str)  # every rank has every key; the slowest rank's estimate, the same counts everywhere
    t = torch.tensor([est[k] for k in keys], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    iters = {k: min(a.max_iters, max(a.iters, math.ceil(a.min_ms / 1e3 / max(x, 1e-9))))
             for k, x in zip(keys, t.tolist())}
    env.log("calls per measurement and round: " + ", ".join(
        f"{'/'.join(str(x) for x in k)}={iters[k]}" for k in keys if iters[k] != a.iters) + f", others {a.iters}")
    if env.cuda:
        torch.cuda.empty_cache()
    env.log(f"warm-up done at {time.perf_counter() - T_START:.1f} s from start")

    tp = {key: [] for key in ((*d, p) for d in dists for p in PASSES)}
    t1s = {key: [] for key in ((*s, p) for s in singles for p in PASSES)}
    last_round = 0.0
    for r in range(a.rounds):
        elapsed = env.max_over_ranks(time.perf_counter() - T_START)  # the same decision on every rank
        if r > 0 and elapsed + 1.15 * last_round > a.budget_s:
            env.log(f"stopping after {r} rounds: {elapsed:.0f} s elapsed, a round takes {last_round:.0f} s, "
                    f"budget {a.budget_s:.0f} s")
            break
        tr = time.perf_counter()
        for d in dists:
            for p, f in zip(PASSES, dist_fns(*d)):
                tp[(*d, p)].append(timed(env, f, iters[(*d, p)], collective=True))
        mine = {}
        for i, s in enumerate(singles):
            if (i + r) % P == env.rank:
                for p, f in zip(PASSES, single_fns(*s)):
                    mine[(*s, p)] = timed(env, f, iters[(*s, p)], collective=False)
        every = [None] * P
        dist.all_gather_object(every, mine)
        for d in every:
            for key, t in d.items():
                t1s[key].append(t)
        last_round = env.max_over_ranks(time.perf_counter() - tr)
        env.log(f"round {r + 1} done in {last_round:.1f} s ({time.perf_counter() - T_START:.0f} s from start)")
        if env.rank == 0:
            text = summary(env, tp, t1s, single_backends, r + 1)
            if a.out:
                with open(a.out, "w") as fh:
                    fh.write(text + "\n")
    if env.rank == 0:
        print("\n" + summary(env, tp, t1s, single_backends, None), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _k(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def summary(env, tp, t1s, single_backends, rounds_so_far):
    a, P = env.a, env.world
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    nr = max((len(v) for v in tp.values()), default=0)
    head = (f"sp_eff: P={P}, H=Hk={a.heads}, D={a.head_dim}, {str(env.dtype).replace('torch.', '')}, ring zigzag, "
            f"ulysses {a.ulysses_layout}; medians of {nr} rounds of >= {a.iters} calls (>= {a.min_ms:.0f} ms); T_P the slowest rank's; "
            f"eff = T_1 / ({P} T_P)" + (f"  [partial, after round {rounds_so_far}]" if rounds_so_far else ""))
    lines = [head, "", "| n/GPU | N | causal | pass | method | backend | T_P ms | spread | T_1 same ms | eff same | "
             "T_1 auto ms | eff auto |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    effs = {}
    for (n, c, m, b, p), xs in tp.items():
        t = med(xs)
        spread = (max(xs) - min(xs)) / t if xs else float("nan")
        same, auto = med(t1s.get((n, c, b, p), [])), med(t1s.get((n, c, "auto", p), []))
        e_same, e_auto = same / (P * t), auto / (P * t)
        effs[(n, c, m, b, p)] = (e_same, e_auto)
        lines.append(f"| {_k(n)} | {_k(n * P)} | {'yes' if c else 'no'} | {p} | {m} | {b} | {t * 1e3:.2f} | "
                     f"{spread * 100:.1f}% | {same * 1e3:.2f} | {e_same:.3f} | {auto * 1e3:.2f} | {e_auto:.3f} |")
    # compact: one row per (n, causal, pass), as docs/benchmarks.md's 2026-11-26 (third session) table
    cols = [(m, b) for m in a.methods for b in a.backends]
    lines += ["", "| tokens/GPU | causal | pass | " + " | ".join(
        f"{m} ({b}) eff same / auto" if b != "auto" else f"{m} (auto) eff" for m, b in cols) + " |",
        "|---|---|---|" + "---|" * len(cols)]
    for n in a.tokens_per_gpu:
        for c in (False, True):
            for p in PASSES:
                cells = []
                for m, b in cols:
                    e = effs.get((n, c, m, b, p), (float("nan"),) * 2)
                    cells.append(f"{e[0]:.3f}" if b == "auto" else f"{e[0]:.3f} / {e[1]:.3f}")
                lines.append(f"| {_k(n)} | {'yes' if c else 'no'} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
