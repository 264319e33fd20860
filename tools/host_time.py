"""Where a short call's time goes: the host's time to enqueue a forward+backward step against the GPU's time for its
kernels, for our kernels (``backend="triton"``), ``backend="auto"`` (what it runs: SDPA, FA4 or ours), SDPA with no
backend chosen and FlashAttention-4 (where ``flash_attn.cute`` imports), one GPU, one process.

    python tools/host_time.py [--shapes 128:1024:1 64:1024:0] [--steps 30] [--impls ours ours_noreplay ours_fused sdpa]
                              [--profile [IMPL ...]]

Each shape ``D:N:causal`` is bf16 with B·N = 16k and heads·D = 2048. Per implementation: "host", the time to enqueue
``--steps`` steps without a sync, per step; "wall", the same with the final sync; "GPU", the sum of a step's kernel
times under ``torch.profiler``. A step whose host time exceeds its GPU time is host-bound: faster kernels would not
make it faster. "GPU idle": over five steps run back to back, the time between the first kernel's start and the
last kernel's end when no kernel runs, a step's share: a step slower than its kernels with idle time there has the
GPU waiting on the host. Run only when named in ``--impls``: ``ours_noreplay``, ours building every call's
launches anew (``routing(replay=False)``), and ``ours_fused``, ours with the fused backward forced
(``routing(fused_bwd_min_rows={64: 0, 128: 0})``). ``--profile`` adds, for the implementations named (our kernels
by default) on each shape, the functions with the most cumulative host time (``cProfile``, one step's share) below
the public call, and those with the most host time of their own.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import longattn  # noqa: E402
from longattn.backends import fa4 as fa4_backend  # noqa: E402
from longattn.bench.timing import make_step  # noqa: E402


def _implementations(causal: bool) -> dict:
    """``{name: fn(q, k, v) -> output}``, ``(B, N, H, D)`` tensors."""
    impls = {"ours": lambda q, k, v: longattn.flash_attention(q, k, v, causal=causal, backend="triton"),
             "auto": lambda q, k, v: longattn.flash_attention(q, k, v, causal=causal),
             "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                 q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)}

    def ours_fused(q, k, v):
        with longattn.routing(fused_bwd_min_rows={64: 0, 128: 0}):
            return longattn.flash_attention(q, k, v, causal=causal, backend="triton")

    impls["ours_fused"] = ours_fused

    def ours_noreplay(q, k, v):
        with longattn.routing(replay=False):
            return longattn.flash_attention(q, k, v, causal=causal, backend="triton")

    impls["ours_noreplay"] = ours_noreplay
    fa = fa4_backend._module()
    if fa is not None:
        impls["fa4"] = lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal)[0]
    return impls


def _idle(events, device_type, per: int) -> float:
    """The time no kernel of ``events`` (profiler events, those of ``device_type``) runs between the first's start
    and the last's end, divided by ``per``."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type)
    if not spans:
        return 0.0
    idle, reached = 0.0, spans[0][1]
    for start, end in spans[1:]:
        idle += max(start - reached, 0.0)
        reached = max(reached, end)
    return idle / per


def _times(step, steps: int) -> tuple:
    """``(host µs, wall µs, GPU µs, GPU idle µs)`` of one step."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 5
    idle = _idle(prof.events(), torch.autograd.DeviceType.CUDA, 5)
    return (t1 - t0) / steps * 1e6, (t2 - t0) / steps * 1e6, gpu, idle


def _profile(step, steps: int, top: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(r"longattn|triton|autograd|flash_attn", top)
    stats.sort_stats("tottime").print_stats(top)  # (own time: torch's C functions included)
    return out.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["128:1024:1", "128:1024:0", "64:1024:0", "64:1024:1"],
                   help="D:N:causal (causal 0 or 1)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--impls", nargs="+", default=["ours", "auto", "sdpa", "fa4"], help="implementations to time")
    p.add_argument("--profile", nargs="*", default=None, help="implementations to profile (none named: ours)")
    a = p.parse_args()
    print("| D | N | causal | impl | host µs/step | wall µs/step | GPU µs/step | GPU idle µs/step |\n"
          "|---|---|---|---|---|---|---|---|")
    profiles = []
    for shape in a.shapes:
        d, n, causal = (int(x) for x in shape.split(":"))
        b, h = max(1, 16384 // n), max(1, 2048 // d)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, fn in _implementations(bool(causal)).items():
            if name not in a.impls:
                continue
            step = make_step(fn, q, k, v, "fwd_bwd")
            host, wall, gpu, idle = _times(step, a.steps)
            print(f"| {d} | {n} | {bool(causal)} | {name} | {host:.0f} | {wall:.0f} | {gpu:.0f} | {idle:.0f} |",
                  flush=True)
            if a.profile is not None and name in (a.profile or ["ours"]):
                profiles.append((shape, name, _profile(step, a.steps)))
    for shape, name, text in profiles:
        print(f"\n## cProfile of the {name} step, {shape} ({a.steps} steps)\n{text}")


if __name__ == "__main__":
    main()
