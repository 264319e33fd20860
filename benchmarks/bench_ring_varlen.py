"""Packed variable-length batches on ring attention across GPUs: the efficiency of the packed layouts.

A packed batch of ``--tokens-per-gpu`` x P rows in documents of long-tailed lengths (log-uniform in 64..16k,
seed 0: ``longattn.bench.varlen_suite.document_lengths``, the batch of ``tools/gpu_ring_check.py``), Hq 16, Hk 4,
D 128, bf16. For each packed layout (``contiguous``: the batch's rows cut in P; ``balanced``: documents dealt out
whole to balance the causal work, the longest cut in 2P chunks where needed), causal and not, forward and
forward+backward:

- T_P: ``ring_attention(q, k, v, cu_seqlens=cu, layout=layout)`` on the P ranks, the slowest rank's time;
- T_1: ``flash_attention_varlen`` on the whole batch on one GPU (rank 0's, the other ranks waiting);
- efficiency ``T_1 / (P T_P)``, as ``docs/distributed.md`` defines it;
- work: the largest rank's share of the attention's query-key pairs over the mean
  (:func:`longattn.distributed.ring_varlen.work_per_rank`), and the ring output's max error against the one-GPU
  output (both bf16).

Timing: fixed-count loops, the same counts on every rank (never ``do_bench``, whose counts differ between ranks
and hang NCCL), synchronized and behind a barrier; the mean per call, the slowest rank's.

    python benchmarks/bench_ring_varlen.py                   # one process per GPU, 2 GPUs (--world)
    torchrun --nproc-per-node 2 benchmarks/bench_ring_varlen.py
    python benchmarks/bench_ring_varlen.py --cpu-smoke       # gloo, 2 CPU processes, tiny sizes: that it runs

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Callable, List  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

LAYOUTS = ("contiguous", "balanced")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU processes, tiny sizes (checks it runs)")
    p.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun (default 2)")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="packed rows per rank (default 131072)")
    p.add_argument("--longest", type=int, default=16384,
                   help="longest document of the log-uniform lengths (default 16384; longer ones get cut in chunks)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; smoke 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls, the same on every rank (default 5)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of packed layouts")
    p.add_argument("--out", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    a.tokens_per_gpu = a.tokens_per_gpu or (96 if smoke else 131072)
    if smoke:
        a.heads, a.kv_heads, a.head_dim = 2, 1, 16
    a.warmup = 1 if a.warmup is None and smoke else 2 if a.warmup is None else a.warmup
    a.iters = 1 if a.iters is None and smoke else 5 if a.iters is None else a.iters
    a.layouts = [x for x in a.layouts.split(",") if x]
    bad = [x for x in a.layouts if x not in LAYOUTS]
    if bad:
        p.error(f"--layouts: {bad} not among {LAYOUTS}")
    return a


def lengths(total: int, a) -> List[int]:
    """The long-tailed document lengths filling ``total`` rows (seed 0): 64..``a.longest``; in the smoke run 4..64."""
    from longattn.bench.varlen_suite import document_lengths

    return document_lengths(total, low=4, high=64, seed=0) if a.cpu_smoke else document_lengths(
        total, high=a.longest, seed=0)


def timed(fn: Callable[[], None], a, cuda: bool, collective: bool = True) -> float:
    """Mean seconds per call of ``fn`` over ``a.iters`` calls after ``a.warmup`` (the same counts on every rank);
    ``collective``: behind a barrier, the slowest rank's."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(a.warmup):
        fn()
    sync()
    if collective:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        fn()
    sync()
    dt = (time.perf_counter() - t0) / a.iters
    if not collective:
        return dt
    t = torch.tensor([dt], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def fwd_and_fwdbwd(attn, q, k, v, a, cuda: bool, collective: bool = True):
    """Seconds per forward and per forward+backward of ``attn(q, k, v)``."""
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        attn(q, k, v).backward(do)

    return timed(fwd, a, cuda, collective), timed(fwdbwd, a, cuda, collective)


def run(rank: int, world: int, a) -> List[str]:
    """This rank's part of the benchmark; the table's lines on rank 0."""
    import longattn
    from longattn.distributed import ring_attention, shard, unshard
    from longattn.distributed.ring_varlen import work_per_rank
    from longattn.utils import cu_seqlens_of

    cuda = not a.cpu_smoke
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype, backend = (torch.bfloat16, "auto") if cuda else (torch.float32, "torch")
    total = a.tokens_per_gpu * world
    lens = lengths(total, a)
    cu = cu_seqlens_of(lens, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    full = [torch.randn(total, h, a.head_dim, generator=gen, device=dev, dtype=dtype)
            for h in (a.heads, a.kv_heads, a.kv_heads)]
    rows = []
    for causal in (False, True):
        t1 = [None, None]
        if rank == 0:
            def one(q, k, v, causal=causal):
                return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                                       backend=backend)

            qf, kf, vf = (t.clone().requires_grad_() for t in full)
            t1 = fwd_and_fwdbwd(one, qf, kf, vf, a, cuda, collective=False)
            with torch.no_grad():
                want = one(*full)
            del qf, kf, vf
        dist.barrier()
        for layout in a.layouts:
            def ring(q, k, v, causal=causal, layout=layout):
                return ring_attention(q, k, v, cu_seqlens=cu, causal=causal, layout=layout, backend=backend)

            q, k, v = (shard(t, layout=layout, dim=0, cu_seqlens=cu).requires_grad_() for t in full)
            tp = fwd_and_fwdbwd(ring, q, k, v, a, cuda)
            with torch.no_grad():
                got = unshard(ring(q, k, v), layout=layout, dim=0, cu_seqlens=cu)
            work = work_per_rank(cu.tolist(), world, causal, layout)
            if rank == 0:
                err = (got.float() - want.float()).abs().max().item()
                rows.append((layout, causal, tp, t1, max(work) * world / sum(work), err))
            del q, k, v, got
            if cuda:
                torch.cuda.empty_cache()
    if rank:
        return []
    from longattn.distributed.shards import balanced_layout

    device = torch.cuda.get_device_name(dev) if cuda else "CPU (gloo)"
    cut = balanced_layout(tuple(cu.tolist()), world).cut
    out = [f"ring_attention on a packed batch: P={world} x {device}, {a.tokens_per_gpu} rows per rank, {len(lens)} "
           f"documents of {min(lens)}..{max(lens)} rows ({cut} cut in 2P chunks by the balanced layout), "
           f"Hq={a.heads}, Hk={a.kv_heads}, D={a.head_dim}, {str(dtype).replace('torch.', '')}, "
           f"torch {torch.__version__}; {a.iters} timed calls after {a.warmup}",
           "",
           "| layout | causal | pass | T_P ms | T_1 ms | efficiency | work max/mean | max err vs 1 GPU |",
           "|---|---|---|---|---|---|---|---|"]
    for layout, causal, tp, t1, imbalance, err in rows:
        for j, name in enumerate(("fwd", "fwd+bwd")):
            out.append(f"| {layout} | {causal} | {name} | {tp[j] * 1e3:.2f} | {t1[j] * 1e3:.2f} | "
                       f"{t1[j] / (world * tp[j]):.3f} | {imbalance:.3f} | {err:.2e} |")
    return out


def worker(rank: int, world: int, a, store: str) -> None:
    """One rank (spawned, or started by torchrun when ``store`` is empty)."""
    cuda = not a.cpu_smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = dict(init_method=f"file://{store}/store", rank=rank, world_size=world) if store else {}
    extra = {"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10), **init, **extra)
    try:
        lines = run(rank, world, a)
        if lines:
            print("\n".join(lines), flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main() -> None:
    a = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a, "")
        return
    with tempfile.TemporaryDirectory() as store:
        mp.spawn(worker, args=(a.world, a, store), nprocs=a.world)


if __name__ == "__main__":
    main()
