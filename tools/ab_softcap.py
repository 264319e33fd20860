"""Check and time the Gluon forward's soft-capping by ``tanh.approx`` (``GluonTiles.fast_tanh``, not routed) against
the routed form (an exponential and a division a score) on one Hopper GPU:

    python tools/ab_softcap.py [--rounds 5]

1. correctness: both forms against the float64 reference (``longattn.reference.flash_attention``) on awkward shapes
   (N != M both ways, causal and not, grouped-query heads, D = 64, 128 and 256, caps from 1 to 50, bf16 and fp16):
   the output's and the log-sum-exp's largest errors, and whether rows without keys agree;
2. time: D = 128 and 64, N = 8k (B·N = 32k, H·D = 2048), causal or not, cap 50: the plain call, the routed form and
   ``tanh.approx`` taking turns (``longattn.bench.interleaved``). The issue's bar: soft-capping <= 1.2x the plain
   call. Nothing here changes what longattn routes (``launch.TILES`` is read, not written).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from longattn.backends.gluon import launch  # noqa: E402
from longattn.backends.triton.launch import BandArgs  # noqa: E402
from longattn.bench.interleaved import env_header, time_interleaved  # noqa: E402
from longattn.call import Band  # noqa: E402
from longattn.reference import flash_attention as reference  # noqa: E402

CASES = [(2, 1000, 1000, 4, 4, 128, True, 50.0, torch.bfloat16), (1, 777, 1300, 4, 2, 128, False, 30.0, torch.bfloat16),
         (2, 1500, 900, 2, 1, 128, True, 5.0, torch.float16), (1, 4096, 4096, 2, 2, 64, True, 50.0, torch.bfloat16),
         (1, 900, 1100, 2, 2, 256, True, 20.0, torch.bfloat16), (1, 2048, 2048, 4, 4, 128, False, 1.0, torch.float16)]


def run(q, k, v, causal: bool, cap: float, fast: bool):
    """The Gluon forward's ``(out, lse)`` with the routed tiles, ``fast_tanh`` set as asked."""
    tiles = dataclasses.replace(launch.TILES[q.shape[-1]], fast_tanh=fast)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    launch.forward(q, k, v, o, lse, None, BandArgs.of(Band.of(causal, (-1, -1))), q.shape[-1] ** -0.5,
                   softcap=cap, tiles=tiles)
    return o, lse


def check() -> bool:
    ok = True
    for (B, N, M, H, Hk, D, causal, cap, dt) in CASES:
        g = torch.Generator(device="cuda").manual_seed(N * 7 + M)
        q = torch.randn(B, N, H, D, device="cuda", dtype=dt, generator=g) * 3
        k = torch.randn(B, M, Hk, D, device="cuda", dtype=dt, generator=g) * 3
        v = torch.randn(B, M, Hk, D, device="cuda", dtype=dt, generator=g)
        ro, rl = reference(q.double(), k.double(), v.double(), causal=causal, softcap=cap, return_lse=True)
        seen = torch.isfinite(rl)
        errs = []
        for fast in (False, True):
            o, lse = run(q, k, v, causal, cap, fast)
            errs.append(((o.double() - ro).abs().max().item(), (lse.double() - rl)[seen].abs().max().item(),
                         bool(torch.equal(torch.isneginf(lse), torch.isneginf(rl)))))
        good = errs[1][0] <= max(1.25 * errs[0][0], 2e-3) and errs[1][1] < 2e-3 and errs[1][2]
        ok &= good
        print(f"{(B, N, M, H, Hk, D, causal, cap, str(dt)[6:])}: routed out {errs[0][0]:.2e} lse {errs[0][1]:.2e}; "
              f"tanh.approx out {errs[1][0]:.2e} lse {errs[1][1]:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def bench(rounds: int) -> None:
    print("\n| D | causal | N | plain ms | routed cap ms | tanh.approx cap ms | routed / plain | tanh / plain | "
          "routed / tanh |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    n = 8192
    for d in (128, 64):
        for causal in (True, False):
            q, k, v = (torch.randn(32768 // n, n, 2048 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            ms = time_interleaved({"plain": lambda: run(q, k, v, causal, 0.0, False),
                                   "routed": lambda: run(q, k, v, causal, 50.0, False),
                                   "tanh": lambda: run(q, k, v, causal, 50.0, True)}, rounds=rounds)
            print(f"| {d} | {causal} | {n} | {ms['plain']:.3f} | {ms['routed']:.3f} | {ms['tanh']:.3f} | "
                  f"{ms['routed'] / ms['plain']:.3f} | {ms['tanh'] / ms['plain']:.3f} | {ms['routed'] / ms['tanh']:.3f} |",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    print(env_header(), flush=True)
    if launch.kernel_module() is None:
        raise SystemExit("the Gluon forward does not run here")
    if not check():
        print("correctness FAILED: the times below are not to be read")
    bench(a.rounds)


if __name__ == "__main__":
    main()
