"""Sweep tile settings of the block-list (block-sparse) path of the kernels and print the fastest per pass.

    python scripts/tune_block_sparse.py [--dims 64 128] [--n 32768] [--density 0.1]

Tiles must divide the mask's blocks (128 here). The list path loads each key block's index from memory, so the
loads of K and V are indirect: Triton pipelines them only with enough stages, which is why this sweep looks at
deeper pipelines than the range path's table. Winners go into ``_HOPPER_LIST`` of longattn/kernels/configs.py.
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
from longattn.kernels.configs import Tiles, tiles_for  # noqa: E402

FWD = [Tiles(128, 64, 4, 3), Tiles(128, 64, 4, 4), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4), Tiles(128, 128, 8, 3),
       Tiles(128, 128, 8, 2), Tiles(64, 64, 4, 4), Tiles(64, 128, 4, 3), Tiles(128, 32, 4, 4), Tiles(64, 64, 4, 3)]
DKDV = [Tiles(32, 128, 4, 3), Tiles(32, 128, 4, 4), Tiles(64, 128, 8, 3), Tiles(64, 128, 4, 3), Tiles(64, 64, 4, 4),
        Tiles(32, 64, 4, 4), Tiles(64, 128, 8, 2), Tiles(32, 64, 4, 3)]
DQ = [Tiles(128, 64, 8, 3), Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 4), Tiles(128, 32, 4, 4), Tiles(64, 64, 4, 4),
      Tiles(128, 128, 8, 2), Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 4)]


def _fits(t: Tiles, d: int) -> bool:
    """Skip settings whose K/V (or Q/dO) stages clearly overflow shared memory at this head dim."""
    return d <= 64 or t.block_n * t.num_stages <= 384 and t.block_m * t.num_stages <= 384


def sweep(d: int, n: int, density: float, heads: int = 16, block: int = 128, passes=("fwd", "dkdv", "dq"),
          rounds: int = 2):
    q, k, v, do = (torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    pattern = (P.Random(density, seed=0) | P.Local(0)).build(n, block_size=block, heads=1, device="cuda")
    real = pattern.density
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return longattn.block_sparse_attention(q, k, v, block_mask=pattern, backend="triton")

    def bwd_of(out):
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    res = {}
    out = longattn.block_sparse_attention(q, k, v, block_mask=pattern, backend="triton")
    bwd = bwd_of(out)
    for pass_name, cands in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        if pass_name in passes:
            res[pass_name] = sweep_tiles(fwd, bwd, pass_name, [t for t in cands if _fits(t, d)], rounds)
    for pass_name, rows in res.items():
        print(f"D={d} N={n} density={real:.3f} {pass_name} (table {tiles_for(pass_name, d, q.device, listed=True)}): "
              f"{format_best(rows)}", flush=True)
    del q, k, v, do, out
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--density", type=float, nargs="+", default=[0.1])
    p.add_argument("--passes", nargs="+", default=["fwd", "dkdv", "dq"])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for d in a.dims:
        for dens in a.density:
            sweep(d, a.n, dens, passes=a.passes, rounds=a.rounds)


if __name__ == "__main__":
    main()
