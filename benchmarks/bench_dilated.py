"""Dilated benchmark: fused dilated attention against the plain composition (slice + SDPA kernel with its
log-sum-exp + merge), with the kernel SDPA runs by default (cuDNN on Hopper) and with SDPA's flash kernel.

B=1, H=16, D=64, bf16, segment_lengths (2048, 4096, 8192, 16384), dilation_rates (1, 2, 4, 8); time and peak
memory beyond q, k, v and the output, forward and forward+backward, both measured in the same run; then the longest
sequence longattn runs forward and forward+backward.

    python benchmarks/bench_dilated.py [--lengths 32768 131072 ...] [--maxlen]
"""
from __future__ import annotations

import argparse

import torch

from longattn.bench.interleaved import emit, env_header, make_step, time_interleaved
import longattn
from longattn.bench.composition import default_kernel, dilated_composition

SEGS, RATES = (2048, 4096, 8192, 16384), (1, 2, 4, 8)


def fused(q, k, v):
    return longattn.dilated_attention(q, k, v, segment_lengths=SEGS, dilation_rates=RATES, backend="triton")


def composition(kernel):
    return lambda q, k, v: dilated_composition(q, k, v, SEGS, RATES, kernel=kernel)


def peak_extra(step, out_bytes: int, n_out: int):
    """Peak bytes allocated while ``step`` runs, beyond what was allocated before and beyond ``n_out`` tensors of
    ``out_bytes`` (the output, and for forward+backward the three gradients, which the caller must hold anyway)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - n_out * out_bytes


def measure_pair(n, mode, impls, h=16, d=64, rounds=3):
    """{name: (ms, extra bytes, bytes of q+k+v) or "oom"} for the fused op and the compositions on the same
    inputs: memory from one run of each, time from interleaved rounds (see time_interleaved)."""
    torch.cuda.empty_cache()
    res = {}
    try:
        q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qkv = 3 * q.numel() * q.element_size()
        steps = {}
        for name, fn in impls.items():
            try:
                step = make_step(fn, q, k, v, mode)
                extra = peak_extra(step, q.numel() * q.element_size(), 1 if mode == "fwd" else 4)
                steps[name] = step
                res[name] = extra
            except torch.cuda.OutOfMemoryError:
                res[name] = "oom"
                torch.cuda.empty_cache()
        kw = dict(warmup=25, rep=200) if mode == "fwd" else dict(warmup=1, rep=300)
        times = time_interleaved(steps, rounds=rounds, **kw) if steps else {}
        return {name: (times[name], res[name], qkv) if res[name] != "oom" else "oom" for name in res}
    except torch.cuda.OutOfMemoryError:
        return {name: "oom" for name in impls}
    finally:
        torch.cuda.empty_cache()


def fits(fn, n, mode, h=16, d=64) -> bool:
    """Whether one run of ``fn`` at length ``n`` fits in the GPU's memory (the longest-sequence probe)."""
    torch.cuda.empty_cache()
    try:
        q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        make_step(fn, q, k, v, mode)()
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def longest(fn, mode, start, limit):
    """Largest N (multiple of 16384) that runs, by doubling then bisecting."""
    ok, bad = 0, None
    n = start
    while n <= limit:
        ok_n = fits(fn, n, mode)
        print(f"  maxlen {mode} N={n}: {'ok' if ok_n else 'oom'}", flush=True)
        if not ok_n:
            bad = n
            break
        ok, n = n, n * 2
    if bad is None:
        return ok, "(limit reached)"
    step = 16384
    while bad - ok > max(ok // 16, step):
        mid = (ok + bad) // 2 // step * step
        ok_mid = fits(fn, mid, mode)
        print(f"  maxlen {mode} N={mid}: {'ok' if ok_mid else 'oom'}", flush=True)
        ok, bad = (mid, bad) if ok_mid else (ok, mid)
    return ok, f"(N={bad} ran out of memory)"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 524288, 1048576])
    p.add_argument("--maxlen", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median reported)")
    a = p.parse_args()
    header = env_header()
    print(header, flush=True)
    default = default_kernel(torch.device("cuda"), torch.bfloat16)
    impls = {"longattn": fused, f"composition ({default}, SDPA's default)": composition(default)}
    if default != "flash":
        impls["composition (flash)"] = composition("flash")
    peers = list(impls)[1:]
    lines = [f"Measured on {header}; B=1, H=16, D=64, bf16, segments {SEGS}, rates {RATES}; time: median over "
             f"{a.rounds} rounds of do_bench medians, all taking turns. Extra memory: peak beyond q, k, v and the "
             "output (and the gradients), over the bytes of q+k+v.", "",
             "| N | pass | longattn ms | " + " | ".join(f"{p} ms | speedup" for p in peers)
             + " | longattn extra mem / (q+k+v) | " + " | ".join(f"{p} extra" for p in peers) + " |"]
    lines.append("|" + "---|" * (lines[-1].count("|") - 1))
    for n in a.lengths:
        for mode in ("fwd", "fwd_bwd"):
            res = measure_pair(n, mode, impls, rounds=a.rounds)
            ours = res["longattn"]
            cells = [f"{n // 1024}k", mode, "oom" if ours == "oom" else f"{ours[0]:.2f}"]
            for p in peers:
                theirs = res[p]
                if theirs == "oom":
                    cells += ["oom", ""]
                else:
                    cells += [f"{theirs[0]:.2f}", "" if ours == "oom" else f"{theirs[0] / ours[0]:.2f}x"]
            for name in impls:
                r = res[name]
                cells.append("oom" if r == "oom" else f"{r[1] / 2**30:.2f} GiB ({r[1] / r[2]:.3f})")
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if a.maxlen:
        total = torch.cuda.get_device_properties(0).total_memory
        per_token_fwd = 4 * 16 * 64 * 2  # q, k, v, o
        limit = int(total / per_token_fwd * 1.1)
        f_ok, f_note = longest(fused, "fwd", 1 << 22, limit)
        b_ok, b_note = longest(fused, "fwd_bwd", 1 << 21, limit // 2)
        lines += ["", f"Longest sequence on this GPU: forward {f_ok:,} tokens {f_note}; "
                      f"forward+backward {b_ok:,} tokens {b_note}."]
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
