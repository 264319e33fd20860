"""Layout kernels: float8 values turned sequence-major for the FP8 forward.

FP8 tensor cores take both operands of a product K-major; for ``P V`` that is V with the keys innermost.
:func:`seq_major` copies ``v (B, M, Hk, D)`` into a ``(B, Hk, D, M')`` buffer (``M'``: ``M`` rounded up to 16, so
that each head-dim row stays 16-byte aligned for TMA, the padding zero) with one Triton program per (key block,
batch x KV head), each transposing a tile of bytes through shared memory (PyTorch's copy of a permuted float8 tensor
is several times slower). With ``permuted=True`` (the Gluon forward's layout, ``FP8 == 2`` of
:mod:`longattn.backends.gluon.fwd`) the keys of each group of 16 are stored permuted, key ``16 g + j`` at
``16 g + pi(j)`` with ``pi = PI16`` (groups counted from key 0 of each batch row and KV head). Without a GPU (and
outside the interpreter) the copy is PyTorch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.backends.device import interpret_mode
from longattn.backends.triton.launch import block_d, on_device

ROWS = 64  # keys per program (a multiple of 16: whole groups of the permuted layout)
# Where the permuted layout stores key j = 8 c3 + 4 c2 + 2 c1 + c0 of a group of 16: at 8 c2 + 4 c1 + 2 c3 + c0.
PI16 = (0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)


@triton.jit
def _seq_major_copy(V, OUT, svb, svn, svh, svd, M, n_kv_heads, out_row, HEAD_D: tl.constexpr,
                    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PERMUTED: tl.constexpr):
    """Keys ``[m0, m0 + ROWS)`` of one (batch, KV head), ``m0`` a multiple of 16: ``OUT[b, h, d, m] = V[b, m, h, d]``
    (with ``PERMUTED`` at ``16 g + pi(j)`` for key ``m = 16 g + j``), zero for keys ``M`` to ``out_row``; ``OUT`` is
    contiguous ``(B, Hk, HEAD_D, out_row)``. The permutation moves rows of the tile in registers, so that loads and
    stores stay contiguous."""
    m0 = tl.program_id(0) * ROWS
    b = tl.program_id(1) // n_kv_heads
    h = tl.program_id(1) % n_kv_heads
    m = m0 + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    ok = (m < M)[:, None] & (d < HEAD_D)[None, :]
    tile = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + m[:, None].to(tl.int64) * svn
                   + d[None, :].to(tl.int64) * svd, mask=ok, other=0)
    if PERMUTED:  # row 16 g + 8 c3 + 4 c2 + 2 c1 + c0 to 16 g + 8 c2 + 4 c1 + 2 c3 + c0
        tile = tl.reshape(tile, [ROWS // 16, 2, 2, 2, 2, BLOCK_D])  # (g, c3, c2, c1, c0, d)
        tile = tl.reshape(tl.permute(tile, [0, 2, 3, 1, 4, 5]), [ROWS, BLOCK_D])
    base = OUT + (b.to(tl.int64) * n_kv_heads + h) * HEAD_D * out_row
    keep = (d < HEAD_D)[:, None] & (m < out_row)[None, :]
    tl.store(base + d[:, None].to(tl.int64) * out_row + m[None, :], tl.trans(tile), mask=keep)


def _permuted_keys(n: int) -> Tensor:
    """``src (n,)`` int64, ``n`` a multiple of 16: the permuted layout's stored key ``m`` holds key ``src[m]``."""
    m = torch.arange(n)
    return m - m % 16 + torch.tensor(PI16).argsort()[m % 16]


def seq_major(v: Tensor, permuted: bool = False) -> Tensor:
    """``v (B, M, Hk, D)`` with the sequence innermost, the layout the FP8 forward reads values in: ``v`` itself
    when it is so already (``v.stride(1) == 1``), else a copy into a ``(B, Hk, D, M')`` buffer, returned as a
    ``(B, M, Hk, D)`` view of it. With ``permuted`` (the Gluon forward's layout) always a copy, the keys of each
    group of 16 permuted: the whole ``(B, M', Hk, D)`` view, ``out[:, 16 g + pi(j)] = v[:, 16 g + j]`` and keys
    ``M`` to ``M'`` zero."""
    if not permuted and is_seq_major(v):
        return v
    B, M, Hk, D = v.shape
    buf = _buffer(v)
    out_row = buf.shape[-1]
    if (v.is_cuda or interpret_mode()) and B * Hk * M > 0 and v.element_size() == 1:
        with on_device(v):  # the bytes, whatever their dtype
            _seq_major_copy[(triton.cdiv(out_row, ROWS), B * Hk)](
                v.view(torch.uint8), buf.view(torch.uint8), v.stride(0), v.stride(1), v.stride(2), v.stride(3), M,
                Hk, out_row, HEAD_D=D, BLOCK_D=block_d(D), ROWS=ROWS, PERMUTED=permuted)
    else:
        buf[..., M:].zero_()
        buf[..., :M].copy_(v.permute(0, 2, 3, 1))
        if permuted:
            buf = buf[..., _permuted_keys(out_row).to(v.device)]
    return buf.permute(0, 3, 1, 2) if permuted else buf.permute(0, 3, 1, 2)[:, :M]


def seq_major_like(v: Tensor) -> Tensor:
    """What :func:`seq_major` would return for ``v`` (its shape, strides and alignment) without the copy: ``v``
    itself where it returns ``v``, else an uninitialised tensor of that layout. For planning (``explain``), which
    reads layouts, not values, and launches nothing."""
    return v if is_seq_major(v) else _buffer(v).permute(0, 3, 1, 2)[:, :v.shape[1]]


def is_seq_major(v: Tensor) -> bool:
    """Whether ``v`` is sequence-major already (or has at most one key): :func:`seq_major` returns it as it is."""
    return v.stride(1) == 1 or v.shape[1] <= 1


def _buffer(v: Tensor) -> Tensor:
    """The uninitialised ``(B, Hk, D, M')`` buffer of :func:`seq_major`'s copy, ``M'`` the keys rounded up to 16."""
    B, M, Hk, D = v.shape
    return v.new_empty((B, Hk, D, -(-M // 16) * 16))
