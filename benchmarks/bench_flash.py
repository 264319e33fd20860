"""Issue-3 benchmark: longattn's flash kernels against SDPA (flash, cuDNN, efficient) and compiled FlexAttention.

bf16, head dims 64 and 128, causal and not, N = 1k, 4k, 16k with batch*N = 16k and heads*D = 2048; forward and
forward+backward TFLOP/s (FlashAttention's count), all peers measured in the same run. Then the peak memory of
forward+backward at B=1, N=64k, H=16, D=128 against the bytes of q, k, v, o, dO, dq, dk, dv and lse.

    python benchmarks/bench_flash.py [--quick] [--out docs/bench_flash.md]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (attn_flops, env_header, flex_causal_mask, flex_fn, make_step, sdpa_fn,  # noqa: E402
                               time_interleaved)

import longattn  # noqa: E402

PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")


def longattn_fn(q, k, v, causal=False):
    return longattn.flash_attention(q, k, v, causal=causal, backend="triton")


def make_impl(name, n, causal):
    if name == "longattn":
        return functools.partial(longattn_fn, causal=causal)
    if name == "flex":
        return functools.partial(flex_fn(flex_causal_mask(n, n) if causal else None), causal=causal)
    return functools.partial(sdpa_fn(name.split("_", 1)[1]), causal=causal)


def speed_table(quick: bool, rounds: int = 3):
    rows = []
    dims = (64, 128)
    lengths = (1024, 4096, 16384) if not quick else (4096,)
    for d in dims:
        for causal in (False, True):
            for n in lengths:
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                row = {"D": d, "causal": causal, "N": n}
                impls = {name: make_impl(name, n, causal) for name in ("longattn",) + PEERS}
                for mode in ("fwd", "fwd_bwd"):
                    # all implementations take turns in each of `rounds` rounds (see time_interleaved)
                    ms = time_interleaved({name: make_step(fn, q, k, v, mode) for name, fn in impls.items()},
                                          rounds=rounds)
                    for name in impls:
                        row[(name, mode)] = attn_flops(b, h, n, n, d, causal, mode) / ms[name] / 1e9
                rows.append(row)
                print(" ".join(f"{key}={val:.0f}" if isinstance(val, float) else f"{key}={val}"
                               for key, val in row.items() if not isinstance(key, tuple)) + " | " +
                      " ".join(f"{nm}:{md}={row[(nm, md)]:.0f}" for nm in ("longattn",) + PEERS
                               for md in ("fwd", "fwd_bwd")), flush=True)
                del q, k, v
    return rows


def memory_check(n=65536, h=16, d=128):
    torch.cuda.empty_cache()
    q, k, v, do = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = longattn.flash_attention(q, k, v, backend="triton")
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    tensor = q.numel() * q.element_size()
    # Beyond q, k, v, dO (allocated before): o, dq, dk, dv and the float32 log-sum-exp.
    need = 4 * tensor + h * n * 4
    return peak, need, 8 * tensor + h * n * 4


def format_table(rows):
    head = ("| D | causal | N | longattn fwd | fwd+bwd | vs flash fwd | fwd+bwd | vs cuDNN fwd | fwd+bwd "
            "| vs efficient fwd | fwd+bwd | vs Flex fwd | fwd+bwd | SDPA flash fwd | fwd+bwd | cuDNN fwd | fwd+bwd "
            "| Flex fwd | fwd+bwd |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        la = [r[("longattn", m)] for m in ("fwd", "fwd_bwd")]
        ratios = []
        for peer in PEERS:
            ratios += [la[i] / r[(peer, m)] for i, m in enumerate(("fwd", "fwd_bwd"))]
        abs_vals = [r[(p, m)] for p in ("sdpa_flash", "sdpa_cudnn", "flex") for m in ("fwd", "fwd_bwd")]
        cells = ([str(r["D"]), "yes" if r["causal"] else "no", f"{r['N'] // 1024}k", f"{la[0]:.0f}", f"{la[1]:.0f}"]
                 + [f"{x:.2f}x" for x in ratios] + [f"{x:.0f}" for x in abs_vals])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row (median reported)")
    args = p.parse_args()
    header = env_header()
    print(header, flush=True)
    rows = speed_table(args.quick, args.rounds)
    text = (f"Measured on {header}; bf16; TFLOP/s (median over {args.rounds} interleaved rounds of do_bench "
            "medians).\n\n") + format_table(rows)
    if not args.skip_memory:
        peak, need, total = memory_check()
        text += (f"\n\nPeak memory of forward+backward at B=1, N=64k, H=16, D=128 beyond q, k, v, dO: "
                 f"{peak / 2**20:.1f} MiB; o, dq, dk, dv and lse need {need / 2**20:.1f} MiB "
                 f"(ratio {peak / need:.3f}); whole set incl. q, k, v, dO {total / 2**20:.0f} MiB, "
                 f"excess {100 * (peak - need) / total:.2f}% of it.")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
