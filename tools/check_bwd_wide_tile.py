"""Check and time the 128 x 128 backward at D=64 (routed for dense D=64 calls)
(longattn/backends/gluon/bwd_wide_tile.py) on one Hopper GPU:

    python tools/check_bwd_wide_tile.py [--schedules] [--rounds 5]

1. correctness: its dq, dk, dv against a float64 autograd reference on awkward shapes (N != M both ways, causal and
   not, grouped-query heads, lengths off the tiles, one query row, bf16 and fp16), beside the routed fused backward
   (``bwd_fused.fused_backward``) on the same inputs: OK where its error is at most 1.5x the fused one's + 2e-3;
2. time: the flash table's D = 64 backward (B * N = 16k, H * D = 2048, N = 1k/4k/16k, causal or not), wide against
   fused (``do_bench`` medians). Nothing here changes what longattn routes; the measurement goes into
   docs/kernel_notes.md.

``--schedules``: instead of 2, the kernel's schedules against each other (:data:`SCHEDULES`: the routed one, the
same with descriptors made on the device, one program a work item or persistent with host-made descriptors;
``longest_first``, measured slower everywhere, is in tests/gpu only), each also checked in 1, timed in interleaved
rounds (medians) at N = 1k-16k, causal and not.
"""
import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton.testing  # noqa: E402

from longattn.backends.gluon import bwd_fused, bwd_wide_tile as W  # noqa: E402


def reference(q, k, v, do, scale, causal):
    """float64 output, natural-log lse (B, H, N) and gradients; causal bottom-right (key j <= i + M - N)."""
    q64, k64, v64 = (x.double().detach().requires_grad_() for x in (q, k, v))
    B, N, H, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    kk, vv = (x.repeat_interleave(H // Hk, dim=2) for x in (k64, v64))
    s = torch.einsum("bnhd,bmhd->bhnm", q64, kk) * scale
    if causal:
        i = torch.arange(N, device=q.device)[:, None]
        j = torch.arange(M, device=q.device)[None, :]
        s = s.masked_fill(j > i + (M - N), float("-inf"))
    dead = torch.isinf(s).all(dim=-1)  # rows that see no key: P = 0, lse = -inf
    lse = torch.logsumexp(s.masked_fill(dead[..., None], 0.0), dim=-1)
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("bhnm,bmhd->bnhd", p, vv)
    dq, dk, dv = torch.autograd.grad((o * do.double()).sum(), (q64, k64, v64))
    return o.detach(), lse.detach().masked_fill(dead, float("-inf")), dq, dk, dv

def err(x, want):
    assert torch.isfinite(x).all(), "non-finite"
    return ((x.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


CASES = [  # B, N, M, H, Hk, causal, dtype
    (2, 300, 300, 3, 3, False, torch.bfloat16), (2, 300, 300, 3, 3, True, torch.bfloat16),
    (1, 1000, 1000, 2, 2, True, torch.float16), (2, 200, 333, 4, 2, False, torch.bfloat16),
    (2, 333, 200, 4, 2, True, torch.bfloat16), (1, 129, 3, 2, 1, False, torch.bfloat16),
    (1, 1, 129, 2, 2, True, torch.bfloat16), (1, 4096, 4096, 4, 1, True, torch.bfloat16),
]


# name -> bwd_wide_tile.backward's schedule arguments ("routed": what the planner passes by default, the routing's
# wide_bwd_host_descriptors, the launcher's rule for persistence: persistent for non-causal calls)
SCHEDULES = {"routed": dict(host_descriptors=True), "device descriptors": {},
             "grid, host descriptors": dict(persistent=False, host_descriptors=True),
             "persistent, host descriptors": dict(persistent=True, host_descriptors=True)}


def check(schedules: dict) -> None:
    for B, N, M, H, Hk, causal, dtype in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, s, h, 64, device="cuda", dtype=dtype, generator=g)
                       for s, h in ((N, H), (M, Hk), (M, Hk), (N, H)))
        scale = 1 / math.sqrt(64)
        o64, lse, *want = reference(q, k, v, do, scale, causal)
        o, lse = o64.to(dtype), lse.float().contiguous()
        old = bwd_fused.fused_backward(do, q, k, v, o, lse, scale, causal)
        e_old = [err(x, w) for x, w in zip(old, want)]
        routed = None
        for name, kwargs in schedules.items():
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            got = W.backward(q, k, v, o, do, lse, dq, dk, dv, scale, causal, **kwargs)
            torch.cuda.synchronize()
            if routed is None:
                routed = got
            e = [err(x, w) for x, w in zip(got, want)]
            ok = all(a <= 1.5 * b + 2e-3 for a, b in zip(e, e_old))
            same = torch.equal(got[1], routed[1]) and torch.equal(got[2], routed[2])
            print(f"B={B} N={N} M={M} H={H}/{Hk} causal={causal} {dtype} {name}: wide {['%.2e' % x for x in e]} "
                  f"fused {['%.2e' % x for x in e_old]} dK,dV as routed: {same} {'OK' if ok else 'FAIL'}")


def time_schedules(rounds: int, lengths=(1024, 2048, 4096, 8192, 16384)) -> None:
    print("\n| N | causal | " + " | ".join(f"{n} ms" for n in SCHEDULES) + " | routed / best |")
    print("|---|---|" + "---|" * (len(SCHEDULES) + 1))
    for N in lengths:
        for causal in (False, True):
            B, H = 16384 // N, 32
            q, k, v, do, o = (torch.randn(B, N, H, 64, device="cuda", dtype=torch.bfloat16) for _ in range(5))
            lse = torch.randn(B, H, N, device="cuda", dtype=torch.float32) + 8  # timing only
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            times = {name: [] for name in SCHEDULES}
            for r in range(rounds):
                for name in (list(SCHEDULES) if r % 2 == 0 else list(SCHEDULES)[::-1]):
                    kwargs = SCHEDULES[name]
                    times[name].append(triton.testing.do_bench(
                        lambda: W.backward(q, k, v, o, do, lse, dq, dk, dv, 0.125, causal, **kwargs)))
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"| {N} | {causal} | " + " | ".join(f"{med[n]:.3f}" for n in SCHEDULES)
                  + f" | {med['routed'] / min(med.values()):.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", action="store_true", help="time the kernel's schedules against each other")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="--schedules: the sequence lengths timed")
    args = parser.parse_args()
    check(SCHEDULES if args.schedules else {"routed": SCHEDULES["routed"]})
    if args.schedules:
        time_schedules(args.rounds, args.lengths)
        return
    print("timing (ms; B*N = 16k, H*D = 2048, D = 64, bf16):")
    for N in (1024, 4096, 16384):
        for causal in (False, True):
            B, H = 16384 // N, 32
            q, k, v, do, o = (torch.randn(B, N, H, 64, device="cuda", dtype=torch.bfloat16) for _ in range(5))
            lse = torch.randn(B, H, N, device="cuda", dtype=torch.float32) + 8  # timing only
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            t_w = triton.testing.do_bench(lambda: W.backward(q, k, v, o, do, lse, dq, dk, dv, 0.125, causal))
            t_f = triton.testing.do_bench(lambda: bwd_fused.fused_backward(do, q, k, v, o, lse, 0.125, causal))
            print(f"N={N} causal={causal}: wide {t_w:.3f} fused {t_f:.3f} (fused/wide {t_f / t_w:.2f})")


if __name__ == "__main__":
    main()
