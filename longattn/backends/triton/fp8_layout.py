"""Layout kernels: float8 values turned sequence-major for the FP8 forward.

FP8 tensor cores take both operands of a product K-major; for ``P V`` that is V with the keys innermost.
:func:`seq_major` copies ``v (B, M, Hk, D)`` into a ``(B, Hk, D, M')`` buffer (``M'``: ``M`` rounded up to 16, so
that each head-dim row stays 16-byte aligned for TMA) with one Triton program per (key block, batch x KV head), each
transposing a tile of bytes through shared memory (PyTorch's copy of a permuted float8 tensor is several times
slower). Without a GPU (and outside the interpreter) the copy is PyTorch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.backends.device import interpret_mode
from longattn.backends.triton.launch import block_d, on_device

ROWS = 64  # keys per program


@triton.jit
def _seq_major_copy(V, OUT, svb, svn, svh, M, n_kv_heads, out_row, HEAD_D: tl.constexpr,
                    BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Keys ``[m0, m0 + ROWS)`` of one (batch, KV head): ``OUT[b, h, d, m] = V[b, m, h, d]``; ``OUT`` is contiguous
    ``(B, Hk, HEAD_D, out_row)``."""
    m0 = tl.program_id(0) * ROWS
    b = tl.program_id(1) // n_kv_heads
    h = tl.program_id(1) % n_kv_heads
    m = m0 + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    ok = (m < M)[:, None] & (d < HEAD_D)[None, :]
    tile = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + m[:, None].to(tl.int64) * svn + d[None, :],
                   mask=ok)
    base = OUT + (b.to(tl.int64) * n_kv_heads + h) * HEAD_D * out_row
    tl.store(base + d[:, None].to(tl.int64) * out_row + m[None, :], tl.trans(tile), mask=tl.trans(ok))


def seq_major(v: Tensor) -> Tensor:
    """``v (B, M, Hk, D)`` with the sequence innermost, the layout the FP8 forward reads values in: ``v`` itself
    when it is so already (``v.stride(1) == 1``), else a copy into a ``(B, Hk, D, M')`` buffer, returned as a
    ``(B, M, Hk, D)`` view of it."""
    if v.stride(1) == 1 or v.shape[1] <= 1:
        return v
    B, M, Hk, D = v.shape
    out_row = -(-M // 16) * 16
    buf = v.new_empty((B, Hk, D, out_row))
    if (v.is_cuda or interpret_mode()) and v.stride(-1) == 1 and B * Hk > 0 and v.element_size() == 1:
        with on_device(v):  # the bytes, whatever their dtype
            _seq_major_copy[(triton.cdiv(M, ROWS), B * Hk)](v.view(torch.uint8), buf.view(torch.uint8), v.stride(0),
                                                           v.stride(1), v.stride(2), M, Hk, out_row, HEAD_D=D,
                                                           BLOCK_D=block_d(D), ROWS=ROWS)
    else:
        buf[..., :M].copy_(v.permute(0, 2, 3, 1))
    return buf.permute(0, 3, 1, 2)[:, :M]
