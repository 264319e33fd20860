"""Numerical drift of ring attention with the ring size.

For P = 1, 2, 4, 8 processes: the same global q, k, v (seeded, rounded to the working dtype once) are sharded,
``ring_attention`` runs forward and backward with a fixed output gradient, and the gathered output and gradients
are compared with float64 attention (:func:`longattn.reference.flash_attention`) on the same rounded inputs.
P = 1 is the single-device op (a ring of one rank calls :func:`longattn.flash_attention`). Reported: max and RMS
error of out, dq, dk, dv and the ratio of each to P = 1's.

Ranks are processes talking over gloo on CPU tensors (``--device cpu``, the default: the ring's arithmetic with
the PyTorch backend per block) or NCCL with one GPU per rank (``--device cuda``, needs P GPUs), or threads on one
device (``--transport threads``): the same ring code (the forward and backward of ring attention's autograd
function, :mod:`longattn.distributed.ring`) with the point-to-point transfers replaced by in-process copies matched
in posting order, as NCCL and gloo match them. The transfers move bytes unchanged, so on one GPU this measures the
drift of the kernels and merges the ring runs (not its speed: the thread ranks share one stream).

    python benchmarks/bench_ring_drift.py [--device cpu|cuda] [--transport processes|threads]
        [--worlds 1,2,4,8] [--tokens 2048] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import pickle
import queue
import tempfile
import threading
import time
from datetime import timedelta
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QUANTITIES = ("out", "dq", "dk", "dv")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _inputs(cfg: dict):
    """Global q, k, v, do in cfg's dtype (CPU), the same on every rank."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    n, hq, hk, d = cfg["tokens"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    shapes = [(1, n, hq, d), (1, n, hk, d), (1, n, hk, d), (1, n, hq, d)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(DTYPES[cfg["dtype"]]) for s in shapes]


def _errors(got: Sequence[torch.Tensor], q, k, v, do, causal: bool) -> Dict[str, tuple]:
    """Max and RMS error of ``got`` (out, dq, dk, dv of the whole sequence) against float64 attention on q, k, v."""
    from longattn import reference

    x = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference.flash_attention(*x, causal=causal)
    ref.backward(do.double())
    res = {}
    for name, g, w in zip(QUANTITIES, got, (ref.detach(), x[0].grad, x[1].grad, x[2].grad)):
        e = g.double().cpu() - w.cpu()
        res[name] = (float(e.abs().max()), float(e.square().mean().sqrt()))
    return res


def _worker(rank: int, world: int, cfg: dict, store: str) -> None:
    from longattn.distributed import ring_attention, shard, unshard

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]))
    try:
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        q, k, v, do = _inputs(cfg)
        layout = cfg["layout"]
        mine = [shard(t, layout=layout).to(dev).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
        out = ring_attention(*mine[:3], causal=cfg["causal"], layout=layout, backend=cfg["backend"])
        out.backward(mine[3])
        got = [unshard(t, layout=layout).cpu() for t in (out, mine[0].grad, mine[1].grad, mine[2].grad)]
        if rank == 0:
            res = _errors(got, q, k, v, do, cfg["causal"])
            with open(os.path.join(store, "result.pkl"), "wb") as f:
                pickle.dump(res, f)
    finally:
        dist.destroy_process_group()


class _Slots:
    """Messages to each rank, matched to its receives in the order both sides post them."""

    def __init__(self, world: int):
        self.lock = threading.Lock()
        self.boxes = [dict() for _ in range(world)]
        self.sent = [0] * world
        self.posted = [0] * world

    def _box(self, rank: int, i: int) -> queue.Queue:
        with self.lock:
            return self.boxes[rank].setdefault(i, queue.Queue(maxsize=1))

    def send(self, to: int, x: torch.Tensor) -> None:
        with self.lock:
            i, self.sent[to] = self.sent[to], self.sent[to] + 1
        self._box(to, i).put(x.clone())

    def post_receive(self, rank: int) -> queue.Queue:
        with self.lock:
            i, self.posted[rank] = self.posted[rank], self.posted[rank] + 1
        return self._box(rank, i)


class _Arrival:
    def __init__(self, box: queue.Queue, into: torch.Tensor, timeout_s: float):
        self.box, self.into, self.timeout_s = box, into, timeout_s

    def wait(self) -> None:
        self.into.copy_(self.box.get(timeout=self.timeout_s))


class _ThreadRing:
    """:class:`longattn.distributed.transport.Ring`'s interface for rank ``rank`` of threads sharing ``slots``."""

    def __init__(self, rank: int, world: int, slots: _Slots, timeout_s: float):
        self.rank, self.world, self.slots, self.timeout_s = rank, world, slots, timeout_s
        self.link = None  # (no copy-engine workspace)

    def open(self, channels: dict) -> None:
        pass

    def close(self, *outputs) -> None:
        pass

    def abort(self) -> None:  # (a pass that raised: nothing to release between threads)
        pass

    def in_workspace(self) -> bool:
        return False

    def exchange(self, send: torch.Tensor, channel: str = "kv"):
        recv = torch.empty_like(send)
        box = self.slots.post_receive(self.rank)
        self.slots.send((self.rank + 1) % self.world, send)
        return recv, [_Arrival(box, recv, self.timeout_s)]


def _measure_threads(world: int, cfg: dict) -> Dict[str, tuple]:
    from longattn import flash_attention
    from longattn.distributed.shards import join_shards, take_shard
    from longattn.distributed.ring import _ring_backward, _ring_forward

    dev = torch.device("cuda" if cfg["device"] == "cuda" else "cpu")
    q, k, v, do = (t.to(dev) for t in _inputs(cfg))
    scale = q.shape[-1] ** -0.5
    layout, causal = cfg["layout"], cfg["causal"]

    leaves = [[take_shard(t, layout, r, world).requires_grad_() for t in (q, k, v)] for r in range(world)]
    results: List = [None] * world
    if world == 1:
        out = flash_attention(*leaves[0], causal=causal, scale=scale, backend=cfg["backend"])
        out.backward(do)
        results[0] = out.detach()
    else:
        slots = _Slots(world)

        def rank_main(r):
            # The autograd function's forward and backward called directly: autograd runs the backward of CUDA
            # tensors on one engine thread per device, where ranks waiting for each other would deadlock.
            try:
                ring = _ThreadRing(r, world, slots, cfg["timeout_s"])
                args = (ring, causal, layout, scale, cfg["backend"])
                qr, kr, vr = (t.detach() for t in leaves[r])
                out, lse = _ring_forward(qr, kr, vr, *args)
                grads = _ring_backward(take_shard(do, layout, r, world), qr, kr, vr, out, lse, *args)
                for leaf, grad in zip(leaves[r], grads):
                    leaf.grad = grad
                results[r] = out
            except BaseException as e:  # reported by the caller
                results[r] = e

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
    got = [join_shards(results, layout)] + [join_shards([leaves[r][i].grad for r in range(world)], layout)
                                            for i in range(3)]
    return _errors(got, q, k, v, do, causal)


def measure(world: int, *, tokens: int = 2048, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
            dtype: str = "bfloat16", causal: bool = True, layout: str = "zigzag", device: str = "cpu",
            backend: str = "auto", seed: int = 0, timeout_s: float = 300.0,
            transport: str = "processes") -> Dict[str, tuple]:
    """Errors ``{quantity: (max, rms)}`` of ring attention over ``world`` ranks against float64: processes
    (``ring_attention`` over gloo or NCCL) or threads on one device (the ring's autograd function, in-process
    transfers)."""
    cfg = dict(tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=causal,
               layout=layout, device=device, backend=backend, seed=seed, timeout_s=timeout_s)
    if transport == "threads":
        return _measure_threads(world, cfg)
    with tempfile.TemporaryDirectory() as store:
        spawn_and_wait(_worker, (world, cfg, store), world, timeout_s, "ring drift workers")
        with open(os.path.join(store, "result.pkl"), "rb") as f:
            return pickle.load(f)


def spawn_and_wait(fn, args: tuple, world: int, timeout_s: float, what: str) -> None:
    """``fn(rank, *args)`` in ``world`` processes (``torch.multiprocessing.spawn``); raises if one fails or they run
    past ``timeout_s``, and never leaves one running."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} (world {world}) did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def table(worlds: Sequence[int], **kw) -> List[str]:
    """Markdown rows: per P, max and RMS error of each quantity and its ratio to the first world's."""
    head = "| P | " + " | ".join(f"{q} max | {q} rms" for q in QUANTITIES) + " | worst rms ratio to P=first |"
    lines = [head, "|" + "---|" * (2 + 2 * len(QUANTITIES))]
    base = None
    for p in worlds:
        res = measure(p, **kw)
        base = base or res
        worst = max(res[q][1] / base[q][1] for q in QUANTITIES)
        cells = " | ".join(f"{res[q][0]:.2e} | {res[q][1]:.2e}" for q in QUANTITIES)
        lines.append(f"| {p} | {cells} | {worst:.2f} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--transport", choices=("processes", "threads"), default="processes")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    ap.add_argument("--seeds", type=int, default=1, help="repeat with seeds 0..n-1")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    worlds = [int(x) for x in a.worlds.split(",")]
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    out = [f"ring drift: {dev} ({a.transport}, backend {a.backend}), {a.dtype}, N={a.tokens}, Hq={a.heads}, "
           f"Hk={a.kv_heads}, D={a.head_dim}, torch {torch.__version__}"]
    for causal, layout in ((True, "zigzag"), (False, "zigzag"), (True, "contiguous")):
        for seed in range(a.seeds):
            out += ["", f"causal={causal}, layout={layout}, seed={seed}"]
            print(out[-1], flush=True)
            out += table(worlds, tokens=a.tokens, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                         dtype=a.dtype, causal=causal, layout=layout, device=a.device, seed=seed,
                         backend=a.backend, transport=a.transport)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
