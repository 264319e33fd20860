"""Copy-engine transfers against NCCL on 2-4 GPUs of one host: bitwise equality, a soak with injected failures,
and the time per call.

    torchrun --nproc_per_node=2 tools/copy_engine_soak.py            # also --nproc_per_node=4
    torchrun --nproc_per_node=2 tools/copy_engine_soak.py --calls 3000 --every 50

1. Bitwise: ``ulysses_attention`` (two head groups, with lse) and ``ring_attention`` (zigzag, causal), bf16,
   ``deterministic=True``, forward and backward through ``ParallelOptions(transport="nccl")`` and ``"copy_engine"``
   on the same inputs: output and gradients must be bitwise equal.
2. Soak: ``--calls`` calls of sizes drawn alike on every rank (so the workspace grows between calls), alternating
   Ulysses and the ring, each compared bitwise with NCCL; every ``--every`` calls a failure is injected on one rank
   (in turn: out of memory while the call allocates, a copy that raises after the call started); the first must
   raise ``OutOfMemoryError`` on every rank and leave the next call right; after the second the victim raises, its
   peers either raise ``OutOfStep`` (their backward's agreement meets the victim's ``release``) or return NaN,
   and once every rank called ``copy_engine.release`` the calls are right again. Nothing may hang (the watchdog
   would end the process).
3. Time per call (forward + backward, ``--tokens`` per GPU), NCCL and copy engines, and their ratio.

Prints a table and PASS or FAIL (exit status 1).
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longattn.distributed import ParallelOptions, copy_engine, ring_attention, shard, ulysses_attention  # noqa: E402


def _call(method: str, n: int, heads: int, seed: int, dev, transport: str) -> list:
    """Forward and backward of ``method`` on ``n`` tokens per rank, its blocks moved by ``transport``; output and
    gradients."""
    world = dist.get_world_size()
    g = torch.Generator(device=dev).manual_seed(seed)
    full = [torch.randn(1, n * world, heads, 64, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    layout = "zigzag" if method == "ring" else "contiguous"
    q, k, v = (shard(x, layout=layout).detach().requires_grad_() for x in full)
    fn = ring_attention if method == "ring" else ulysses_attention
    out = fn(q, k, v, causal=True, layout=layout, deterministic=True, options=ParallelOptions(transport=transport))
    out.float().square().sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _both(method: str, n: int, heads: int, seed: int, dev) -> bool:
    want = _call(method, n, heads, seed, dev, "nccl")
    return _same(want, _call(method, n, heads, seed, dev, "copy_engine"))


def _inject(real, kind: str) -> None:
    """Make the runtime fail once here (the links hold it): ``"oom"`` at the call's allocation, ``"copy"`` at a
    copy after the call started. :func:`_uninject` undoes it."""
    name = "empty" if kind == "oom" else "memcpy2d"
    original = getattr(real, name)

    def failing(*a, **kw):
        setattr(real, name, original)
        if kind == "oom":
            raise torch.OutOfMemoryError("injected: out of memory")
        raise RuntimeError("injected: a copy failed")
    setattr(real, name, failing)


def _uninject(real) -> None:
    for name in ("empty", "memcpy2d"):
        real.__dict__.pop(name, None)


def soak(args, dev, rank: int, world: int) -> dict:
    rng = random.Random(args.seed)  # the same draws on every rank
    stats = dict(calls=0, mismatches=0, injected=0, recovered=0, unexpected=0)
    real = copy_engine.RUNTIME
    for i in range(args.calls):
        method = "ulysses" if i % 2 else "ring"
        n = 64 * rng.randint(1, args.max_blocks)
        inject = i > 0 and i % args.every == 0
        kind = ("oom", "copy")[(i // args.every) % 2]
        victim = (i // args.every) % world
        if inject:
            stats["injected"] += 1
            if rank == victim:
                _inject(real, kind)
            result, failed = None, None
            try:
                result = _call("ulysses", n, 2 * world, i, dev, "copy_engine")
            except Exception as e:  # noqa: BLE001 (checked below)
                failed = e
            _uninject(real)
            if kind == "oom":  # before any transfer: the same error on every rank
                ok = isinstance(failed, torch.OutOfMemoryError)
            else:  # half-way: the victim raises; a peer raises out of step (its backward) or has NaN results
                if rank == victim:
                    ok = failed is not None and "injected" in str(failed)
                else:
                    ok = (failed is not None and "release(" in str(failed)) or (
                        failed is None and bool(result[0].isnan().any()))
                copy_engine.release("all")  # every rank: back in step
            stats["recovered" if ok else "unexpected"] += 1
            if not ok:
                print(f"rank {rank} call {i} ({kind}, victim {victim}): {failed!r}", flush=True)
        stats["calls"] += 1
        if not _both(method, n, 2 * world, i, dev):
            stats["mismatches"] += 1
    return stats


def timing(args, dev) -> list:
    rows = []
    world = dist.get_world_size()
    for method in ("ulysses", "ring"):
        per = {}
        for name in ("nccl", "copy_engine"):
            for _ in range(2):
                _call(method, args.tokens, 16, 0, dev, name)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                _call(method, args.tokens, 16, 0, dev, name)
            torch.cuda.synchronize()
            t = torch.tensor([(time.perf_counter() - t0) / args.iters], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            per[name] = t.item() * 1e3
        rows.append((f"{method} fwd+bwd {args.tokens}/GPU x{world}", per["nccl"], per["copy_engine"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--every", type=int, default=100, help="inject a failure every this many calls")
    p.add_argument("--max-blocks", type=int, default=64, help="soak sizes: up to this many 64-token blocks a rank")
    p.add_argument("--tokens", type=int, default=32768, help="timing: tokens per GPU")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    bitwise = [(m, _both(m, 4096, 2 * world * 4, 7, dev)) for m in ("ulysses", "ring")]
    stats = soak(args, dev, rank, world)
    rows = timing(args, dev)
    ok = all(b for _, b in bitwise) and stats["mismatches"] == 0 and stats["unexpected"] == 0
    flag = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{'check':44s} {'result':>24s}")
        for m, b in bitwise:
            print(f"{m + ' nccl == copy_engine (bitwise)':44s} {'yes' if b else 'NO':>24s}")
        print(f"{'soak calls / mismatches':44s} {stats['calls']:>12d} / {stats['mismatches']:<9d}")
        print(f"{'injected failures / recovered / unexpected':44s} "
              f"{stats['injected']:>6d} / {stats['recovered']:d} / {stats['unexpected']:d}")
        print(f"{'time per call (ms)':44s} {'nccl':>10s} {'copy_engine':>12s} {'ratio':>7s}")
        for name, a, b in rows:
            print(f"{name:44s} {a:10.2f} {b:12.2f} {a / b:7.3f}")
        print("PASS" if flag.item() else "FAIL")
    dist.destroy_process_group()
    sys.exit(0 if flag.item() else 1)


if __name__ == "__main__":
    main()
