"""Sweep the tile settings of each pass on whole workloads: dense and causal flash attention at 1k/4k/16k
(batch*N = 16k, heads*D = 2048), dilated attention at 128k, block-sparse attention at 32k and 128k.

    python scripts/tune_backward.py [--workloads causal1k_d64 dilated128k ...] [--passes fwd dkdv dq]

Per workload and pass: the time of the forward (no grad) or of the backward (autograd of a fixed output) with the
table's setting and with each candidate forced for that pass (the other passes keep the table's), all taking turns
in interleaved rounds. Prints the table's time and the four fastest.
Winners go into longattn/kernels/configs.py by hand. Differences under ~5% are within run-to-run spread.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from benchmarks.common import format_best, sweep_tiles  # noqa: E402
from longattn import patterns as P  # noqa: E402
from longattn.kernels.configs import Tiles  # noqa: E402

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


def _qkv(b, n, h, d):
    return [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


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
    }
    for n, d, dens in ((32768, 128, 0.5), (32768, 64, 0.1), (32768, 128, 0.1), (131072, 64, 0.5),
                       (131072, 64, 0.1)):
        pattern = (P.Random(dens, seed=0) | P.Local(0)).build(n, block_size=128, heads=1, device=device)
        w[f"sparse{n // 1024}k_d{d}_{int(dens * 100)}"] = (
            d, lambda q, k, v, pattern=pattern: longattn.block_sparse_attention(q, k, v, block_mask=pattern,
                                                                                backend="triton"),
            (1, n, 16))
    return w


def run(name, d, fn, shape, passes, rounds=2):
    b, n, h = shape
    q, k, v = _qkv(b, n, h, d)
    do = torch.randn_like(q)
    out = fn(q, k, v)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    def fwd():
        with torch.no_grad():
            return fn(q, k, v)

    for pass_name, cands in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        if pass_name not in passes:
            continue
        fits = [t for t in cands if d <= 64 or t.block_m * t.block_n * t.num_stages <= 128 * 128 * 3]
        print(f"{name} {pass_name}: {format_best(sweep_tiles(fwd, bwd, pass_name, fits, rounds))}", flush=True)
    del q, k, v, do, out
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=None)
    p.add_argument("--passes", nargs="+", default=["fwd", "dkdv", "dq"])
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per candidate")
    a = p.parse_args()
    import triton

    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for name, (d, fn, shape) in workloads().items():
        if a.workloads is None or name in a.workloads:
            run(name, d, fn, shape, a.passes, a.rounds)


if __name__ == "__main__":
    main()
