"""Attention sinks in the Triton backend: one pass over a finished forward's result, one over the backward's inputs.

A sink adds ``exp(sink_h)`` to every query's softmax denominator with no value attached
(:func:`longattn.call.add_sinks` is the reference). Added after the forward kernels, it scales each output row by
``w = exp(lse - lse')``, ``lse' = logaddexp(lse, sink)``: :func:`add_sinks` does that in one pass over ``o`` (in
place) and ``lse`` (into a new tensor). The result is attention whose probabilities are ``exp(s - lse')``, so the
backward kernels need nothing more than ``lse'`` for dq, dk and dv; the sinks' own gradient,
``sum_i p_i (dlse_i - delta_i)`` with ``p_i = exp(sink - lse'_i)`` and ``delta_i = rowsum(dO_i * O_i)``, is
:func:`sink_grad` (per-block partial sums added in a fixed order, so it is deterministic).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.backends.triton.launch import block_d

ROWS = 64  # query rows per program


@triton.jit
def _program_rows(N, H, blocks, BLOCK_M: tl.constexpr):
    """This program's ``(batch x head, batch, head, rows, rows < N)``: a 1-D grid of (batch x head, row block)
    pairs, so that neither count is bounded by a grid dimension's 65535."""
    bh = tl.program_id(0) // blocks
    rows = (tl.program_id(0) % blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    return bh, bh // H, bh % H, rows, rows < N


@triton.jit
def _add_sinks_kernel(O, LSE, LSE_OUT, SINKS, N, H, blocks, so_b, so_n, so_h, HEAD_D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # The new log-sum-exp goes to another buffer than the one read: the compiler may load LSE a second time in the
    # output tile's layout (instead of moving the weights between layouts), and an in-place store by the thread that
    # owns a row in the first layout could then land before that second load (docs/kernel_notes.md).
    bh, b, h, rows, live = _program_rows(N, H, blocks, BLOCK_M)
    lse = tl.load(LSE + bh.to(tl.int64) * N + rows, mask=live, other=0.0)
    sink = tl.load(SINKS + h).to(tl.float32)
    top = tl.maximum(lse, sink)
    finite = (top > float("-inf")) & (top < float("inf"))
    safe = tl.where(finite, top, 0.0)
    total = tl.where(finite, safe + tl.log(tl.exp(lse - safe) + tl.exp(sink - safe)), top)
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - total))  # 0 too where the sink is +inf
    tl.store(LSE_OUT + bh.to(tl.int64) * N + rows, total, mask=live)
    cols = tl.arange(0, BLOCK_D)
    ptr = O + b.to(tl.int64) * so_b + h * so_h + rows[:, None].to(tl.int64) * so_n + cols[None, :]
    mask = live[:, None] & (cols[None, :] < HEAD_D)
    o = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (o * weight[:, None]).to(O.dtype.element_ty), mask=mask)


@triton.jit
def _sink_grad_kernel(DO, O, LSE, DLSE, SINKS, PARTIAL, N, H, blocks, so_b, so_n, so_h, sd_b, sd_n, sd_h,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    bh, b, h, rows, live = _program_rows(N, H, blocks, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < HEAD_D)
    o = tl.load(O + b.to(tl.int64) * so_b + h * so_h + rows[:, None].to(tl.int64) * so_n + cols[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * sd_b + h * sd_h + rows[:, None].to(tl.int64) * sd_n + cols[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh.to(tl.int64) * N + rows, mask=live, other=0.0).to(tl.float32)
    lse = tl.load(LSE + bh.to(tl.int64) * N + rows, mask=live, other=0.0)
    sink = tl.load(SINKS + h).to(tl.float32)
    p = tl.where(sink == lse, 1.0, tl.exp(sink - lse))  # lse includes the sink: p <= 1; 1 where it is everything
    p = tl.where(live, p, 0.0)
    p = tl.where(sink > float("-inf"), p, 0.0)
    tl.store(PARTIAL + tl.program_id(0).to(tl.int64), -tl.sum(p * delta, axis=0))


def add_sinks(o: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Add the sinks ``(H,)`` to a forward's result: ``o (B, N, H, D)`` (unit stride along D) is scaled row by row
    in place; returns the log-sum-exp with the sinks, a new ``(B, H, N)`` float32 tensor (``lse``, contiguous, is
    only read)."""
    B, N, H, D = o.shape
    out_lse = torch.empty_like(lse)
    if N == 0 or B * H == 0:
        return out_lse
    blocks = triton.cdiv(N, ROWS)
    _add_sinks_kernel[(B * H * blocks,)](o, lse, out_lse, sinks.contiguous(), N, H, blocks, *o.stride()[:3],
                                         HEAD_D=D, BLOCK_D=block_d(D), BLOCK_M=ROWS)
    return out_lse


def sink_grad(do: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor], sinks: Tensor) -> Tensor:
    """The gradient of the sinks ``(H,)``, in their dtype, from the output gradient ``do``, the output ``o``
    (``(B, N, H, D)``, unit stride along D), its log-sum-exp with the sinks ``lse (B, H, N)`` (contiguous) and an
    optional gradient ``dlse`` of it (same shape)."""
    B, N, H, D = o.shape
    blocks = triton.cdiv(N, ROWS)
    partial = torch.empty((B * H, blocks), device=o.device, dtype=torch.float32)
    if partial.numel():
        _sink_grad_kernel[(B * H * blocks,)](
            do, o, lse, dlse.contiguous() if dlse is not None else lse, sinks.contiguous(), partial, N, H, blocks,
            *o.stride()[:3], *do.stride()[:3], HEAD_D=D, BLOCK_D=block_d(D), BLOCK_M=ROWS,
            HAS_DLSE=dlse is not None)
    return partial.view(B, H, blocks).sum((0, 2)).to(sinks.dtype)
