"""Host-side overhead per call: time tiny problems, where the GPU work is negligible."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from benchmarks.common import sdpa_fn  # noqa: E402


def host_us(fn, reps=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
flash = sdpa_fn("flash")


def fb(f):
    def step():
        o = f(qg, kg, vg)
        o.backward(do)
    return step


for name, f in (("longattn", lambda a, b, c: longattn.flash_attention(a, b, c, causal=True, backend="triton")),
                ("longattn-auto", lambda a, b, c: longattn.flash_attention(a, b, c, causal=True)),
                ("sdpa_flash", lambda a, b, c: flash(a, b, c, causal=True))):
    with torch.no_grad():
        t_f = host_us(lambda: f(q, k, v))
    t_fb = host_us(fb(f))
    print(f"{name:14s} fwd {t_f:7.1f} us/call   fwd+bwd {t_fb:7.1f} us/call", flush=True)
