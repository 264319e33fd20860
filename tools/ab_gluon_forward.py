"""Check and time the unrouted ping-pong Gluon forward (longattn/backends/gluon/fwd_pingpong.py) on one Hopper GPU:

    python tools/ab_gluon_forward.py [--rounds 5] [--quick] [--variants pp,pp_mbar]

1. correctness: each variant (``pp_mbar``: the routed kernel's mbarrier turns; ``pp``: ``HW_SYNC``, named-barrier
   turns and per-warp releases, on Triton 3.6 Gluon's one-thread releases; ``pp_keep``, Triton 3.9 only: ``KEEP``,
   the probabilities kept in their own registers until their product is waited for; ``pp_thr``: ``pp``'s turns, one
   release per thread) against the float64 reference (``longattn.reference.flash_attention``) and against the
   routed kernel (fwd.py, through ``gluon.launch.forward``) on awkward shapes: lengths off the tiles, more keys than
   queries, grouped-query heads, a window, a batch of 3, D = 64 and 128, bf16 and fp16, one variant after the other
   (``pp_thr``, not yet run on a GPU, last: should it hang, rerun with ``--variants`` without it);
2. time: the flash table (bf16, B * N = 16k, H * D = 2048; D = 64/128, causal or not, N = 1k/4k/16k), each variant
   against the routed kernel, SDPA's default and FlashAttention-4 (``flash_attn.cute``) when it imports, taking turns
   in every round (``longattn.bench.interleaved``). Prints ms and the ratio routed / variant (> 1: the variant is
   faster). Nothing here changes what longattn routes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from longattn.backends.gluon import fwd_pingpong, launch  # noqa: E402
from longattn.backends.gluon.tma import box_strides  # noqa: E402
from longattn.backends.kernel_args import ensure_allocator  # noqa: E402
from longattn.backends.triton.launch import BandArgs  # noqa: E402
from longattn.call import Band  # noqa: E402
from longattn.reference import flash_attention as reference  # noqa: E402

VARIANTS = {"pp_mbar": dict(HW_SYNC=False, KEEP=False), "pp": dict(HW_SYNC=True, KEEP=False),
            "pp_keep": dict(HW_SYNC=True, KEEP=True), "pp_thr": dict(HW_SYNC=True, KEEP=False, THREAD_ARRIVE=True)}
if not fwd_pingpong.HAS_INLINE_ASM:
    # Triton 3.6: the kept probabilities need gl.inline_asm (3.9); the named-barrier turns have an elementwise form,
    # the per-warp releases none (pp releases as fwd.py does there, pp_thr per thread on either Triton)
    del VARIANTS["pp_keep"]


def run_pingpong(q, k, v, causal=False, window=(-1, -1), **variant):
    """The ping-pong kernel's ``(out, lse)`` for q ``(B, N, H, D)``, k/v ``(B, M, Hk, D)``, launched as
    ``gluon.launch.forward`` launches the routed one (same tiles, grid and counter)."""
    B, N, H, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    band = BandArgs.of(Band.of(causal, window))
    t = launch.TILES[D]
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    ensure_allocator()
    n_tiles = -(-N // (t.consumers * t.sub_m)) * B * H
    grid = (max(1, min(n_tiles, torch.cuda.get_device_properties(q.device).multi_processor_count)),)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    fwd_pingpong.flash_fwd_pingpong[grid](
        q, k, v, o, lse, counter, *box_strides(q), *box_strides(k), *box_strides(v), N, M, B, H, H // Hk,
        D ** -0.5, band.left, band.right, HEAD_D=D, SUB_M=t.sub_m, BLOCK_N=t.block_n, STAGES=t.stages,
        HAS_LEFT=band.has_left, HAS_RIGHT=band.has_right, CONSUMER_REGS=t.consumer_regs, N_CONS=t.consumers,
        num_warps=4, **variant)
    return o, lse


def run_routed(q, k, v, causal=False, window=(-1, -1)):
    """fwd.py's kernel on the same call (``gluon.launch.forward``, tiles of ``launch.TILES``)."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    launch.forward(q, k, v, o, lse, None, BandArgs.of(Band.of(causal, window)), q.shape[-1] ** -0.5,
                   tiles=launch.TILES[q.shape[-1]])
    return o, lse


def check() -> bool:
    ok = True
    cases = [((1, 1000, 4, 128), 1000, 4, True, (-1, -1)), ((3, 333, 8, 128), 517, 2, False, (-1, -1)),
             ((2, 700, 4, 128), 900, 4, True, (-1, -1)), ((1, 1500, 4, 128), 1500, 1, False, (200, 0)),
             ((2, 640, 6, 64), 640, 2, True, (-1, -1)), ((1, 1025, 3, 64), 2047, 3, False, (-1, -1)),
             ((1, 129, 2, 64), 129, 2, False, (64, 64))]
    calls = []  # inputs, the float64 reference and the routed kernel's output of every case, then each variant on all
    for dtype in (torch.bfloat16, torch.float16):
        for (B, N, H, D), M, Hk, causal, window in cases:
            g = torch.Generator(device="cuda").manual_seed(N * 7 + M)
            q = torch.randn(B, N, H, D, device="cuda", dtype=dtype, generator=g)
            k, v = (torch.randn(B, M, Hk, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
            ref, ref_lse = reference(q.double(), k.double(), v.double(), causal=causal, window=window,
                                     return_lse=True)
            calls.append((dtype, (B, N, H, D), M, Hk, causal, window, q, k, v, ref, ref_lse,
                          run_routed(q, k, v, causal, window)))
    for name, variant in VARIANTS.items():
        for dtype, (B, N, H, D), M, Hk, causal, window, q, k, v, ref, ref_lse, (o0, lse0) in calls:
            o, lse = run_pingpong(q, k, v, causal, window, **variant)
            torch.cuda.synchronize()
            err = (o.double() - ref).abs().max().item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
            same = torch.equal(o, o0) and torch.equal(lse, lse0)
            good = err < (2e-2 if dtype == torch.bfloat16 else 4e-3) and lse_err < 1e-3 and \
                torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float()))
            ok &= good
            print(f"{name:8} {str(dtype)[6:]:8} q{(B, N, H, D)} k{(M, Hk)} causal={causal} window={window}: "
                  f"max|out-ref| {err:.2e} max|lse-ref| {lse_err:.2e} identical-to-routed={same} "
                  f"{'ok' if good else 'FAIL'}", flush=True)
    return ok


def fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 - not installed here
        print(f"FlashAttention-4 not timed: {type(e).__name__}: {str(e)[:100]}")
        return None
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)


def bench(rounds: int, quick: bool) -> None:
    from longattn.bench.interleaved import time_interleaved
    fa = fa4()
    print("\n| D | causal | N | routed ms | " + " | ".join(f"{n} ms" for n in VARIANTS) +
          " | SDPA ms | FA4 ms | " + " | ".join(f"routed/{n}" for n in VARIANTS) + " | routed/FA4 |")
    print("|" + "---|" * (6 + 2 * len(VARIANTS) + 1))
    for d in (64, 128):
        for causal in (False, True):
            for n in ((1024, 16384) if quick else (1024, 4096, 16384)):
                q, k, v = (torch.randn(16384 // n, n, 2048 // d, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                steps = {"routed": lambda: run_routed(q, k, v, causal)}
                for name, variant in VARIANTS.items():
                    steps[name] = lambda variant=variant: run_pingpong(q, k, v, causal, **variant)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                steps["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                if fa is not None:
                    steps["fa4"] = lambda: fa(q, k, v, causal)
                ms = time_interleaved(steps, rounds=rounds)
                r = ms["routed"]
                print(f"| {d} | {causal} | {n} | {r:.3f} | " + " | ".join(f"{ms[x]:.3f}" for x in VARIANTS) +
                      f" | {ms['sdpa']:.3f} | {ms.get('fa4', float('nan')):.3f} | " +
                      " | ".join(f"{r / ms[x]:.3f}" for x in VARIANTS) +
                      f" | {r / ms.get('fa4', float('nan')):.3f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="N = 1k and 16k only")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (all by default)")
    a = p.parse_args()
    chosen = [x for x in a.variants.split(",") if x]
    unknown = [x for x in chosen if x not in VARIANTS]
    if unknown:
        p.error(f"unknown or not built on this Triton: {unknown} (have {list(VARIANTS)})")
    for x in list(VARIANTS):
        if x not in chosen:
            del VARIANTS[x]
    print(torch.cuda.get_device_name(), "triton", __import__("triton").__version__, flush=True)
    if not a.no_check and not check():
        print("correctness FAILED: a variant that fails is still timed below, but do not read its times")
    bench(a.rounds, a.quick)


if __name__ == "__main__":
    main()
