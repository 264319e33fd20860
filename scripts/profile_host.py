"""cProfile of the host side of a tiny forward+backward (where GPU time is negligible)."""
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402

q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q.requires_grad_(); k.requires_grad_(); v.requires_grad_()


def step():
    o = longattn.flash_attention(q, k, v, causal=True, backend="triton")
    o.backward(do)


for _ in range(10):
    step()
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(100):
    step()
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
