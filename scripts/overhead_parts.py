"""Host time of the pieces of a tiny backward (no synchronisation inside the loops)."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn.kernels import api, launch  # noqa: E402

q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
o, lse = api.flash_attention(q, k, v, causal=True, window=(-1, -1), scale=0.125)
delta = launch.row_delta(o, do)
dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
view = launch.dense_view(128, 128, 2)
cfg = (None, None, None, None, [], [], False, True, -1, -1, 0.125, 0, 0)


def us(fn, reps=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / reps * 1e6


qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
parts = {
    "empty_like x3": lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
    "row_delta": lambda: launch.row_delta(o, do),
    "launch.backward (dkdv+dq)": lambda: launch.backward(do, q, k, v, lse, delta, dq, dk, dv, view, True, (-1, -1),
                                                         0.125),
    "_backward_impl": lambda: api._backward_impl(do, q, k, v, o, lse, None, *cfg),
    "launch.forward": lambda: launch.forward(q, k, v, o, lse, view, True, (-1, -1), 0.125),
    "_forward_impl": lambda: api._forward_impl(q, k, v, *cfg),
    "public fwd (no grad)": lambda: longattn.flash_attention(q, k, v, causal=True),
    "public fwd+bwd": lambda: longattn.flash_attention(qg, kg, vg, causal=True).backward(do),
}
for name, fn in parts.items():
    print(f"{name:28s} {us(fn):8.1f} us", flush=True)
