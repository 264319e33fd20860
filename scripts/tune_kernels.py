"""Sweep tile settings of the flash kernels on the GPU at hand and print the fastest per (pass, head dim, causal).

    python scripts/tune_kernels.py [--dims 64 128] [--n 8192]

The winners go into the table of longattn/kernels/configs.py by hand (with the device named in the commit).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
import longattn.ops  # noqa: E402
from benchmarks.common import attn_flops, bench_ms  # noqa: E402
from longattn.kernels.configs import Tiles, override_tiles, tiles_for  # noqa: E402

FWD = [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 4), Tiles(128, 64, 4, 2),
       Tiles(128, 128, 4, 3), Tiles(64, 64, 4, 3), Tiles(64, 128, 4, 3), Tiles(128, 32, 4, 3), Tiles(128, 64, 8, 4),
       Tiles(256, 64, 8, 3), Tiles(256, 128, 8, 2), Tiles(64, 64, 4, 4)]
DKDV = [Tiles(64, 128, 8, 3), Tiles(64, 128, 4, 3), Tiles(32, 128, 4, 3), Tiles(64, 64, 4, 3),
        Tiles(128, 128, 8, 2), Tiles(64, 128, 8, 2), Tiles(32, 64, 4, 3), Tiles(128, 64, 8, 3)]
DQ = [Tiles(128, 64, 8, 3), Tiles(128, 64, 4, 3), Tiles(128, 32, 4, 3), Tiles(64, 64, 4, 3),
      Tiles(128, 128, 8, 2), Tiles(64, 128, 4, 3), Tiles(128, 64, 8, 2)]


def sweep(d, causal, n, total=16384, hd=2048, passes=("fwd", "dkdv", "dq")):
    b, h = max(total // n, 1), hd // d
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    results = {}

    def fwd():
        return longattn.flash_attention(q, k, v, causal=causal, backend="triton")

    for t in FWD if "fwd" in passes else []:
        if d > 128 and t.block_n > 64:
            continue
        try:
            with override_tiles(fwd=t):
                ms = bench_ms(fwd)
            results.setdefault("fwd", []).append((attn_flops(b, h, n, n, d, causal, "fwd") / ms / 1e9, t))
        except Exception as e:
            print(f"  fwd {t}: {type(e).__name__} {str(e)[:80]}")
    o, lse = longattn.ops.attention_forward(q, k, v, causal=causal, backend="triton")
    for pass_name, cands in (("dkdv", DKDV), ("dq", DQ)):
        if pass_name not in passes:
            continue
        for t in cands:
            if d > 128 and t.block_m * t.block_n > 64 * 64:
                continue
            try:
                with override_tiles(**{pass_name: t}):
                    ms = bench_ms(lambda: longattn.ops.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                         backend="triton"))
                results.setdefault(pass_name, []).append((attn_flops(b, h, n, n, d, causal, "bwd") / ms / 1e9, t))
            except Exception as e:
                print(f"  {pass_name} {t}: {type(e).__name__} {str(e)[:80]}")
    for pass_name, res in results.items():
        res.sort(key=lambda x: -x[0])
        cur = tiles_for(pass_name, d, q.device)
        print(f"D={d} causal={causal} N={n} {pass_name}: current {cur}; best " +
              "; ".join(f"{tf:.0f} {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}" for tf, t in res[:4]),
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--passes", nargs="+", default=["fwd", "dkdv", "dq"])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for d in a.dims:
        for c in a.causal:
            sweep(d, bool(c), a.n, passes=a.passes)


if __name__ == "__main__":
    main()
