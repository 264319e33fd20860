"""Fused Hopper (sm_90a) attention backward in Gluon: dQ, dK and dV in one kernel, five products per block pair.

One program owns ``BLOCK_N = 2 * SUB_N`` keys of one (batch, head) and walks every query block (``BLOCK_M`` rows)
that can see them (FlashAttention-3's scheme). Three partitions:

- the **loader** (the default partition, four warps at 24 registers) loads the program's K and V once, one
  ``SUB_N``-row half per consumer, then the Q and dO tiles of every query block into two buffers by TMA;
- two **consumers** (one warpgroup each, ``SUB_N`` of the keys each, 240 registers) take every query block. With
  their K and V rows resident, per block::

      S^T  = K Q^T,  dP^T = V dO^T                      (issued together, asynchronously)
      P^T  = exp2(S^T * scale * log2(e) - lse2)         (masked where the causal band cuts the block)
      dV  += P^T dO                                     (P^T from registers)
      dS^T = P^T (dP^T - delta)
      dK  += dS^T Q                                     (dS^T from registers)
      dQ_h = dS K_h                                     (dS^T through shared memory, read transposed)

  and add their share ``dQ_h`` (float32) into a float32 dQ buffer in global memory with a TMA reduce-add. dK and
  dV stay in registers and are written once at the end (dK times ``scale``).

The row statistics come from a small Triton kernel (:func:`_row_stats`: ``lse2``, the log-sum-exp in base 2,
``+inf`` for a query that saw no key; ``delta = rowsum(dO * O)``), padded per (batch, head) to whole query blocks, so
the loader brings them into shared memory by TMA with Q and dO. Rows past the query sequence's end load as zeros with
``lse2 = +inf`` (weight 0) and their dQ rows fall outside the dQ descriptor; keys past the key sequence's end load as
zeros and get weight 0, and their dK/dV rows are not stored. The causal band is aligned bottom-right (query
``i`` sees key ``j <= i + seq_k - seq_q``, top-left when the lengths are equal), as everywhere in longattn.

Not routed to by the registry yet: :func:`fused_backward` is the entry point while it is measured.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# --- The one place that knows Triton versions apart -------------------------------------------------------------
# Triton 3.6 calls the TMA load async_copy_global_to_shared and has no Python wrapper of the TMA reduce-add (the
# builder method exists); 3.7+ name them async_load and async_atomic_add. A shared-memory view of another layout
# is ``_reinterpret`` in 3.6, ``reinterpret`` later.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_REINTERPRET = "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"


@_builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """``smem`` viewed as ``shape`` of ``dtype`` in ``layout`` (the same bytes)."""
    return getattr(smem, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)


if hasattr(tma, "async_atomic_add"):
    tma_reduce_add = tma.async_atomic_add
else:
    @_builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into ``tensor_desc`` at ``coord`` (``cp.reduce.async.bulk.tensor``
        with ``.add``); finish with ``tma.store_wait``."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
# ----------------------------------------------------------------------------------------------------------------

BOX16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4))
BOX32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4))
TILE16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
ROWS32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _query_blocks(n0, seq_q, seq_k, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """The query blocks ``[lo, hi)`` whose rows can see any key from ``n0`` on (causal: query ``i`` sees key ``j``
    for ``j <= i + seq_k - seq_q``)."""
    first = n0 * 0
    if CAUSAL:
        first = gl.maximum(n0 - (seq_k - seq_q), 0)
    lo = first // BLOCK_M
    return lo, gl.maximum(gl.cdiv(seq_q, BLOCK_M), lo)


@gluon.jit
def _loader(Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads,
            n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, ready, empty, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
            SUB_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The loader partition: each consumer's K and V rows once, then Q and dO of every query block into the two
    buffers (a buffer is refilled once both consumers are done with it)."""
    b = gl.program_id(2)
    h = gl.program_id(1)
    n0 = gl.program_id(0) * (2 * SUB_N)
    n_batch = gl.num_programs(2)
    q_desc = tma.make_tensor_descriptor(Q, shape=[n_batch, n_heads, seq_q, HEAD_D], strides=[sqb, sqh, sqn, 1],
                                        block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    do_desc = tma.make_tensor_descriptor(DO, shape=[n_batch, n_heads, seq_q, HEAD_D], strides=[sdb, sdh, sdn, 1],
                                         block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    k_desc = tma.make_tensor_descriptor(K, shape=[n_batch, n_heads, seq_k, HEAD_D], strides=[skb, skh, skn, 1],
                                        block_shape=[1, 1, SUB_N, HEAD_D], layout=BOX16)
    v_desc = tma.make_tensor_descriptor(V, shape=[n_batch, n_heads, seq_k, HEAD_D], strides=[svb, svh, svn, 1],
                                        block_shape=[1, 1, SUB_N, HEAD_D], layout=BOX16)
    stats_desc = tma.make_tensor_descriptor(STATS, shape=[n_batch * n_heads * 2, n_pad], strides=[n_pad, 1],
                                            block_shape=[2, BLOCK_M], layout=ROWS32)
    for half in gl.static_range(2):
        mbarrier.expect(kv_bar.index(half), 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [b, h, n0 + half * SUB_N, 0], kv_bar.index(half), k_smem.index(half))
        tma_load(v_desc, [b, h, n0 + half * SUB_N, 0], kv_bar.index(half), v_smem.index(half))
    lo, hi = _query_blocks(n0, seq_q, seq_k, BLOCK_M, CAUSAL)
    for t in range(hi - lo):
        st = t % 2
        # A fresh barrier counts as having finished the phase before its first, so the first lap does not wait.
        mbarrier.wait(empty.index(st), ((t // 2) & 1) ^ 1)
        mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, (lo + t) * BLOCK_M, 0], ready.index(st), q_smem.index(st))
        tma_load(do_desc, [b, h, (lo + t) * BLOCK_M, 0], ready.index(st), do_smem.index(st))
        tma_load(stats_desc, [(b * n_heads + h) * 2, (lo + t) * BLOCK_M], ready.index(st), stats_smem.index(st))


@gluon.jit
def _consumer(DQ, DK, DV, seq_q, seq_k, n_heads, scale, k_smem, v_smem, q_smem, do_smem, stats_smem, ds_smem,
              dq_smem, kv_bar, ready, empty, HALF: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              SUB_N: gl.constexpr, CAUSAL: gl.constexpr):
    """A consumer partition (one warpgroup): keys ``HALF * SUB_N`` on of the program's; their dK and dV, and their
    share of every query block's dQ."""
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    b = gl.program_id(2)
    h = gl.program_id(1)
    n0 = gl.program_id(0) * (2 * SUB_N)
    n_batch = gl.num_programs(2)
    # dQ is float32 (B, N, H, D) contiguous.
    dq_desc = tma.make_tensor_descriptor(DQ, shape=[n_batch, n_heads, seq_q, HEAD_D],
                                         strides=[seq_q * n_heads * HEAD_D, HEAD_D, n_heads * HEAD_D, 1],
                                         block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX32)
    lo, hi = _query_blocks(n0, seq_q, seq_k, BLOCK_M, CAUSAL)
    shift = seq_k - seq_q
    n0 = n0 + HALF * SUB_N  # this consumer's keys
    keys = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ST_LAYOUT))
    qk_scale = scale * LOG2E
    ds_tile = ds_smem.index(HALF)
    dq_tile = dq_smem.index(HALF)
    # The row statistics as (stage * 2 + [lse2, delta], row): the unswizzled TMA tiles read as plain rows.
    stats_rows = reinterpret(stats_smem, gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    mbarrier.wait(kv_bar.index(HALF), 0)
    k_tile = k_smem.index(HALF).reshape([SUB_N, HEAD_D])
    v_tile = v_smem.index(HALF).reshape([SUB_N, HEAD_D])
    dk = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
    dv = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
    for t in range(hi - lo):
        st = t % 2
        m0 = (lo + t) * BLOCK_M
        mbarrier.wait(ready.index(st), (t // 2) & 1)
        q_tile = q_smem.index(st).reshape([BLOCK_M, HEAD_D])
        do_tile = do_smem.index(st).reshape([BLOCK_M, HEAD_D])
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT),
                            use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT),
                             use_acc=False, is_async=True)
        COLS: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)  # a value per query row (the columns of S^T)
        lse2 = stats_rows.index(2 * st).load(COLS)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        if CAUSAL:
            # Only the blocks the band cuts: some key of this consumer lies past the first row's last key.
            if n0 + SUB_N - 1 > m0 + shift:
                rows = m0 + gl.arange(0, BLOCK_M, layout=COLS)
                p_t = gl.where(keys[:, None] <= rows[None, :] + shift, p_t, 0.0)
        if n0 + SUB_N > seq_k:
            # Keys past the end load as zeros: weight 0 (exp2(-lse2) could overflow, and inf * 0 is NaN in dQ).
            p_t = gl.where(keys[:, None] < seq_k, p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), OP_LAYOUT), do_tile, dv, is_async=True)
        delta = stats_rows.index(2 * st + 1).load(COLS)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
        ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_t, OP_LAYOUT), q_tile, dk, is_async=True)
        ds_tile.store(ds_t)
        fence_async_shared()
        dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv,))
        dq = warpgroup_mma(ds_tile.permute((1, 0)), k_tile, gl.zeros([BLOCK_M, HEAD_D], gl.float32, ACC_LAYOUT),
                           use_acc=False, is_async=True)
        dk = warpgroup_mma_wait(num_outstanding=1, deps=(dk,))
        mbarrier.arrive(empty.index(st), count=1)  # Q and dO read for the last time
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        tma.store_wait(0)  # the previous block's reduce-add has read the dQ tile
        dq_tile.reshape([BLOCK_M, HEAD_D]).store(dq)
        fence_async_shared()
        tma_reduce_add(dq_desc, [b, h, m0, 0], dq_tile)
    tma.store_wait(0)
    # DK and DV are contiguous (B, M, H, D).
    out_rows = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ACC_LAYOUT))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ACC_LAYOUT))
    offs = ((b.to(gl.int64) * seq_k + out_rows[:, None].to(gl.int64)) * n_heads + h) * HEAD_D + d[None, :]
    ok = (out_rows < seq_k)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def flash_bwd_fused(Q, K, V, DO, STATS, DQ, DK, DV, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh,
                    seq_q, seq_k, n_heads, n_pad, scale, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                    SUB_N: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid ``(cdiv(seq_k, 2 * SUB_N), H, B)``; ``num_warps`` 4 (the loader), two consumer warpgroups of
    ``CONSUMER_REGS`` registers, ``SUB_N`` keys each. Q, K, V, dO ``(B, N|M, H, D)`` with unit stride along D (the
    strides given); STATS float32 ``(B * H * 2, n_pad)``, rows ``lse2`` and ``delta`` per (batch, head), padded to
    ``n_pad`` (a multiple of ``BLOCK_M``) with ``+inf`` and 0 (:func:`_row_stats`); DQ float32 ``(B, N, H, D)``
    contiguous and zeroed (dQ / scale is added into it); DK and DV contiguous ``(B, M, H, D)``."""
    dtype: gl.constexpr = Q.dtype.element_ty
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    ds_smem = gl.allocate_shared_memory(dtype, [2, SUB_N, BLOCK_M], TILE16)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_D], BOX32)
    stats_smem = gl.allocate_shared_memory(gl.float32, [2, 2, BLOCK_M], ROWS32)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    first: gl.constexpr = 0
    second: gl.constexpr = 1
    gl.warp_specialize([
        (_loader, (Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k,
                   n_heads, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, ready, empty, HEAD_D,
                   BLOCK_M, SUB_N, CAUSAL)),
        (_consumer, (DQ, DK, DV, seq_q, seq_k, n_heads, scale, k_smem, v_smem, q_smem, do_smem, stats_smem, ds_smem,
                     dq_smem, kv_bar, ready, empty, first, HEAD_D, BLOCK_M, SUB_N, CAUSAL)),
        (_consumer, (DQ, DK, DV, seq_q, seq_k, n_heads, scale, k_smem, v_smem, q_smem, do_smem, stats_smem, ds_smem,
                     dq_smem, kv_bar, ready, empty, second, HEAD_D, BLOCK_M, SUB_N, CAUSAL)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# --- Launcher ----------------------------------------------------------------------------------------------------

BLOCK_M = 64  # query rows per block
SUB_N = 64  # keys per consumer (a program owns 2 * SUB_N)
CONSUMER_REGS = 240
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
STATS_ROWS = 64  # rows per program of the statistics kernel


@triton.jit
def _row_stats(O, DO, LSE, STATS, sob, son, soh, sdb, sdn, sdh, seq, n_heads, n_pad, HEAD_D: tl.constexpr,
               BLOCK: tl.constexpr):
    """``STATS[(b * H + h) * 2 + 0, row] = lse2`` (base 2, ``+inf`` where ``lse`` is ``-inf`` and past the end) and
    ``STATS[... + 1, row] = rowsum(dO * O)`` (0 past the end), for rows up to ``n_pad``."""
    b = tl.program_id(1) // n_heads
    h = tl.program_id(1) % n_heads
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < seq
    r64 = rows[:, None].to(tl.int64)
    d = tl.arange(0, HEAD_D)[None, :]
    o = tl.load(O + b.to(tl.int64) * sob + h * soh + r64 * son + d, mask=ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdb + h * sdh + r64 * sdn + d, mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + (b.to(tl.int64) * n_heads + h) * seq + rows, mask=ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    out = STATS + ((b.to(tl.int64) * n_heads + h) * 2) * n_pad + rows
    tl.store(out, lse2, mask=rows < n_pad)
    tl.store(out + n_pad, delta, mask=rows < n_pad)


def _check(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse)):
        if not isinstance(t, Tensor):
            raise TypeError(f"fused_backward: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"fused_backward: {name} must be on a CUDA (sm_90) device")
    if q.dim() != 4:
        raise ValueError(f"fused_backward: q must be (B, N, H, D), got shape {tuple(q.shape)}")
    B, N, H, D = q.shape
    if q.dtype not in DTYPES:
        raise TypeError(f"fused_backward: q must be float16 or bfloat16, got {q.dtype}")
    if D not in HEAD_DIMS:
        raise ValueError(f"fused_backward: head dim must be one of {HEAD_DIMS}, got {D}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[2] != H or t.shape[3] != D or t.shape[1] != k.shape[1]:
            raise ValueError(f"fused_backward: {name} must be (B, M, H, D) = ({B}, M, {H}, {D}) with the same M as k "
                             f"(one head per query head), got {tuple(t.shape)}")
    for name, t in (("o", o), ("do", do)):
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"fused_backward: {name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("do", do)):
        if t.dtype != q.dtype:
            raise TypeError(f"fused_backward: {name} must have q's dtype {q.dtype}, got {t.dtype}")
    if tuple(lse.shape) != (B, H, N) or lse.dtype != torch.float32:
        raise ValueError(f"fused_backward: lse must be float32 of shape {(B, H, N)}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"fused_backward: scale must be a positive number, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"fused_backward: causal must be a bool, got {type(causal).__name__}")


def _tma_ready(t: Tensor) -> Tensor:
    """``t`` itself where its strides suit TMA (unit stride along D, 16-byte aligned), else a contiguous copy."""
    from longattn.backends.gluon.launch import _aligned
    return t if _aligned(t) else t.contiguous()


def fused_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
                   causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention of ``q`` over ``(k, v)`` given the output ``o``, its gradient ``do``
    and the natural-log log-sum-exp ``lse`` ``(B, H, N)`` float32, on an sm_90 GPU. q, o, do ``(B, N, H, D)``, k, v
    ``(B, M, H, D)``, float16 or bfloat16, D 64 or 128, one key head per query head. ``causal``: query ``i`` sees
    keys ``j <= i + M - N`` (bottom-right, top-left when ``N == M``). Runs a statistics kernel, the fused kernel,
    then rounds the float32 dQ."""
    _check(do, q, k, v, o, lse, scale, causal)
    from longattn.backends.gluon.launch import _box_strides
    from longattn.backends.triton.launch import _ensure_allocator
    B, N, H, D = q.shape
    M = k.shape[1]
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if N == 0 or M == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    q, k, v, do = (_tma_ready(t) for t in (q, k, v, do))
    o = o if o.stride(-1) == 1 else o.contiguous()
    n_pad = triton.cdiv(N, BLOCK_M) * BLOCK_M
    stats = torch.empty((B * H * 2, n_pad), dtype=torch.float32, device=q.device)
    _row_stats[(triton.cdiv(n_pad, STATS_ROWS), B * H)](
        o, do, lse.contiguous(), stats, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
        do.stride(2), N, H, n_pad, HEAD_D=D, BLOCK=STATS_ROWS)
    dq = torch.zeros((B, N, H, D), dtype=torch.float32, device=q.device)
    _ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    flash_bwd_fused[(triton.cdiv(M, 2 * SUB_N), H, B)](
        q, k, v, do, stats, dq, dk, dv, *_box_strides(q), *_box_strides(k), *_box_strides(v), *_box_strides(do),
        N, M, H, n_pad, float(scale), HEAD_D=D, BLOCK_M=BLOCK_M, SUB_N=SUB_N, CAUSAL=causal,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return dq.mul_(scale).to(q.dtype), dk, dv
