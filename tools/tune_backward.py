"""Sweep the tile settings of each pass on whole workloads: dense and causal flash attention at 1k/4k/16k
(batch*N = 16k, heads*D = 2048), dilated attention at 128k, block-sparse attention at 32k and 128k, the varlen
benchmark's packed batch (``varlen64k``, ``varlen64k_causal``).

    python tools/tune_backward.py [--workloads causal1k_d64 dilated128k ...] [--passes fwd dkdv dq] [--isolate]

Per workload and pass: the time of the forward (no grad) or of the backward (autograd of a fixed output) with the
table's setting and with each candidate forced for that pass (the other passes keep the table's), all taking turns
in interleaved rounds. Prints the table's time and the four fastest.
Winners go into longattn/backends/triton/tiles.py by hand. Differences under ~5% are within run-to-run spread.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn.bench.interleaved import format_best, sweep_tiles  # noqa: E402
from longattn import patterns as P  # noqa: E402
from longattn.backends.triton.tiles import Tiles, override_tiles  # noqa: E402

FWD = [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 4), Tiles(128, 64, 4, 2),
       Tiles(64, 64, 4, 3), Tiles(64, 128, 4, 3), Tiles(128, 32, 4, 3), Tiles(64, 32, 4, 3), Tiles(64, 64, 4, 2),
       Tiles(256, 64, 8, 2), Tiles(256, 64, 8, 3), Tiles(256, 128, 8, 2), Tiles(256, 32, 8, 3), Tiles(256, 64, 16, 2),
       Tiles(128, 128, 4, 2)]
DKDV = [Tiles(32, 128, 4, 3), Tiles(64, 128, 8, 3), Tiles(64, 128, 4, 3), Tiles(64, 64, 4, 3), Tiles(32, 64, 4, 3),
        Tiles(64, 128, 8, 2), Tiles(128, 128, 8, 2), Tiles(32, 128, 4, 2), Tiles(16, 64, 4, 3), Tiles(64, 64, 4, 2),
        Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 3), Tiles(128, 64, 4, 2), Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 2),
        Tiles(128, 64, 8, 3), Tiles(64, 64, 8, 3), Tiles(32, 128, 8, 3), Tiles(32, 128, 4, 4), Tiles(64, 128, 4, 2),
        Tiles(16, 128, 4, 3), Tiles(128, 64, 4, 1), Tiles(128, 32, 4, 2), Tiles(128, 32, 4, 3), Tiles(256, 64, 8, 2),
        Tiles(128, 64, 8, 1), Tiles(256, 32, 8, 2)]
DQ = [Tiles(128, 64, 8, 3), Tiles(128, 64, 4, 3), Tiles(128, 32, 4, 3), Tiles(64, 64, 4, 3), Tiles(128, 128, 8, 2),
      Tiles(64, 32, 4, 3), Tiles(64, 128, 4, 3), Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 3)]


def _qkv(b, n, h, d, hk=None):
    return [torch.randn(b, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for heads in (h, hk or h, hk or h)]


def _varlen(causal: bool, device: str):
    """The varlen benchmark's packed batch (64k tokens, long-tailed documents) as a workload on (1, N, H, D)."""
    from longattn.bench.varlen_suite import document_lengths
    from longattn.utils import cu_seqlens_of

    lens = document_lengths(65536)
    cu = cu_seqlens_of(lens, device)

    def fn(q, k, v):
        return longattn.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                               max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                               backend="triton")[None]

    return fn


def workloads(device="cuda"):
    """name -> (head dim, attention call on (q, k, v), (batch, seq, heads)); block masks built on ``device``."""
    segs, rates = (2048, 4096, 8192, 16384), (1, 2, 4, 8)
    w = {
        **{f"{'causal' if c else 'dense'}{n // 1024}k_d{d}": (
            d, lambda q, k, v, c=c: longattn.flash_attention(q, k, v, causal=c, backend="triton"),
            (16384 // n, n, 2048 // d))
           for d in (64, 128) for c in (False, True) for n in (1024, 4096, 16384)},
        **{f"dilated{n // 1024}k": (64, lambda q, k, v: longattn.dilated_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, backend="triton"), (1, n, 16))
           for n in (32768, 131072, 1 << 20)},
        # LongNet as a language model (causal), and at D = 128 (half the heads, the same FLOPs)
        "dilated128k_causal": (64, lambda q, k, v: longattn.dilated_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, causal=True, backend="triton"), (1, 131072, 16)),
        "dilated128k_d128": (128, lambda q, k, v: longattn.dilated_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, backend="triton"), (1, 131072, 8)),
        # the varlen benchmark's batch: Hq = 16, Hk = 4
        **{f"varlen64k{'_causal' if c else ''}": (128, _varlen(c, device), (1, 65536, 16, 4)) for c in (False, True)},
    }
    for n, d, dens in ((32768, 128, 0.5), (32768, 64, 0.1), (32768, 128, 0.1), (131072, 64, 0.5),
                       (131072, 64, 0.1)):
        pattern = (P.Random(dens, seed=0) | P.Local(0)).build(n, block_size=128, heads=1, device=device)
        w[f"sparse{n // 1024}k_d{d}_{int(dens * 100)}"] = (
            d, lambda q, k, v, pattern=pattern: longattn.block_sparse_attention(q, k, v, block_mask=pattern,
                                                                                backend="triton"),
            (1, n, 16))
    return w


def _steps(d, fn, shape):
    """The forward (no grad) and backward (autograd of a fixed output) of a workload, on fresh inputs."""
    q, k, v = _qkv(*shape[:3], d, *shape[3:])
    do = torch.randn_like(q)
    out = fn(q, k, v)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    def fwd():
        with torch.no_grad():
            return fn(q, k, v)

    return fwd, bwd


def _tiles_arg(t: Tiles) -> str:
    return f"{t.block_m},{t.block_n},{t.num_warps},{t.num_stages}"


def _survivors(name, pass_name, cands):
    """The candidates that run ``pass_name`` of workload ``name`` without error, each tried once in a process of its
    own: a CUDA error (a misaligned address, say) ends the process that hits it, and with it an in-process sweep."""
    ok = []
    for t in cands:
        cmd = [sys.executable, os.path.abspath(__file__), "--check", _tiles_arg(t), "--workloads", name,
               "--passes", pass_name]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode == 0:
            ok.append(t)
        else:
            last = (res.stderr.strip().splitlines() or ["(no message)"])[-1]
            print(f"{name} {pass_name}: {_tiles_arg(t)} failed on its own, left out: {last[:200]}", flush=True)
    return ok


def check(d, fn, shape, pass_name, tiles):
    """Child of :func:`_survivors`: run the pass once with ``tiles`` forced and wait for the GPU."""
    fwd, bwd = _steps(d, fn, shape)
    with override_tiles(**{pass_name: tiles}):
        (fwd if pass_name == "fwd" else bwd)()
    torch.cuda.synchronize()


def run(name, d, fn, shape, passes, rounds=2, isolate=False):
    fwd, bwd = _steps(d, fn, shape)
    for pass_name, cands in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        if pass_name not in passes:
            continue
        fits = [t for t in cands if d <= 64 or t.block_m * t.block_n * t.num_stages <= 128 * 128 * 3]
        if isolate:
            fits = _survivors(name, pass_name, fits)
        print(f"{name} {pass_name}: {format_best(sweep_tiles(fwd, bwd, pass_name, fits, rounds))}", flush=True)
    del fwd, bwd
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=None)
    p.add_argument("--passes", nargs="+", default=["fwd", "dkdv", "dq"])
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per candidate")
    p.add_argument("--isolate", action="store_true",
                   help="first try every candidate in a process of its own and leave out those that fail")
    p.add_argument("--check", default=None, help=argparse.SUPPRESS)  # M,N,W,S: the child of --isolate
    a = p.parse_args()
    import triton

    if a.check:
        (name,), (pass_name,) = a.workloads, a.passes
        d, fn, shape = workloads()[name]
        return check(d, fn, shape, pass_name, Tiles(*map(int, a.check.split(","))))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for name, (d, fn, shape) in workloads().items():
        if a.workloads is None or name in a.workloads:
            run(name, d, fn, shape, a.passes, a.rounds, a.isolate)


if __name__ == "__main__":
    main()
