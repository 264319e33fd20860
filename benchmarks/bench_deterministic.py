"""``deterministic=True`` backward against the default one and FlashAttention-4's deterministic mode, forward and
backward of one call timed together (bf16, batch x N = 16k, heads x D = 2048, D = 128 and 64, causal and not).

Columns (ms, medians of interleaved rounds; ratios paired within rounds): our default (``backend="triton"``: the
fused Gluon backward on Hopper, dQ summed in any order), deterministic on the two Triton passes (the routing's
default), deterministic on the fused backward with dQ added in a fixed order
(``longattn.routing(deterministic_bwd_head_dims=(64, 128))``), and, where ``flash_attn.cute`` imports, FA4 with and
without ``deterministic=True``.

    python benchmarks/bench_deterministic.py [--rounds 3] [--lengths 4096 16384 1024]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import longattn  # noqa: E402
from longattn.bench.interleaved import env_header, paired_ratio, time_rounds  # noqa: E402


def _step(f, tensors, do, routed=None):
    def step():
        with longattn.routing(**(routed or {})):
            f().backward(do)
        for t in tensors:
            t.grad = None
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 1024])
    a = p.parse_args()
    try:
        from flash_attn import cute as fa4
    except ImportError:
        fa4 = None
    print(f"{env_header()}; FA4: {'yes' if fa4 is not None else 'not installed'}\n")
    cols = ["D", "N", "causal", "ours", "det_2pass", "det_fused", "fa4", "fa4_det", "2pass/ours", "fused/ours",
            "fa4_det/fused"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for d in (128, 64):
        for n in a.lengths:
            for causal in (False, True):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                do = torch.randn_like(q)
                ours = lambda det: longattn.flash_attention(q, k, v, causal=causal, backend="triton",  # noqa: E731
                                                            deterministic=det)
                steps = {"ours": _step(lambda: ours(False), (q, k, v), do),
                         "det_2pass": _step(lambda: ours(True), (q, k, v), do),
                         "det_fused": _step(lambda: ours(True), (q, k, v), do,
                                            dict(deterministic_bwd_head_dims=(64, 128)))}
                if fa4 is not None:
                    steps["fa4"] = _step(lambda: fa4.flash_attn_func(q, k, v, causal=causal)[0], (q, k, v), do)
                    steps["fa4_det"] = _step(lambda: fa4.flash_attn_func(q, k, v, causal=causal,
                                                                         deterministic=True)[0], (q, k, v), do)
                s = time_rounds(steps, rounds=a.rounds)
                t = {name: statistics.median(x) if x else float("nan") for name, x in s.items()}
                row = [d, n, causal] + [f"{t[c]:.3f}" if c in t else "-" for c in cols[3:8]]
                row += [f"{paired_ratio(s, 'det_2pass', 'ours'):.3f}", f"{paired_ratio(s, 'det_fused', 'ours'):.3f}",
                        f"{paired_ratio(s, 'fa4_det', 'det_fused'):.3f}" if fa4 is not None else "-"]
                print("| " + " | ".join(map(str, row)) + " |", flush=True)
                del q, k, v, do


if __name__ == "__main__":
    main()
