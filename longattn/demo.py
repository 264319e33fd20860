"""A short demonstration: the three operations on small random inputs, checked against the float64 reference.

    python -m longattn.demo [--device cpu|cuda] [--seq N]

Each operation runs with ``backend="auto"`` (the PyTorch backend on the CPU in float32, the Triton kernels on a
CUDA GPU in bfloat16), forward and backward; the demo prints the largest absolute error of the output and of the
gradients against :mod:`longattn.reference` run in float64 on the same inputs, and exits with status 1 if an error
exceeds the tolerance of the dtype.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import longattn
from longattn import reference as ref

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _run(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> Tuple[Tensor, ...]:
    """Output and gradients of ``fn`` at (q, k, v) for the output gradient ``do``."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out,) + torch.autograd.grad(out, (q, k, v), do.to(out.dtype))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seq", type=int, default=777, help="sequence length (default 777: not a multiple of anything)")
    args = p.parse_args(argv)
    if args.seq < 1:
        p.error(f"--seq must be a positive number of tokens, got {args.seq}")
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this PyTorch sees no CUDA GPU (torch.cuda.is_available() is False); use "
                "--device cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    b, n, hq, hk, d = 2, args.seq, 8, 2, 64
    q = torch.randn(b, n, hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(b, n, hk, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(b, n, hk, d, device=dev, dtype=dtype, generator=g)
    do = torch.randn(b, n, hq, d, device=dev, dtype=dtype, generator=g)
    mask = torch.rand(1, hq, -(-n // 128), -(-n // 128), device=dev, generator=g) < 0.4
    dilated = dict(segment_lengths=(128, 256, 512), dilation_rates=(1, 2, 4))
    cases: List[Tuple[str, Callable, Callable]] = [
        ("flash_attention (causal, GQA 8/2)",
         lambda a, b_, c: longattn.flash_attention(a, b_, c, causal=True),
         lambda a, b_, c: ref.flash_attention(a, b_, c, causal=True)),
        ("flash_attention (window (128, 0))",
         lambda a, b_, c: longattn.flash_attention(a, b_, c, window=(128, 0)),
         lambda a, b_, c: ref.flash_attention(a, b_, c, window=(128, 0))),
        ("dilated_attention (LongNet, 3 branches)",
         lambda a, b_, c: longattn.dilated_attention(a, b_, c, **dilated),
         lambda a, b_, c: ref.dilated_attention(a, b_, c, **dilated)),
        ("block_sparse_attention (40% causal)",
         lambda a, b_, c: longattn.block_sparse_attention(a, b_, c, block_mask=mask, block_size=128, causal=True),
         lambda a, b_, c: ref.block_sparse_attention(a, b_, c, block_mask=mask, block_size=128, causal=True)),
    ]
    backend = "Triton kernels" if dev.type == "cuda" else "PyTorch backend"
    print(f"longattn {longattn.__version__}, torch {torch.__version__}, on {dev} ({backend}), {dtype}, "
          f"B={b} N={n} Hq={hq} Hk={hk} D={d}")
    print("max |error| against the float64 reference:")
    print(f"{'operation':42s} {'out':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s} {'fwd+bwd (1st call)':>19s}")
    tol = TOLERANCE[dtype]
    worst = 0.0
    for name, fn, ref_fn in cases:
        start = time.perf_counter()
        got = _run(fn, q, k, v, do)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        want = _run(ref_fn, q.double(), k.double(), v.double(), do.double())
        errs = [(a.double() - w).abs().max().item() for a, w in zip(got, want)]
        worst = max(worst, max(e / max(1.0, w.abs().max().item()) for e, w in zip(errs, want)))
        print(f"{name:42s} " + " ".join(f"{e:9.1e}" for e in errs) + f" {elapsed * 1e3:17.0f}ms")
    ok = worst <= tol
    print(f"{'all within' if ok else 'NOT within'} the {dtype} tolerance {tol:g} (relative to the largest value)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
