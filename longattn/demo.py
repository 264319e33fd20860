"""A short demonstration: the three operations on small random inputs, with their errors against the reference.

    python -m longattn.demo [--device cpu|cuda]

On a machine without a GPU everything runs through the PyTorch backend; on a CUDA GPU through the Triton kernels
(half precision), compared with the float64 reference.
"""
from __future__ import annotations

import argparse
import time

import torch

import longattn
from longattn import reference as ref


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    b, n, hq, hk, d = 2, 777, 8, 2, 64
    q = torch.randn(b, n, hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(b, n, hk, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(b, n, hk, d, device=dev, dtype=dtype, generator=g)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    mask = torch.rand(1, hq, -(-n // 128), -(-n // 128), device=dev, generator=g) < 0.4
    cases = [
        ("flash_attention (causal, GQA)", lambda: longattn.flash_attention(q, k, v, causal=True),
         lambda: ref.flash_attention(q64, k64, v64, causal=True)),
        ("flash_attention (window 128)", lambda: longattn.flash_attention(q, k, v, window=(128, 0)),
         lambda: ref.flash_attention(q64, k64, v64, window=(128, 0))),
        ("dilated_attention (LongNet)", lambda: longattn.dilated_attention(
            q, k, v, segment_lengths=(128, 256, 512), dilation_rates=(1, 2, 4)),
         lambda: ref.dilated_attention(q64, k64, v64, segment_lengths=(128, 256, 512), dilation_rates=(1, 2, 4))),
        ("block_sparse_attention (40%)", lambda: longattn.block_sparse_attention(
            q, k, v, block_mask=mask, block_size=128, causal=True),
         lambda: ref.block_sparse_attention(q64, k64, v64, block_mask=mask, block_size=128, causal=True)),
    ]
    backend = "Triton kernels" if dev.type == "cuda" else "PyTorch backend"
    print(f"longattn {longattn.__version__} on {dev} ({backend}), {dtype}, B={b} N={n} Hq={hq} Hk={hk} D={d}")
    print(f"{'operation':34s} {'rel. error vs float64 reference':>32s} {'time':>9s}")
    for name, fn, ref_fn in cases:
        t = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter() - t
        print(f"{name:34s} {_err(out, ref_fn()):32.2e} {t * 1e3:7.1f}ms")


if __name__ == "__main__":
    main()
