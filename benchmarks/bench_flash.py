"""Issue-3 benchmark: longattn's flash kernels against SDPA (flash, cuDNN, efficient) and compiled FlexAttention.

bf16, head dims 64 and 128, causal and not, N = 1k, 4k, 16k with batch*N = 16k and heads*D = 2048; forward and
forward+backward TFLOP/s (FlashAttention's count), all peers measured in the same run. Then the peak memory of
forward+backward at B=1, N=64k, H=16, D=128 against the bytes of q, k, v, o, dO, dq, dk, dv and lse.

    python benchmarks/bench_flash.py [--quick] [--out docs/bench_flash.md]
"""
from __future__ import annotations

import argparse
import functools

import torch

import longattn
from longattn.bench.interleaved import (attn_flops, emit, env_header, flex_causal_mask, flex_fn, make_step, sdpa_fn,
                                        time_interleaved)
from longattn.utils import auto_backend

PEERS = ("sdpa_default", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")
OURS = ("longattn", "auto")  # our kernels forced (backend="triton"), and what backend="auto" runs


def longattn_fn(q, k, v, causal=False, backend="triton"):
    return longattn.flash_attention(q, k, v, causal=causal, backend=backend)


def sdpa_default(q, k, v, causal=False):
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal)
    return o.transpose(1, 2)


def make_impl(name, n, causal):
    if name in OURS:
        return functools.partial(longattn_fn, causal=causal, backend="triton" if name == "longattn" else "auto")
    if name == "sdpa_default":
        return functools.partial(sdpa_default, causal=causal)
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
                row = {"D": d, "causal": causal, "N": n,
                       "auto_ran": [auto_backend(q, k, causal=causal, needs_grad=grad) for grad in (False, True)]}
                impls = {name: make_impl(name, n, causal) for name in OURS + PEERS}
                for mode in ("fwd", "fwd_bwd"):
                    # all implementations take turns in each of `rounds` rounds (see time_interleaved)
                    ms = time_interleaved({name: make_step(fn, q, k, v, mode) for name, fn in impls.items()},
                                          rounds=rounds)
                    for name in impls:
                        row[(name, mode)] = attn_flops(b, h, n, n, d, causal, mode) / ms[name] / 1e9
                rows.append(row)
                print(" ".join(f"{key}={val:.0f}" if isinstance(val, float) else f"{key}={val}"
                               for key, val in row.items() if not isinstance(key, tuple) and key != "auto_ran")
                      + " | " +
                      " ".join(f"{nm}:{md}={row[(nm, md)]:.0f}" for nm in OURS + PEERS
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
    """Two tables: what ``backend="auto"`` gives against SDPA's default, and our kernels against every peer."""
    modes = ("fwd", "fwd_bwd")
    head = ("| D | causal | N | auto fwd | fwd+bwd | auto vs SDPA default fwd | fwd+bwd | auto ran (fwd, fwd+bwd) "
            "| SDPA default fwd | fwd+bwd |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [str(r["D"]), "yes" if r["causal"] else "no", f"{r['N'] // 1024}k"]
        cells += [f"{r[('auto', m)]:.0f}" for m in modes]
        cells += [f"{r[('auto', m)] / r[('sdpa_default', m)]:.2f}x" for m in modes]
        cells += [", ".join(r["auto_ran"])]
        cells += [f"{r[('sdpa_default', m)]:.0f}" for m in modes]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    head = ("| D | causal | N | longattn fwd | fwd+bwd | " + " | ".join(f"vs {p} fwd | fwd+bwd" for p in PEERS)
            + " | " + " | ".join(f"{p} fwd | fwd+bwd" for p in PEERS) + " |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        la = [r[("longattn", m)] for m in modes]
        cells = [str(r["D"]), "yes" if r["causal"] else "no", f"{r['N'] // 1024}k", f"{la[0]:.0f}", f"{la[1]:.0f}"]
        cells += [f"{la[i] / r[(p, m)]:.2f}x" for p in PEERS for i, m in enumerate(modes)]
        cells += [f"{r[(p, m)]:.0f}" for p in PEERS for m in modes]
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
    emit(text, args.out)


if __name__ == "__main__":
    main()
