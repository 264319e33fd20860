"""A/B of the forward's lazy rescaling (LONGATTN_LAZY=0/1 set per process): TFLOP/s at N=4k and 16k."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from benchmarks.common import attn_flops, bench_ms  # noqa: E402

res = []
for d in (64, 128):
    for causal in (False, True):
        for n in (4096, 16384):
            b, h = 16384 // n, 2048 // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            ms = bench_ms(lambda: longattn.flash_attention(q, k, v, causal=causal, backend="triton"), rep=300)
            res.append(f"D{d} c{int(causal)} N{n}: {attn_flops(b, h, n, n, d, causal, 'fwd') / ms / 1e9:.0f}")
print(f"LAZY={os.environ.get('LONGATTN_LAZY')}: " + " | ".join(res), flush=True)
