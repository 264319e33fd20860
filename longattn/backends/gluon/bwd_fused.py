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
      dQ   = dS K[:, half of D]                         (both consumers' dS^T through shared memory)

  and add their dQ columns (float32) into a float32 dQ buffer in global memory with a TMA reduce-add: each dQ
  element once per block pair (``SPLIT_DQ``; a barrier per block tells each consumer the other's dS^T is stored).
  Without ``SPLIT_DQ`` (D=64, whose 128-byte rows cannot be split along D), a consumer adds ``dS_h K_h`` of its own
  keys over all of D instead. dK and dV stay in registers and are written once at the end (dK times ``scale``).

The row statistics come from a small Triton kernel (:func:`_row_stats`: ``lse2``, the log-sum-exp in base 2,
``+inf`` for a query that saw no key; ``delta = rowsum(dO * O)``), padded per (batch, head) to whole query blocks, so
the loader brings them into shared memory by TMA with Q and dO. Rows past the query sequence's end load as zeros with
``lse2 = +inf`` (weight 0) and their dQ rows fall outside the dQ descriptor; keys past the key sequence's end load as
zeros and get weight 0, and their dK/dV rows are not stored. The causal band is aligned bottom-right (query
``i`` sees key ``j <= i + seq_k - seq_q``, top-left when the lengths are equal), as everywhere in longattn.

Grouped-query heads: a program owns keys of one key/value head and walks the query blocks of each query head of its
group in turn, so dK and dV are summed over the group in registers; dQ is per query head as before.

:func:`fused_backward` is the entry point; :func:`longattn.backends.gluon.launch.fused_backward` routes the Triton
backend's backward to it (the ``"bwd"`` pass at sm_90) where it measured faster than the two Triton passes.
"""
from __future__ import annotations

import functools
import heapq
from typing import Optional, Tuple

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

from longattn.backends.gluon.tma import aligned, box_strides

# --- The one place that knows Triton versions apart -------------------------------------------------------------
# Triton 3.6 calls the TMA load async_copy_global_to_shared and has no Python wrapper of the TMA reduce-add (the
# builder method exists); 3.7+ name them async_load and async_atomic_add. A shared-memory view of another layout
# is ``_reinterpret`` in 3.6, ``reinterpret`` later.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # the partition's warps
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
def _key_blocks(PAIRED: gl.constexpr, seq_k, BLOCK_N: gl.constexpr):
    """How many key blocks this program owns (1, or 2 when ``PAIRED``: blocks ``p`` and ``last - p``, a long and a
    short causal column, so that every program gets about the same work)."""
    p = gl.program_id(0)
    count = p * 0 + 1
    if PAIRED:
        if gl.cdiv(seq_k, BLOCK_N) - 1 - p != p:
            count += 1
    return count


@gluon.jit
def _key_block(j, PAIRED: gl.constexpr, seq_k, BLOCK_N: gl.constexpr):
    """The ``j``-th key block of this program (``j`` 0 or 1)."""
    p = gl.program_id(0)
    if PAIRED:
        if j > 0:
            p = gl.cdiv(seq_k, BLOCK_N) - 1 - p
    return p


@gluon.jit
def _loader(Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads,
            group, n_batch, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready, empty,
            HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr,
            PAIRED: gl.constexpr):
    """The loader partition: each consumer's K and V rows once, then Q and dO of every query block of every query
    head of the group into the two buffers (a buffer is refilled once both consumers are done with it)."""
    n_kv_heads = n_heads // group
    b = gl.program_id(2)
    h = gl.program_id(1)
    q_desc = tma.make_tensor_descriptor(Q, shape=[n_batch, n_heads, seq_q, HEAD_D], strides=[sqb, sqh, sqn, 1],
                                        block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    do_desc = tma.make_tensor_descriptor(DO, shape=[n_batch, n_heads, seq_q, HEAD_D], strides=[sdb, sdh, sdn, 1],
                                         block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    k_desc = tma.make_tensor_descriptor(K, shape=[n_batch, n_kv_heads, seq_k, HEAD_D], strides=[skb, skh, skn, 1],
                                        block_shape=[1, 1, SUB_N, HEAD_D], layout=BOX16)
    v_desc = tma.make_tensor_descriptor(V, shape=[n_batch, n_kv_heads, seq_k, HEAD_D], strides=[svb, svh, svn, 1],
                                        block_shape=[1, 1, SUB_N, HEAD_D], layout=BOX16)
    stats_desc = tma.make_tensor_descriptor(STATS, shape=[n_batch * n_heads * 2, n_pad], strides=[n_pad, 1],
                                            block_shape=[2, BLOCK_M], layout=ROWS32)
    t0 = 0  # query tiles loaded so far (the buffers' ring position)
    for j in range(_key_blocks(PAIRED, seq_k, 2 * SUB_N)):
        n0 = _key_block(j, PAIRED, seq_k, 2 * SUB_N) * (2 * SUB_N)
        if j > 0:
            mbarrier.wait(kv_free.index(0), 0)  # both consumers are done with the previous key block's K and V
        for half in gl.static_range(2):
            mbarrier.expect(kv_bar.index(half), 2 * k_desc.block_type.nbytes)
            tma_load(k_desc, [b, h, n0 + half * SUB_N, 0], kv_bar.index(half), k_smem.index(half))
            tma_load(v_desc, [b, h, n0 + half * SUB_N, 0], kv_bar.index(half), v_smem.index(half))
        lo, hi = _query_blocks(n0, seq_q, seq_k, BLOCK_M, CAUSAL)
        n_blocks = hi - lo
        for i in range(group * n_blocks):  # query head h * group + i // n_blocks, block lo + i % n_blocks
            t = t0 + i
            st = t % 2
            hq = h * group + i // n_blocks
            m0 = (lo + i % n_blocks) * BLOCK_M
            # A fresh barrier counts as having finished the phase before its first, so the first lap does not wait.
            mbarrier.wait(empty.index(st), ((t // 2) & 1) ^ 1)
            mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma_load(q_desc, [b, hq, m0, 0], ready.index(st), q_smem.index(st))
            tma_load(do_desc, [b, hq, m0, 0], ready.index(st), do_smem.index(st))
            tma_load(stats_desc, [(b * n_heads + hq) * 2, m0], ready.index(st), stats_smem.index(st))
        t0 += group * n_blocks


@gluon.jit
def _send_dq(dq, scale, dq_tile, dq_desc, empty, b, hq, m0, st, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
             DQ_D: gl.constexpr, SPLIT_DQ: gl.constexpr):
    """A finished tile of ``dS K``, times ``scale``, into the float32 dQ by TMA reduce-add, through this consumer's
    staging tile; with ``SPLIT_DQ`` the Q stage ``st`` is released here (its dS read by both consumers' dQ)."""
    if SPLIT_DQ:
        # Q, dO and this stage's dS read for the last time, by this consumer's products and (its dQ being done) the
        # ones reading this consumer's dS: the stage is refilled, and its dS rewritten, after both consumers.
        mbarrier.arrive(empty.index(st), count=1)
    tma.store_wait(0)  # the previous block's reduce-add has read the dQ tile
    dq_tile.reshape([BLOCK_M, DQ_D]).store(dq * scale)
    fence_async_shared()
    tma_reduce_add(dq_desc, [b, hq, m0, HALF * DQ_D if SPLIT_DQ else 0], dq_tile)


@gluon.jit
def _consumer(DQ, DK, DV, seq_q, seq_k, n_heads, group, n_batch, scale, k_smem, v_smem, q_smem, do_smem, stats_smem,
              ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready, HALF: gl.constexpr, HEAD_D: gl.constexpr,
              BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr,
              PAIRED: gl.constexpr):
    """A consumer partition (one warpgroup): keys ``HALF * SUB_N`` on of the program's; their dK and dV (summed
    over the group's query heads), and their share of every query block's dQ: ``dS_half K_half`` (all of D), or
    with ``SPLIT_DQ`` ``dS K[:, half of D]`` from both consumers' dS (one reduce-add per element and block pair)."""
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)
    DQ_D: gl.constexpr = HEAD_D // 2 if SPLIT_DQ else HEAD_D  # dQ columns of this consumer
    DQ_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_D, 16])
    dtype: gl.constexpr = k_smem.dtype
    n_kv_heads = n_heads // group
    b = gl.program_id(2)
    h = gl.program_id(1)
    # dQ is float32 (B, N, H, D) contiguous.
    dq_desc = tma.make_tensor_descriptor(DQ, shape=[n_batch, n_heads, seq_q, HEAD_D],
                                         strides=[seq_q * n_heads * HEAD_D, HEAD_D, n_heads * HEAD_D, 1],
                                         block_shape=[1, 1, BLOCK_M, DQ_D], layout=BOX32)
    shift = seq_k - seq_q
    qk_scale = scale * LOG2E
    dq_tile = dq_smem.index(HALF)
    # The row statistics as (stage * 2 + [lse2, delta], row): the unswizzled TMA tiles read as plain rows.
    stats_rows = reinterpret(stats_smem, gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    k_tile = k_smem.index(HALF).reshape([SUB_N, HEAD_D])
    v_tile = v_smem.index(HALF).reshape([SUB_N, HEAD_D])
    if SPLIT_DQ:
        # Each half's keys, this consumer's half of D (a 128-byte column chunk of the swizzled tiles).
        k_dq0 = k_smem.index(0).reshape([SUB_N, HEAD_D]).slice(HALF * DQ_D, DQ_D, dim=1)
        k_dq1 = k_smem.index(1).reshape([SUB_N, HEAD_D]).slice(HALF * DQ_D, DQ_D, dim=1)
    t0 = 0  # query tiles taken so far (the buffers' ring position, as the loader's)
    for j in range(_key_blocks(PAIRED, seq_k, 2 * SUB_N)):
        n0 = _key_block(j, PAIRED, seq_k, 2 * SUB_N) * (2 * SUB_N)
        lo, hi = _query_blocks(n0, seq_q, seq_k, BLOCK_M, CAUSAL)
        n0 = n0 + HALF * SUB_N  # this consumer's keys
        keys = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ST_LAYOUT))
        mbarrier.wait(kv_bar.index(HALF), j & 1)
        if SPLIT_DQ:
            mbarrier.wait(kv_bar.index(1 - HALF), j & 1)
        dk = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
        dv = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
        n_blocks = hi - lo
        for i in range(group * n_blocks):  # as the loader's
            t = t0 + i
            st = t % 2
            hq = h * group + i // n_blocks
            m0 = (lo + i % n_blocks) * BLOCK_M
            mbarrier.wait(ready.index(st), (t // 2) & 1)
            if SPLIT_DQ:
                ds_all = ds_smem.index(st)  # both consumers' dS^T rows (one buffer per Q stage)
                ds_tile = ds_all.slice(HALF * SUB_N, SUB_N, dim=0)
            else:
                ds_tile = ds_smem.index(0).slice(HALF * SUB_N, SUB_N, dim=0)
                ds_all = ds_tile
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
            if SPLIT_DQ:
                thread_barrier()  # every thread's dS stored before the other consumer is told
                mbarrier.arrive(ds_ready.index(st), count=1)
            dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv,))
            if SPLIT_DQ:
                mbarrier.wait(ds_ready.index(st), (t // 2) & 1)
            if SPLIT_DQ:
                dq = warpgroup_mma(ds_all.slice(0, SUB_N, dim=0).permute((1, 0)), k_dq0,
                                   gl.zeros([BLOCK_M, DQ_D], gl.float32, DQ_LAYOUT), use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_all.slice(SUB_N, SUB_N, dim=0).permute((1, 0)), k_dq1, dq, is_async=True)
            else:
                dq = warpgroup_mma(ds_tile.permute((1, 0)), k_tile, gl.zeros([BLOCK_M, DQ_D], gl.float32, DQ_LAYOUT),
                                   use_acc=False, is_async=True)
            dk = warpgroup_mma_wait(num_outstanding=2 if SPLIT_DQ else 1, deps=(dk,))  # the dQ products go on
            if not SPLIT_DQ:
                mbarrier.arrive(empty.index(st), count=1)  # Q and dO read for the last time
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            _send_dq(dq, scale, dq_tile, dq_desc, empty, b, hq, m0, st, HALF, BLOCK_M, DQ_D, SPLIT_DQ)
        t0 += group * n_blocks
        mbarrier.arrive(kv_free.index(0), count=1)  # this key block's K and V read for the last time
        # DK and DV are contiguous (B, M, Hk, D).
        out_rows = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ACC_LAYOUT))
        d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ACC_LAYOUT))
        offs = ((b.to(gl.int64) * seq_k + out_rows[:, None].to(gl.int64)) * n_kv_heads + h) * HEAD_D + d[None, :]
        ok = (out_rows < seq_k)[:, None]
        gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)
    tma.store_wait(0)


@gluon.jit
def flash_bwd_fused(Q, K, V, DO, STATS, DQ, DK, DV, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh,
                    seq_q, seq_k, n_heads, group, n_batch, n_pad, scale, HEAD_D: gl.constexpr,
                    BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PAIRED: gl.constexpr):
    """Grid ``(cdiv(seq_k, 2 * SUB_N), Hk, B)`` (``Hk = n_heads // group``), or with ``PAIRED`` half as many
    programs along the first axis, each taking key blocks ``p`` and ``last - p``; ``num_warps`` 4 (the loader), two
    consumer warpgroups of ``CONSUMER_REGS`` registers, ``SUB_N`` keys each. Q, dO ``(B, N, H, D)``, K, V
    ``(B, M, Hk, D)`` with unit stride along D (the strides given); a program walks the query blocks of the
    ``group`` query heads of its key/value head. STATS
    float32 ``(B * H * 2, n_pad)``, rows ``lse2`` and ``delta`` per (batch, query head), padded to ``n_pad`` (a
    multiple of ``BLOCK_M``) with ``+inf`` and 0 (:func:`_row_stats`); DQ float32 ``(B, N, H, D)`` contiguous and
    zeroed (dQ is added into it); DK and DV contiguous ``(B, M, Hk, D)`` (any float dtype)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    DS_STAGES: gl.constexpr = 2 if SPLIT_DQ else 1
    DQ_D: gl.constexpr = HEAD_D // 2 if SPLIT_DQ else HEAD_D
    ds_smem = gl.allocate_shared_memory(dtype, [DS_STAGES, 2 * SUB_N, BLOCK_M], TILE16)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, DQ_D], BOX32)
    stats_smem = gl.allocate_shared_memory(gl.float32, [2, 2, BLOCK_M], ROWS32)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_free.index(0), count=2)  # both consumers done with a key block's K and V (PAIRED)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' dS stored (SPLIT_DQ)
        mbarrier.init(kv_bar.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    first: gl.constexpr = 0
    second: gl.constexpr = 1
    gl.warp_specialize([
        (_loader, (Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k,
                   n_heads, group, n_batch, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free,
                   ready, empty, HEAD_D, BLOCK_M, SUB_N, CAUSAL, PAIRED)),
        (_consumer, (DQ, DK, DV, seq_q, seq_k, n_heads, group, n_batch, scale, k_smem, v_smem, q_smem, do_smem,
                     stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready, first, HEAD_D, BLOCK_M,
                     SUB_N, CAUSAL, SPLIT_DQ, PAIRED)),
        (_consumer, (DQ, DK, DV, seq_q, seq_k, n_heads, group, n_batch, scale, k_smem, v_smem, q_smem, do_smem,
                     stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready, second, HEAD_D, BLOCK_M,
                     SUB_N, CAUSAL, SPLIT_DQ, PAIRED)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# --- Launcher ----------------------------------------------------------------------------------------------------

# (BLOCK_M query rows per block, SUB_N keys per consumer: a program owns 2 * SUB_N) per head dim.
TILES = {64: (64, 64), 128: (64, 64)}
SPLIT_DQ = {64: False, 128: True}  # dQ of all the program's keys per consumer, half of D each (docs/kernel_notes.md)
CONSUMER_REGS = 240
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATS_ROWS = 64  # rows per program of the statistics kernel
MAX_GRID = 65535  # CUDA's limit on the grid's second and third dims


@triton.jit
def _row_stats(O, DO, LSE, DLSE, STATS, sob, son, soh, sdb, sdn, sdh, seq, n_heads, n_pad, HEAD_D: tl.constexpr,
               BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``STATS[(b * H + h) * 2 + 0, row] = lse2`` (base 2, ``+inf`` where ``lse`` is ``-inf`` and past the end) and
    ``STATS[... + 1, row] = rowsum(dO * O) - dlse`` (0 past the end), for rows up to ``n_pad``."""
    b = tl.program_id(1) // n_heads
    h = tl.program_id(1) % n_heads
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < seq
    r64 = rows[:, None].to(tl.int64)
    d = tl.arange(0, HEAD_D)[None, :]
    o = tl.load(O + b.to(tl.int64) * sob + h * soh + r64 * son + d, mask=ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdb + h * sdh + r64 * sdn + d, mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = (b.to(tl.int64) * n_heads + h) * seq + rows
    if HAS_DLSE:
        # d lse / d s = P, so an upstream gradient on lse folds into delta: dS = P * (dP - (delta - dlse)).
        delta -= tl.load(DLSE + row, mask=ok, other=0.0).to(tl.float32)
    lse = tl.load(LSE + row, mask=ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    out = STATS + ((b.to(tl.int64) * n_heads + h) * 2) * n_pad + rows
    tl.store(out, lse2, mask=rows < n_pad)
    tl.store(out + n_pad, delta, mask=rows < n_pad)


def _check(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, causal: bool,
           dlse, grad_dtype) -> None:
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
        if (t.dim() != 4 or t.shape[0] != B or t.shape[3] != D or tuple(t.shape) != tuple(k.shape) or t.shape[2] < 1
                or H % t.shape[2]):
            raise ValueError(f"fused_backward: {name} must be (B, M, Hk, D) = ({B}, M, Hk, {D}) with Hk dividing "
                             f"{H} and k's shape, got {tuple(t.shape)}")
    for name, t in (("o", o), ("do", do)):
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"fused_backward: {name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("do", do)):
        if t.dtype != q.dtype:
            raise TypeError(f"fused_backward: {name} must have q's dtype {q.dtype}, got {t.dtype}")
    if tuple(lse.shape) != (B, H, N) or lse.dtype != torch.float32:
        raise ValueError(f"fused_backward: lse must be float32 of shape {(B, H, N)}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    if dlse is not None and (not isinstance(dlse, Tensor) or tuple(dlse.shape) != (B, H, N)):
        raise ValueError(f"fused_backward: dlse must be None or a tensor of shape {(B, H, N)}")
    if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
        raise TypeError(f"fused_backward: grad_dtype must be None or one of {GRAD_DTYPES}, got {grad_dtype}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"fused_backward: scale must be a positive number, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"fused_backward: causal must be a bool, got {type(causal).__name__}")


PROGRAM_COST = 2  # a program's fixed work (K and V in, dK and dV out) in query blocks, for the schedule below
PAIRED_GAIN = 0.9  # pair only where that is predicted to end 10% sooner (measured: docs/kernel_notes.md)


def _makespan(works: list, sms: int) -> float:
    """When the last of ``works`` (in launch order) ends if each goes to the first SM that is free."""
    free = [0.0] * min(sms, len(works))
    heapq.heapify(free)
    for w in works:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


@functools.lru_cache(maxsize=256)
def paired_schedule(causal: bool, seq_q: int, seq_k: int, batch: int, kv_heads: int, group: int, block_m: int,
                    block_n: int, sms: int) -> bool:
    """Whether a program should take two key blocks ``p`` and ``last - p`` (a long and a short causal column)
    rather than one: the one with the earlier predicted end, the programs' work (query blocks they walk, plus
    :data:`PROGRAM_COST`) placed in launch order on the first free SM, pairing only where it is predicted to end
    sooner by the factor :data:`PAIRED_GAIN`. Matters where few programs of very unequal work fill the GPU (causal,
    grouped-query heads: 8 query heads per program). Never for non-causal calls."""
    if not causal:
        return False
    n_q = -(-seq_q // block_m)
    n_k = -(-seq_k // block_n)
    column = [group * (n_q - min(max(n * block_n - (seq_k - seq_q), 0) // block_m, n_q)) + PROGRAM_COST
              for n in range(n_k)]
    pairs = [column[p] + (column[n_k - 1 - p] if n_k - 1 - p != p else 0) for p in range((n_k + 1) // 2)]
    heads = batch * kv_heads
    return _makespan(pairs * heads, sms) < PAIRED_GAIN * _makespan(column * heads, sms)


def _tma_ready(t: Tensor) -> Tensor:
    """``t`` itself where its strides suit TMA (unit stride along D, 16-byte aligned), else a contiguous copy."""
    return t if aligned(t) else t.contiguous()


def fused_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
                   causal: bool, dlse: Optional[Tensor] = None,
                   grad_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention of ``q`` over ``(k, v)`` given the output ``o``, its gradient ``do``
    and the natural-log log-sum-exp ``lse`` ``(B, H, N)`` float32, on an sm_90 GPU. q, o, do ``(B, N, H, D)``, k, v
    ``(B, M, Hk, D)`` (``Hk`` dividing ``H``: grouped-query heads), float16 or bfloat16, D 64 or 128. ``causal``:
    query ``i`` sees keys ``j <= i + M - N`` (bottom-right, top-left when ``N == M``). ``dlse``: an upstream
    gradient on ``lse``; ``grad_dtype``: the gradients' dtype (default the inputs'). Runs a statistics kernel, the
    fused kernel, then rounds the float32 dQ; the gradients are contiguous."""
    _check(do, q, k, v, o, lse, scale, causal, dlse, grad_dtype)
    from longattn.backends.triton.launch import _ensure_allocator
    B, N, H, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    grad_dtype = grad_dtype or q.dtype
    dk = torch.empty(k.shape, dtype=grad_dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=grad_dtype, device=v.device)
    if N == 0 or M == 0:
        return torch.zeros(q.shape, dtype=grad_dtype, device=q.device), dk.zero_(), dv.zero_()
    block_m, sub_n = TILES[D]
    q, k, v, do = (_tma_ready(t) for t in (q, k, v, do))
    o = o if o.stride(-1) == 1 else o.contiguous()
    n_pad = triton.cdiv(N, block_m) * block_m
    stats = torch.empty((B * H * 2, n_pad), dtype=torch.float32, device=q.device)
    lse = lse.contiguous()
    _row_stats[(triton.cdiv(n_pad, STATS_ROWS), B * H)](
        o, do, lse, lse if dlse is None else dlse.contiguous(), stats, o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2), N, H, n_pad, HEAD_D=D, BLOCK=STATS_ROWS, HAS_DLSE=dlse is not None)
    dq = torch.zeros((B, N, H, D), dtype=torch.float32, device=q.device)
    _ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    key_blocks = triton.cdiv(M, 2 * sub_n)
    paired = paired_schedule(causal, N, M, B, Hk, H // Hk, block_m, 2 * sub_n,
                             torch.cuda.get_device_properties(q.device).multi_processor_count)
    grid = (triton.cdiv(key_blocks, 2) if paired else key_blocks, Hk, B)
    flash_bwd_fused[grid](
        q, k, v, do, stats, dq, dk, dv, *box_strides(q), *box_strides(k), *box_strides(v), *box_strides(do),
        N, M, H, H // Hk, B, n_pad, float(scale), HEAD_D=D, BLOCK_M=block_m, SUB_N=sub_n, CAUSAL=causal,
        SPLIT_DQ=SPLIT_DQ[D], CONSUMER_REGS=CONSUMER_REGS, PAIRED=paired, num_warps=4)
    return dq.to(grad_dtype), dk, dv
