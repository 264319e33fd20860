"""The fused Hopper backward (``backends/gluon/bwd_fused.py``, routed at D = 128) with its TMA descriptors made by
every program on the device (as routed) or once on the host (``fused_backward(..., host_descriptors=True)``), on one
Hopper GPU:

    python tools/ab_bwd_descriptors.py [--rounds 5] [--head-dims 128 64]

1. correctness: both against a float64 reference (``tools/check_bwd_wide_tile.py``'s) on awkward dense shapes (N !=
   M both ways, causal and not, grouped-query heads, lengths off the tiles, ``deterministic``), dK and dV
   bitwise equal between the two (the same sums in the same order);
2. time: the flash table's backward (B * N = 16k, H * D = 2048, N = 1k-16k, causal or not), the two taking turns in
   interleaved rounds (``do_bench`` medians; the host descriptors are encoded at every launch, host time the
   GPU-bound rows hide). Nothing here changes what longattn routes; the measurement goes into docs/kernel_notes.md.
The 128 x 128 D=64 kernel's schedules, host descriptors among them: ``tools/check_bwd_wide_tile.py --schedules``.
"""
import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import triton.testing  # noqa: E402

from check_bwd_wide_tile import err, reference  # noqa: E402
from longattn.backends.gluon import bwd_fused  # noqa: E402

CASES = [  # B, N, M, H, Hk, causal, deterministic
    (2, 300, 300, 4, 4, False, False), (2, 300, 300, 4, 2, True, False), (1, 1000, 777, 2, 1, True, False),
    (2, 200, 333, 4, 2, False, False), (2, 333, 200, 4, 2, True, False), (2, 257, 257, 4, 2, True, True),
    (1, 1, 129, 2, 2, True, False),
]


def check(d: int) -> None:
    for B, N, M, H, Hk, causal, det in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for s, h in ((N, H), (M, Hk), (M, Hk), (N, H)))
        scale = 1 / math.sqrt(d)
        o64, lse, *want = reference(q, k, v, do, scale, causal)
        o, lse = o64.to(torch.bfloat16), lse.float().contiguous()
        got = {host: bwd_fused.fused_backward(do, q, k, v, o, lse, scale, causal, deterministic=det,
                                              host_descriptors=host) for host in (False, True)}
        torch.cuda.synchronize()
        e = {host: [err(x, w) for x, w in zip(g_, want)] for host, g_ in got.items()}
        ok = all(a <= 1.5 * b + 2e-3 for a, b in zip(e[True], e[False]))
        same = torch.equal(got[True][1], got[False][1]) and torch.equal(got[True][2], got[False][2])
        print(f"D={d} B={B} N={N} M={M} H={H}/{Hk} causal={causal} deterministic={det}: device "
              f"{['%.2e' % x for x in e[False]]} host {['%.2e' % x for x in e[True]]} dK,dV bitwise {same} "
              f"{'OK' if ok and same else 'FAIL'}", flush=True)


def time_them(d: int, rounds: int) -> None:
    print("\n| D | N | causal | device descriptors ms | host descriptors ms | device / host |")
    print("|---|---|---|---|---|---|")
    for N in (1024, 2048, 4096, 8192, 16384):
        for causal in (False, True):
            B, H = 16384 // N, 2048 // d
            q, k, v, do, o = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
            lse = torch.randn(B, H, N, device="cuda", dtype=torch.float32) + 8  # timing only
            times = {False: [], True: []}
            for r in range(rounds):
                for host in ((False, True) if r % 2 == 0 else (True, False)):
                    times[host].append(triton.testing.do_bench(lambda: bwd_fused.fused_backward(
                        do, q, k, v, o, lse, 1 / math.sqrt(d), causal, host_descriptors=host)))
            dev, host = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {d} | {N} | {causal} | {dev:.3f} | {host:.3f} | {dev / host:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=[64, 128])
    args = parser.parse_args()
    for d in args.head_dims:
        check(d)
    for d in args.head_dims:
        time_them(d, args.rounds)


if __name__ == "__main__":
    main()
