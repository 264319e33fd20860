"""Fused Hopper (sm_90a) attention backward in Gluon: dQ, dK and dV in one kernel, five products per block pair.

One program owns ``BLOCK_N = 2 * SUB_N`` keys of one (batch, head) and walks every query block (``BLOCK_M`` rows)
that can see them (FlashAttention-3's scheme). Three partitions:

- the **loader** (one warp at 24 registers; the first consumer is the default partition) loads the program's K and
  V once, one ``SUB_N``-row half per consumer, then the Q and dO tiles of every query block into two buffers by TMA;
- two **consumers** (one warpgroup each, ``SUB_N`` of the keys each, 240 registers) take every query block. With
  their K and V rows resident, per block::

      S^T  = K Q^T,  dP^T = V dO^T                      (issued together, asynchronously)
      P^T  = exp2(S^T * scale * log2(e) - lse2)         (soft-capped, ALiBi; masked where the band cuts the block)
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
zeros and get weight 0, and their dK/dV rows are not stored. The band is aligned bottom-right (query ``i`` sees
key ``j`` for ``i + shift - left <= j <= i + shift + right``, ``shift = seq_k - seq_q``; causal: ``right = 0``), as
everywhere in longattn; soft-capping multiplies P by ``1 - tanh^2`` for dS. Attention sinks need nothing here: the
log-sum-exp given counts them.

Grouped-query heads: a program owns keys of one key/value head and walks the query blocks of each query head of its
group in turn, so dK and dV are summed over the group in registers; dQ is per query head as before.

Packed batches: the grid runs over a work table (:func:`longattn.backends.gluon.packed.work_table`: sequence, key
block, statistics column per program, the longest columns first); each partition builds its descriptors from the
sequence's first row with the sequence's lengths. Block-sparse calls: a program walks the query blocks that the
block lists give its key block (:func:`_query_walk`).

The device-side parts this kernel shares with the D = 256 one (:mod:`longattn.backends.gluon.bwd_fused_wide`: the
loader, the query walk, the probabilities, the dK/dV store) are in :mod:`longattn.backends.gluon.bwd_parts`.

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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from longattn.backends.gluon.bwd_parts import (BOX16, BOX32, LOG2E, ROWS32, TILE16, _dkdv_descriptor, _dq_descriptor,
                                               _key_block, _key_blocks, _loader, _probabilities, _query_start,
                                               _query_walk, _kv_head, _sequence, _store_dkdv, _store_dkdv_tma,
                                               reinterpret, thread_barrier, tma_reduce_add)
from longattn.backends.gluon import shapes
from longattn.backends.gluon.tma import aligned, bhnd_descriptor, box_strides, matrix_descriptor
from longattn.backends.gluon.workspace import Workspace, make_workspace
from longattn.backends.cached_launch import launch
from longattn.backends import device as _device
from longattn.backends.kernel_args import cdiv as _cdiv, ensure_allocator as _ensure_allocator
from longattn.call import Band

# One lane of a consumer warpgroup (its 128 threads), for the turn counters' asm and atomics.
LANES: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])


@gluon.jit
def _asm(lanes, code: gl.constexpr):
    """Run the PTX ``code`` once in every thread (``lanes``: one element a thread)."""
    gl.inline_asm_elementwise(code + " mov.u32 $0, 0;", "=r,r", [lanes], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_turn(turn, target):
    """Wait until the counter ``turn`` reaches ``target`` (the dQ adds before this one are done)."""
    while gl.load(turn, volatile=True) < target:
        pass
    lanes = gl.arange(0, 128, layout=LANES)
    # what the counter's writers released is seen here, also by the reduce-add (the async proxy) issued next
    _asm(lanes, "fence.acq_rel.gpu; fence.proxy.async.global;")


@gluon.jit
def _pass_turn(turn):
    """Count this consumer's dQ add as done, once its writes are: the next in the order may add."""
    lanes = gl.arange(0, 128, layout=LANES)
    _asm(lanes, "cp.async.bulk.wait_group 0; fence.proxy.async.global;")  # the reduce-add's writes performed
    thread_barrier()  # (the thread that issued it has waited)
    gl.atomic_add(turn + lanes * 0, lanes * 0 + 1, mask=lanes == 0, sem="release", scope="gpu")


@gluon.jit
def _send_dq(dq, scale, dq_tile, dq_desc, empty, bq, hq, m0, st, turn, target, pending, has_pending,
             HALF: gl.constexpr, BLOCK_M: gl.constexpr, DQ_D: gl.constexpr, SPLIT_DQ: gl.constexpr,
             DETERMINISTIC: gl.constexpr):
    """A finished tile of ``dS K``, times ``scale``, into the float32 dQ by TMA reduce-add, through this consumer's
    staging tile; with ``SPLIT_DQ`` the Q stage ``st`` is released here (its dS read by both consumers' dQ). With
    ``DETERMINISTIC`` the add waits for its turn: the counter ``turn`` of this query block (one per batch, query head
    and block) at ``target`` (:func:`_dq_turn`). It counts itself done one block later (the previous block's add,
    ``pending`` where ``has_pending``, is counted here, before this one waits), so that the add's round trip
    overlaps the next block's products instead of stalling them. ``bq``: the batch coordinate of ``dq_desc`` (0
    for a sequence's descriptor). Returns the counter to count next (:func:`_pass_turn` after the last)."""
    if SPLIT_DQ:
        # Q, dO and this stage's dS read for the last time, by this consumer's products and (its dQ being done) the
        # ones reading this consumer's dS: the stage is refilled, and its dS rewritten, after both consumers.
        mbarrier.arrive(empty.index(st), count=1)
    tma.store_wait(0)  # the previous block's reduce-add has read the dQ tile
    dq_tile.reshape([BLOCK_M, DQ_D]).store(dq * scale)
    fence_async_shared()
    if DETERMINISTIC:
        if has_pending:
            _pass_turn(pending)
        _wait_turn(turn, target)
    tma_reduce_add(dq_desc, [bq, hq, m0, HALF * DQ_D if SPLIT_DQ else 0], dq_tile)
    return turn


@gluon.jit
def _dq_turn(kb, m, n_kb, shift, right, HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HAS_RIGHT: gl.constexpr, SPLIT_DQ: gl.constexpr):
    """Where the dQ add of key block ``kb`` (``BLOCK_N`` keys) into query block ``m`` comes in the fixed order of
    that block's adds: the key blocks that walk ``m`` (:func:`_query_blocks`: a range of them, up to the last one
    whose walk starts at or before ``m``) from the last to the first, a program's two consumers together (their
    halves of D) or, adding to the same columns, consumer 0 first. From the last: in that order the adds come as the
    programs reach them (a later key block's walk starts at an earlier query block), and the last key blocks'
    programs start first (the grid, :func:`_sequence`'s ``HEADS_FIRST``), so no turn waits on a program not yet
    started."""
    last = n_kb - 1
    if HAS_RIGHT:  # (kb walks m, so kb * BLOCK_N <= the numerator: it is >= 0)
        last = gl.minimum(last, ((m + 1) * BLOCK_M - 1 + shift + right) // BLOCK_N)
    return 2 * (last - kb) + (0 if SPLIT_DQ else HALF)


@gluon.jit
def _consumer(DQ, DK, DV, DK_DESC, DV_DESC, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, TURNS, seq_q, seq_k, n_heads,
              group, n_batch,
              n_work, n_pad, scale, left, right, softcap, alibi_offset, list_sb, list_sh, list_w, k_smem, v_smem,
              q_smem, do_smem, stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready,
              HALF: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SPLIT_DQ: gl.constexpr, PAIRED: gl.constexpr,
              VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, CAUSAL: gl.constexpr,
              USE_LIST: gl.constexpr, LIST_M: gl.constexpr, LIST_N: gl.constexpr, DETERMINISTIC: gl.constexpr,
              DKV_TMA: gl.constexpr, HOST_DESC: gl.constexpr):
    """A consumer partition (one warpgroup): keys ``HALF * SUB_N`` on of the program's; their dK and dV (summed
    over the group's query heads), and their share of every query block's dQ: ``dS_half K_half`` (all of D), or
    with ``SPLIT_DQ`` ``dS K[:, half of D]`` from both consumers' dS (one reduce-add per element and block pair).
    ``HOST_DESC``: DQ, DK_DESC and DV_DESC are host-made descriptors of every batch row (coordinate ``b``)."""
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)
    DQ_D: gl.constexpr = HEAD_D // 2 if SPLIT_DQ else HEAD_D  # dQ columns of this consumer
    DQ_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_D, 16])
    COLS: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)  # a value per query row (the columns of S^T)
    dtype: gl.constexpr = k_smem.dtype
    if CAUSAL:
        right = 0  # known at compile time
    n_kv_heads = n_heads // group
    h = _kv_head(DETERMINISTIC)
    b, s, p, nq, nk, q0, k0, stats_col0 = _sequence(CU_Q, CU_K, WORK, n_work, seq_q, seq_k, VARLEN, DETERMINISTIC,
                                                    2 * SUB_N)
    if HOST_DESC:
        dq_desc = DQ
        bq = b
    else:
        dq_desc = _dq_descriptor(DQ, b, q0, nq, seq_q, n_heads, HEAD_D, BLOCK_M, DQ_D)
        bq = 0
    # DKV_TMA: dK's and dV's descriptors built before the loop (at the end, their arguments would live across it)
    if DKV_TMA:
        if HOST_DESC:
            dk_desc = DK_DESC
            dv_desc = DV_DESC
        else:
            dk_desc = _dkdv_descriptor(DK, b, seq_k, k0, nk, n_kv_heads, HEAD_D, SUB_N)
            dv_desc = _dkdv_descriptor(DV, b, seq_k, k0, nk, n_kv_heads, HEAD_D, SUB_N)
    else:
        dk_desc = dq_desc  # (not read)
        dv_desc = dq_desc
    shift = nk - nq
    qk_scale = scale * LOG2E
    # The row statistics enter as the S^T and dP^T products' initial accumulators (S^T - lse2 / qk_scale, dP^T -
    # delta), as in bwd_wide_tile.py: no per-query values (16 registers a thread each) stay live beside the tiles.
    # lse2 only where the scores are not modified (soft-capping and ALiBi act on S itself, before lse2). D=128
    # (SPLIT_DQ) only: at D=64 registers are not short and the folds cost instructions (measured).
    STATS_IN_ACC: gl.constexpr = SPLIT_DQ
    LSE_IN_S: gl.constexpr = STATS_IN_ACC and not (SOFTCAP or ALIBI)
    inv_qk_scale = 1.0 / qk_scale
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
    pending = TURNS  # (DETERMINISTIC) the turn counter of the last dQ add, counted once that add is done
    has_pending = 0
    n_kb = _key_blocks(p, nk, PAIRED, 2 * SUB_N)
    for j in range(n_kb):
        n0 = _key_block(p, j, nk, PAIRED, 2 * SUB_N) * (2 * SUB_N)
        lo, n_blocks, row = _query_walk(n0, nq, nk, left, right, b, h, group, Q_NUM, list_sb, list_sh, BLOCK_M,
                                        2 * SUB_N, HAS_LEFT, HAS_RIGHT, USE_LIST, LIST_M, LIST_N)
        n0 = n0 + HALF * SUB_N  # this consumer's keys
        keys = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ST_LAYOUT))
        # Per key row, a 0 that the compiler cannot fold: with a plain broadcast of a per-query value the two rows of
        # a thread share a register, and the copies the product needs (distinct registers) land after the wgmma
        # fence, where ptxas first waits for S^T (C7517: S^T and dP^T serialised; bwd_wide_tile.py).
        kzero = keys.to(gl.float32) * 0.0
        mbarrier.wait(kv_bar.index(HALF), j & 1)
        if SPLIT_DQ:
            mbarrier.wait(kv_bar.index(1 - HALF), j & 1)
        dk = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
        dv = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
        for i in range(group * n_blocks):  # as the loader's
            t = t0 + i
            st = t % 2
            hq = h * group + i // n_blocks
            m0 = _query_start(i % n_blocks, lo, row, Q_IDX, list_w, BLOCK_M, USE_LIST, LIST_M)
            slope = qk_scale * 0.0
            if ALIBI:  # SLOPES (sequences, H) float32: this sequence's and query head's slope, in base 2
                slope = gl.load(SLOPES + s * n_heads + hq) * LOG2E
            mbarrier.wait(ready.index(st), (t // 2) & 1)
            if SPLIT_DQ:
                ds_all = ds_smem.index(st)  # both consumers' dS^T rows (one buffer per Q stage)
                ds_tile = ds_all.slice(HALF * SUB_N, SUB_N, dim=0)
            else:
                ds_tile = ds_smem.index(0).slice(HALF * SUB_N, SUB_N, dim=0)
                ds_all = ds_tile
            q_tile = q_smem.index(st).reshape([BLOCK_M, HEAD_D])
            do_tile = do_smem.index(st).reshape([BLOCK_M, HEAD_D])
            if STATS_IN_ACC:
                lse2 = stats_rows.index(2 * st).load(COLS)
                delta = stats_rows.index(2 * st + 1).load(COLS)
                if LSE_IN_S:
                    s_init = kzero[:, None] - (lse2 * inv_qk_scale)[None, :]
                else:
                    s_init = kzero[:, None] + gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT)
                dp_init = kzero[:, None] - delta[None, :]
                s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, is_async=True)
                dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), dp_init, is_async=True)
            else:
                s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)),
                                    gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT), use_acc=False, is_async=True)
                dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)),
                                     gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT), use_acc=False, is_async=True)
                lse2 = stats_rows.index(2 * st).load(COLS)
            rows = m0 + gl.arange(0, BLOCK_M, layout=COLS)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
            # D=128 (SPLIT_DQ): the consumers' registers are short, ALiBi's distances tied to the scores.
            p_t, tanh_t = _probabilities(s_t, keys, rows, n0, m0, nk, shift, left, right, qk_scale, lse2, softcap,
                                         slope, alibi_offset, ST_LAYOUT, SUB_N, BLOCK_M, HAS_LEFT, HAS_RIGHT,
                                         SOFTCAP, ALIBI, SPLIT_DQ, LSE_IN_S)
            pl_t = p_t.to(dtype)  # dV's operand; its product is issued after dS, once P^T's float32 copy is dead
            if SOFTCAP:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2, folded into P for dS
                p_t = p_t * (1.0 - tanh_t * tanh_t)
            if STATS_IN_ACC:
                dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
                ds_t = (p_t * dp_t).to(dtype)  # P^T (dP^T - delta)
            else:
                delta = stats_rows.index(2 * st + 1).load(COLS)
                dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
                ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
            dv = warpgroup_mma(gl.convert_layout(pl_t, OP_LAYOUT), do_tile, dv, is_async=True)
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
            turn = TURNS
            target = 0
            if DETERMINISTIC:  # (dense calls: one turn counter per batch row, query head and query block)
                turn = TURNS + (b * n_heads + hq) * (n_pad // BLOCK_M) + m0 // BLOCK_M
                target = _dq_turn((n0 - HALF * SUB_N) // (2 * SUB_N), m0 // BLOCK_M, gl.cdiv(nk, 2 * SUB_N), shift,
                                  right, HALF, BLOCK_M, 2 * SUB_N, HAS_RIGHT, SPLIT_DQ)
            pending = _send_dq(dq, scale, dq_tile, dq_desc, empty, bq, hq, m0, st, turn, target, pending, has_pending,
                               HALF, BLOCK_M, DQ_D, SPLIT_DQ, DETERMINISTIC)
            has_pending = 1
        if DETERMINISTIC:
            if has_pending:  # the key block's last add, counted once done
                _pass_turn(pending)
            has_pending = 0
        t0 += group * n_blocks
        mbarrier.arrive(kv_free.index(0), count=1)  # this key block's K and V read for the last time
        if DKV_TMA:
            # dK and dV through this consumer's K and V tiles, by TMA, after the program's last key block: the
            # loader loads no more K or V then, and this consumer's products are done (their waits above). Its V
            # tile is its own; its K tile is also read by the other consumer's dQ products (SPLIT_DQ), done once
            # that consumer too has arrived on kv_free (after its last dQ wait). Before a PAIRED program's second
            # key block the loader refills the tiles (once kv_free completes): dK and dV leave by plain stores.
            if PAIRED:
                if j == n_kb - 1:
                    _store_dkdv_tma(dk_desc, dv_desc, dk, dv, scale, n0, h, k_smem.index(HALF),
                                    v_smem.index(HALF), kv_free.index(0), j & 1, HEAD_D, SUB_N, SPLIT_DQ, bq)
                else:
                    _store_dkdv(DK, DV, dk, dv, scale, b, seq_k, k0, n0, 0, nk, n_kv_heads, h, HEAD_D, SUB_N, HEAD_D,
                                ACC_LAYOUT)
            else:
                _store_dkdv_tma(dk_desc, dv_desc, dk, dv, scale, n0, h, k_smem.index(HALF),
                                v_smem.index(HALF), kv_free.index(0), j & 1, HEAD_D, SUB_N, SPLIT_DQ, bq)
        else:
            _store_dkdv(DK, DV, dk, dv, scale, b, seq_k, k0, n0, 0, nk, n_kv_heads, h, HEAD_D, SUB_N, HEAD_D,
                        ACC_LAYOUT)
    tma.store_wait(0)


@gluon.jit
def flash_bwd_fused(Q, K, V, DO, STATS, DQ, DK, DV, DK_DESC, DV_DESC, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, TURNS,
                    sqb, sqn, sqh,
                    skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads, group, n_batch, n_pad, n_work,
                    scale, left, right, softcap, alibi_offset, list_sb, list_sh, list_w, HEAD_D: gl.constexpr,
                    BLOCK_M: gl.constexpr, SUB_N: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SPLIT_DQ: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PAIRED: gl.constexpr, VARLEN: gl.constexpr = False,
                    SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, CAUSAL: gl.constexpr = False,
                    USE_LIST: gl.constexpr = False, LIST_M: gl.constexpr = 64, LIST_N: gl.constexpr = 128,
                    DETERMINISTIC: gl.constexpr = False, DKV_TMA: gl.constexpr = False,
                    HOST_DESC: gl.constexpr = False):
    """Grid ``(cdiv(seq_k, 2 * SUB_N), Hk, B)`` (``Hk = n_heads // group``), with ``PAIRED`` half as many programs
    along the first axis, each taking key blocks ``p`` and ``last - p``; with ``VARLEN`` ``(n_work, Hk, 1)``, a
    program per row of the work table; with ``DETERMINISTIC`` (dense calls, not ``PAIRED``) ``(Hk, B, cdiv(seq_k,
    2 * SUB_N))``, the last key blocks first, and dQ added in a fixed order: ``TURNS`` int32 ``(B * H * n_pad /
    BLOCK_M,)`` zeroed, a counter per query block of the adds done (:func:`_dq_turn`). ``num_warps`` 4 (the first
    consumer), a one-warp loader, two consumer warpgroups of ``CONSUMER_REGS`` registers, ``SUB_N`` keys each. Q,
    dO ``(B, N, H, D)``, K, V ``(B, M, Hk, D)`` with unit stride along D (the strides given; a packed batch has
    ``B = 1`` and its sequences' rows at
    ``CU_Q``/``CU_K``); a program walks the query blocks of the ``group`` query heads of its key/value head. The band:
    query ``i`` sees key ``j`` for ``i + shift - left <= j <= i + shift + right`` (``shift`` the sequence's keys minus
    queries; ``HAS_LEFT`` / ``HAS_RIGHT`` whether a side is bounded; ``CAUSAL``: ``right`` is 0, folded at compile
    time). ``SOFTCAP``: scores capped at ``softcap``; ``ALIBI``: ``SLOPES`` float32 ``(sequences, H)``, distances
    shifted by ``alibi_offset``. STATS float32 ``(B * H * 2, n_pad)``, rows ``lse2`` and ``delta`` per (batch, query
    head), padded to whole query blocks with ``+inf`` and 0 (a packed batch: ``(H * 2, n_pad)``, each sequence from a whole
    block on, :func:`_row_stats`); DQ float32 ``(B, N, H, D)`` contiguous and zeroed (dQ is added into it); DK and
    DV contiguous ``(B, M, Hk, D)`` (any float dtype). ``USE_LIST``: block-sparse attention, a program walking the
    query blocks the block lists give its key block (``Q_NUM``/``Q_IDX`` of
    :class:`longattn.backends.triton.lists.BlockLists`, blocks of ``LIST_M`` queries and ``LIST_N`` keys, multiples
    of ``BLOCK_M`` and ``2 * SUB_N``; row strides ``list_sb``, ``list_sh`` (0 where the mask is shared), ``list_w``
    entries a row), the band masking inside the blocks it cuts. ``DKV_TMA`` (DK and DV of Q's dtype): each consumer
    writes its dK and dV of the program's last key block through its own K and V tiles and TMA stores
    (:func:`longattn.backends.gluon.bwd_parts._store_dkdv_tma`; a ``PAIRED`` program's first key block by plain
    stores). ``HOST_DESC`` (dense calls): Q, K, V, DO, STATS and DQ are descriptors made on the host, over every
    batch row, and DK_DESC, DV_DESC (``DKV_TMA``) those of DK and DV (:func:`host_descriptors_of`): no program
    makes one (each a round trip to global memory, one after another in the loader); without it DK_DESC and
    DV_DESC are not read."""
    gl.static_assert(not (HOST_DESC and VARLEN), "host descriptors span dense batch rows, not packed sequences")
    dtype: gl.constexpr = Q.dtype if HOST_DESC else Q.dtype.element_ty  # (a descriptor's: its elements')
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
    two_parts: gl.constexpr = 2
    gl.warp_specialize([
        (_consumer, (DQ, DK, DV, DK_DESC, DV_DESC, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, TURNS, seq_q, seq_k, n_heads,
                     group, n_batch, n_work, n_pad, scale, left, right, softcap, alibi_offset, list_sb, list_sh,
                     list_w, k_smem, v_smem, q_smem, do_smem, stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready,
                     empty, ds_ready, first, HEAD_D, BLOCK_M, SUB_N, HAS_LEFT, HAS_RIGHT, SPLIT_DQ, PAIRED, VARLEN,
                     SOFTCAP, ALIBI, CAUSAL, USE_LIST, LIST_M, LIST_N, DETERMINISTIC, DKV_TMA, HOST_DESC)),
        (_loader, (Q, K, V, DO, STATS, CU_Q, CU_K, WORK, Q_NUM, Q_IDX, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh,
                   sdb, sdn, sdh, seq_q, seq_k, n_heads, group, n_batch, n_pad, n_work, left, right, list_sb, list_sh,
                   list_w, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready, empty, HEAD_D, BLOCK_M,
                   2 * SUB_N, HAS_LEFT, HAS_RIGHT, PAIRED, VARLEN, CAUSAL, USE_LIST, LIST_M, LIST_N, two_parts,
                   BOX16, DETERMINISTIC, HOST_DESC)),
        (_consumer, (DQ, DK, DV, DK_DESC, DV_DESC, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, TURNS, seq_q, seq_k, n_heads,
                     group, n_batch, n_work, n_pad, scale, left, right, softcap, alibi_offset, list_sb, list_sh,
                     list_w, k_smem, v_smem, q_smem, do_smem, stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready,
                     empty, ds_ready, second, HEAD_D, BLOCK_M, SUB_N, HAS_LEFT, HAS_RIGHT, SPLIT_DQ, PAIRED, VARLEN,
                     SOFTCAP, ALIBI, CAUSAL, USE_LIST, LIST_M, LIST_N, DETERMINISTIC, DKV_TMA, HOST_DESC)),
    ], [1, 4], [24, CONSUMER_REGS])


# --- Launcher ----------------------------------------------------------------------------------------------------

TILES = shapes.FUSED_BWD_TILES  # (BLOCK_M, SUB_N) per head dim
# dQ of all the program's keys per consumer, half of D each (docs/kernel_notes.md); D=256 runs
# bwd_fused_wide.flash_bwd_fused_wide, whose consumers always split D.
SPLIT_DQ = {64: False, 128: True, 256: True}
CONSUMER_REGS = 240
HEAD_DIMS = shapes.FUSED_BWD_HEAD_DIMS
DETERMINISTIC_HEAD_DIMS = shapes.DETERMINISTIC_BWD_HEAD_DIMS
# dK and dV out by TMA stores through shared memory (flash_bwd_fused's DKV_TMA) per head dim, where the gradients
# have the inputs' dtype (docs/kernel_notes.md, twenty-eighth session: D=128 measured faster, D=64 even)
DKV_TMA = {64: False, 128: True}
DTYPES = shapes.DTYPES
GRAD_DTYPES = tuple(d for d in shapes.FUSED_BWD_GRAD_DTYPES if d is not None)


@triton.jit
def _row_stats(O, DO, LSE, DLSE, STATS, BLOCK_SEQ, CU_Q, QB, sob, son, soh, sdb, sdn, sdh, seq, n_heads, n_pad, n_seqs,
               HEAD_D: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr):
    """``STATS[(b * H + h) * 2 + 0, row] = lse2`` (base 2, ``+inf`` where ``lse`` is ``-inf`` and past the end) and
    ``STATS[... + 1, row] = rowsum(dO * O) - dlse`` (0 past the end), for rows up to ``n_pad``. A packed batch
    (``VARLEN``, ``b = 0``): column block ``g`` holds rows of sequence ``BLOCK_SEQ[g]``, whose rows start at block
    ``QB[s]`` (``BLOCK`` the kernel's query block), padded to whole blocks."""
    blocks = n_pad // BLOCK
    g = tl.program_id(0) % blocks  # one program per (batch x head, column block): a 1-D grid has no 65535 limit
    bh = tl.program_id(0) // blocks
    h = bh % n_heads
    cols = g * BLOCK + tl.arange(0, BLOCK)
    if VARLEN:
        b = bh * 0
        s = tl.load(BLOCK_SEQ + g)
        s_ok = tl.minimum(s, n_seqs - 1)
        start = tl.load(CU_Q + s_ok)
        rows = (g - tl.load(QB + s_ok)) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < tl.where(s < n_seqs, tl.load(CU_Q + s_ok + 1) - start, 0)  # (no rows past the last sequence)
        rows += start  # the packed tensor's rows
    else:
        b = bh // n_heads
        rows = cols
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
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    out = STATS + ((b.to(tl.int64) * n_heads + h) * 2) * n_pad + cols
    tl.store(out, lse2, mask=cols < n_pad)
    tl.store(out + n_pad, delta, mask=cols < n_pad)


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


def _check_options(q: Tensor, window, softcap, slopes, alibi_offset, cu_seqlens) -> int:
    """Checks the keyword options of :func:`fused_backward`; returns the number of sequences (``B``, or those of
    the packed batch)."""
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"fused_backward: window must be two ints >= -1 (-1: unbounded), got {window!r}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not softcap >= 0:
        raise ValueError(f"fused_backward: softcap must be a number >= 0 (0: off), got {softcap!r}")
    if not isinstance(alibi_offset, int) or isinstance(alibi_offset, bool):
        raise TypeError(f"fused_backward: alibi_offset must be an int, got {type(alibi_offset).__name__}")
    n_seqs = q.shape[0]
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"fused_backward: a packed batch (cu_seqlens) has q of shape (1, total, H, D), got "
                             f"{tuple(q.shape)}")
        if (not isinstance(cu_seqlens, (tuple, list)) or len(cu_seqlens) != 2
                or not all(isinstance(c, Tensor) and c.dtype == torch.int32 and c.dim() == 1 and c.device == q.device
                           for c in cu_seqlens) or cu_seqlens[0].shape != cu_seqlens[1].shape
                or cu_seqlens[0].numel() < 2):
            raise ValueError("fused_backward: cu_seqlens must be a pair (cu_q, cu_k) of int32 (sequences + 1,) "
                             "tensors on q's device")
        n_seqs = cu_seqlens[0].numel() - 1
    if slopes is not None and (not isinstance(slopes, Tensor) or slopes.dtype != torch.float32
                               or tuple(slopes.shape) != (n_seqs, q.shape[2]) or not slopes.is_contiguous()):
        raise ValueError(f"fused_backward: slopes must be None or float32 contiguous of shape {(n_seqs, q.shape[2])} "
                         "(sequences, query heads)")
    return n_seqs


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


def why_not_lists(lists, list_block, batch: int, heads: int, kv_heads: int, packed: bool,
                  head_dim: int = 128) -> Optional[str]:
    """Why the fused kernel does not take these block lists (None when it does): blocks of a multiple of its query
    block (64 rows) and key block (128 keys, 64 at D = 256), lists per batch row and query head or shared, the same
    list for every query head of a program (shared lists, or one query head per key/value head), not a packed
    batch."""
    if packed:
        return "block lists of a packed batch"
    if list_block is None or len(list_block) != 2:
        return "no list block size"
    block_m, sub_n = TILES[head_dim]
    bq, bk = list_block
    if bq % block_m or bk % (2 * sub_n):
        return f"blocks of {bq} x {bk} (the kernel needs multiples of {block_m} queries and {2 * sub_n} keys)"
    q_num, q_idx = lists
    if q_idx.dim() != 4 or q_num.dim() != 4 or q_idx.shape[0] not in (1, batch) or q_idx.shape[1] not in (1, heads):
        return "block lists of an unexpected shape"
    if q_idx.shape[1] > 1 and heads != kv_heads:
        return "per-head block lists with grouped-query heads"
    return None


def host_descriptors_of(q: Tensor, k: Tensor, v: Tensor, do: Tensor, stats: Tensor, dq: Tensor, dk: Tensor,
                        dv: Tensor, dkv_tma: bool) -> tuple:
    """:func:`flash_bwd_fused`'s ``HOST_DESC`` parameters ``(Q, K, V, DO, STATS, DQ, DK, DV, DK_DESC, DV_DESC)``: the
    descriptors its programs otherwise make, over every batch row (q, k, v, do, the float32 dq ``(B, N, H, D)`` and
    dk, dv ``(B, M, Hk, D)`` read as ``(B, H, N, D)``; the statistics ``(B·H·2, n_pad)``), with the same boxes and
    layouts; DK and DV stay pointers, and their descriptors are made only with ``dkv_tma``."""
    D = q.shape[3]
    block_m, sub_n = TILES[D]
    dk_desc, dv_desc = ((bhnd_descriptor(dk, sub_n, BOX16), bhnd_descriptor(dv, sub_n, BOX16)) if dkv_tma
                        else (dk, dv))
    return (bhnd_descriptor(q, block_m, BOX16), bhnd_descriptor(k, sub_n, BOX16), bhnd_descriptor(v, sub_n, BOX16),
            bhnd_descriptor(do, block_m, BOX16), matrix_descriptor(stats, (2, block_m), ROWS32),
            bhnd_descriptor(dq, block_m, BOX32, D // 2 if SPLIT_DQ[D] else D), dk, dv, dk_desc, dv_desc)


def fused_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
                   causal: bool, dlse: Optional[Tensor] = None, grad_dtype: Optional[torch.dtype] = None, *,
                   window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, slopes: Optional[Tensor] = None,
                   alibi_offset: int = 0, cu_seqlens: Optional[Tuple[Tensor, Tensor]] = None,
                   lists: Optional[Tuple[Tensor, Tensor]] = None,
                   list_block: Optional[Tuple[int, int]] = None,
                   deterministic: bool = False, workspace: Optional[Workspace] = None,
                   host_descriptors: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention of ``q`` over ``(k, v)`` given the output ``o``, its gradient ``do``
    and the natural-log log-sum-exp ``lse`` ``(B, H, N)`` float32, on an sm_90 GPU. q, o, do ``(B, N, H, D)``, k, v
    ``(B, M, Hk, D)`` (``Hk`` dividing ``H``: grouped-query heads), float16 or bfloat16, D 64, 128 or 256 (D = 256
    by :mod:`longattn.backends.gluon.bwd_fused_wide`).

    ``causal``: query ``i`` sees keys ``j <= i + M - N`` (bottom-right, top-left when ``N == M``); ``window =
    (left, right)``: keys ``i + M - N - left <= j <= i + M - N + right`` (-1: unbounded; causal caps ``right`` at
    0). ``softcap`` (> 0): scores ``softcap * tanh(s / softcap)``; ``slopes`` float32 ``(B, H)`` (ALiBi):
    ``- slope * |i + M - N + alibi_offset - j|`` added after. ``cu_seqlens = (cu_q, cu_k)``: a packed batch, int32
    ``(sequences + 1,)``, q, k, v, o, do with one batch row (``(1, total, H, D)``), ``lse`` ``(1, H, total)``,
    ``slopes`` per sequence; lengths, the band and ALiBi distances per sequence. ``dlse``: an upstream gradient on
    ``lse``; ``grad_dtype``: the gradients' dtype (default the inputs'). ``lists = (q_num, q_idx)`` and
    ``list_block = (block_q, block_k)``: block-sparse attention, the query blocks of every key block as
    :class:`longattn.backends.triton.lists.BlockLists` holds them (:func:`why_not_lists` says which block sizes and
    list shapes the kernel takes). ``deterministic``: dQ's float32 adds in a fixed order (bitwise-equal gradients
    from run to run; dense calls at D = 64 and 128, neither a packed batch nor block lists). ``workspace``: the
    buffers the launches write (:mod:`longattn.backends.gluon.workspace`; made here where None: a caller that
    records the launches passes its own, to name them). ``host_descriptors`` (calls without a packed batch at D = 64 and
    128; the planner's option, ``Routing.fused_bwd_host_descriptor_head_dims``): the kernel's TMA descriptors made
    here (:func:`host_descriptors_of`) rather than by every program (the launcher encodes them on every launch; a
    replay copies them over its tensors). Runs a
    statistics kernel, the fused kernel, then rounds the float32 dQ; the gradients are contiguous."""
    _check(do, q, k, v, o, lse, scale, causal, dlse, grad_dtype)
    n_seqs = _check_options(q, window, softcap, slopes, alibi_offset, cu_seqlens)
    if not isinstance(deterministic, bool):
        raise TypeError(f"fused_backward: deterministic must be a bool, got {type(deterministic).__name__}")
    if deterministic and (cu_seqlens is not None or lists is not None or q.shape[3] not in DETERMINISTIC_HEAD_DIMS):
        raise ValueError(f"fused_backward: deterministic=True takes dense calls at head dims {DETERMINISTIC_HEAD_DIMS} "
                         "(no packed batch, no block lists)")
    if lists is not None:
        why = why_not_lists(lists, list_block, q.shape[0], q.shape[2], k.shape[2], cu_seqlens is not None,
                            q.shape[3])
        if why is not None:
            raise ValueError(f"fused_backward: block lists not taken: {why}")
    B, N, H, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    if not isinstance(host_descriptors, bool):
        raise TypeError(f"fused_backward: host_descriptors must be a bool, got {type(host_descriptors).__name__}")
    if host_descriptors and (cu_seqlens is not None or D not in (64, 128)):
        raise ValueError("fused_backward: host_descriptors takes dense calls at head dims 64 and 128")
    band = Band.of(causal, tuple(window)).for_kernels()
    grad_dtype = grad_dtype or q.dtype
    ws = workspace or make_workspace(q, k, v, grad_dtype, deterministic, cu_seqlens, band.left, band.right)
    dk, dv, stats, dq = ws.dk, ws.dv, ws.stats, ws.dq
    if q.numel() == 0 or k.numel() == 0:  # (empty: no kernel, no descriptor of an empty tensor)
        return torch.zeros(q.shape, dtype=grad_dtype, device=q.device), dk.zero_(), dv.zero_()
    block_m, sub_n = TILES[D]
    q, k, v, do = (_tma_ready(t) for t in (q, k, v, do))
    o = o if o.stride(-1) == 1 else o.contiguous()
    lse = lse.contiguous()
    dlse = lse if dlse is None else dlse.contiguous()
    n_pad = stats.shape[1]
    if cu_seqlens is None:
        cu_q = cu_k = q_blocks = block_seq = work = lse  # not read
        stats_grid = (n_pad // block_m * B * H,)
    else:
        cu_q, cu_k = cu_seqlens
        q_blocks, block_seq, work = ws.q_blocks, ws.block_seq, ws.work
        stats_grid = (n_pad // block_m * H,)
    launch(
        _row_stats, stats_grid,
        o, do, lse, dlse, stats, block_seq, cu_q, q_blocks, o.stride(0), o.stride(1), o.stride(2), do.stride(0),
        do.stride(1), do.stride(2), N, H, n_pad, n_seqs, HEAD_D=D, BLOCK=block_m, HAS_DLSE=dlse is not lse,
        VARLEN=cu_seqlens is not None)
    _ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    paired = False
    turns = lse  # not read
    if deterministic:  # heads first, the last key blocks first (flash_bwd_fused); a turn counter per query block
        grid = (Hk, B, _cdiv(M, 2 * sub_n))
        turns = ws.turns
    elif cu_seqlens is None:
        key_blocks = _cdiv(M, 2 * sub_n)
        pure_causal = band.right == 0 and band.left is None and lists is None
        paired = paired_schedule(pure_causal, N, M, B, Hk, H // Hk, block_m, 2 * sub_n,
                                 _device.sm_count(q.device))
        grid = (_cdiv(key_blocks, 2) if paired else key_blocks, Hk, B)
    else:
        grid = (work.shape[1], Hk, 1)
    if lists is not None:
        q_num, q_idx = (x.contiguous() for x in lists)
        bm, hm, rows, width = q_idx.shape
        list_args = (q_num, q_idx, hm * rows if bm > 1 else 0, rows if hm > 1 else 0, width)
    else:
        list_args = (lse, lse, 0, 0, 0)  # not read
    kernel, own = flash_bwd_fused, dict(DETERMINISTIC=deterministic)
    if DKV_TMA.get(D, False) and grad_dtype == q.dtype:
        own.update(DKV_TMA=True)
    tensors: tuple = (q, k, v, do, stats, dq, dk, dv, dk, dv)  # (the last two: DK_DESC, DV_DESC, not read)
    if host_descriptors:
        tensors = host_descriptors_of(q, k, v, do, stats, dq, dk, dv, own.get("DKV_TMA", False))
        own.update(HOST_DESC=True)
    turns_arg: tuple = (turns,)
    if D == 256:
        from longattn.backends.gluon.bwd_fused_wide import flash_bwd_fused_wide as kernel
        own, turns_arg, tensors = {}, (), tensors[:8]
    launch(
        kernel, grid,
        *tensors, cu_q, cu_k, work, lse if slopes is None else slopes, *list_args[:2],
        *turns_arg, *box_strides(q), *box_strides(k), *box_strides(v), *box_strides(do), N, M, H, H // Hk, B, n_pad,
        work.shape[-1] if cu_seqlens is not None else 0, float(scale), band.left or 0, band.right or 0,
        float(softcap), int(alibi_offset), *list_args[2:], USE_LIST=lists is not None,
        LIST_M=list_block[0] if lists is not None else block_m, LIST_N=list_block[1] if lists is not None else 128,
        HEAD_D=D, BLOCK_M=block_m, SUB_N=sub_n, HAS_LEFT=band.left is not None,
        HAS_RIGHT=band.right is not None, SPLIT_DQ=SPLIT_DQ[D], CONSUMER_REGS=CONSUMER_REGS, PAIRED=paired,
        VARLEN=cu_seqlens is not None, SOFTCAP=softcap > 0, ALIBI=slopes is not None, CAUSAL=band.right == 0,
        num_warps=4, **own)
    return dq.to(grad_dtype), dk, dv
