"""The Hopper (sm_90a) attention backward with FlashAttention-3/4's D = 64 tile, 128 queries x 128 keys per step,
in Gluon. Dense calls only (bf16/fp16, D = 64, causal or not, grouped-query heads); :func:`backward` launches it.
The planner routes to it the dense D=64 calls the fused backward would take, with no band but causal's, no score
modification, sinks or log-sum-exp gradient (``planner.why_not_wide_backward``; the routing's
``wide_bwd_head_dims``).

The routed fused backward (:mod:`longattn.backends.gluon.bwd_fused`) runs D = 64 with 64-row query blocks: there each
consumer computes ``dQ = dS_h K_h`` over all of D for its own 64 keys (a ``BLOCK_M x 64`` float32 accumulator), which
at 128 query rows spills (1076 B) and two consumers reduce-add every dQ element. Here, as in FlashAttention-3/4, the
consumers split dQ by *query rows* instead: consumer ``h`` (keys ``n0 + 64 h ...`` for S, dP, dK, dV) computes
``dQ[64 h .. 64 h + 63, :] = dS[those rows, all 128 keys] K`` from both consumers' dS^T in shared memory, a
``64 x 64`` float32 accumulator (32 registers a thread), and adds it into the float32 dQ by a TMA reduce-add: each
dQ element once per block pair. Per query block (``st`` its Q/dO stage)::

    S^T  = K_h Q^T,  dP^T = V_h dO^T                 (64 keys x 128 queries each, issued together)
    P^T  = exp2(S^T * scale * log2(e) - lse2)        (masked where the causal band cuts the tile)
    dS^T = P^T (dP^T - delta)                        -> shared memory (this consumer's 64 key rows of dS^T[st])
    dK  += dS^T Q,  dV += P^T dO                     (dS^T, P^T from registers)
    -- both consumers' dS^T stored (barrier ds_ready[st]) --
    dQ_h = dS[h rows, keys 0..63] K_0 + dS[h rows, keys 64..127] K_1
    wait(0)                                          (nothing in flight across the loop's back-edge)
    dQ_h * scale -> staging tile -> TMA reduce-add; Q/dO stage released

The loader (:func:`longattn.backends.gluon.bwd_parts._loader`: K and V once per key block in two 64-row halves, Q,
dO and the row statistics of every query block, double-buffered), the walk over query blocks and the dK/dV store are
``bwd_parts``'s. Non-causal calls run **persistent** (``PERSISTENT``): one program an SM walks the work items (key
blocks) in turn with its own loader (:func:`_loader`, the same loads), and makes its TMA descriptors once (each is
built in shared memory and published to global memory with a release fence: the likely part of a program's fixed
cost, with its start), the next item's first query tiles loading while the last one's final tiles run: 1.17x the
one-program-a-key-block grid at 1k keys, 1.07x at 2k, 1.007x at 4k (H200, non-causal; causal calls gained nothing,
so they keep the grid); the row statistics (``lse2``, ``delta``) come from
:func:`longattn.backends.gluon.bwd_fused._row_stats` with 128-row blocks. Shared memory: K, V 32 KB, Q, dO 64 KB,
dS^T 64 KB (two stages of 128 x 128), two dQ staging tiles 32 KB, statistics 2 KB: 194 KB.

Registers (the point of this kernel): a consumer holds dK, dV (64 registers a thread), S^T and dP^T (64 each), so
the row statistics cannot stay in registers beside them (a value per query column: 32 a thread each, which spilled).
FA3/FA4 spread them across lanes and fetch them with shuffles; here they enter as the products' initial
accumulators instead, ``S^T - lse2 / c`` and ``dP^T - delta`` (``c = scale * log2(e)``), so that ``P^T =
exp2(c * acc)`` and ``dS^T = P^T * acc`` need no per-query value at all. Without ``CAUSAL``, keys past the end get
P = 0 through the same accumulator (a huge negative initial value, no mask). dS^T is stored before the dK, dV
products are issued, dK's first (measured: the other orders spill). Compile-only facts (sm_90a, Triton 3.6.0 and
3.9.0, D = 64, causal and not): no spills, no ptxas C75xx, consumers at 240 registers (highest R223-R233), two
TMA reduce-adds. With ``PAIRED`` (two key blocks per program) the loop over key blocks is unrolled: as a loop it
spilled 92-120 B inside the query loop; unrolled, 0 B (3.9) / 24 B outside the query loops (3.6).

What FA3/FA4 do and this does not: no lane-spread statistics (see above); a dQ reduce-add issued by the consumers,
not a producer warp; no longest-first scheduler routed (``longest_first`` is an option); no deterministic mode. On
an H200 (docs/kernel_notes.md): the same error against float64 as the fused backward on 13 awkward cases,
1.07-1.19x its speed (backward alone).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from longattn.backends.gluon.bwd_parts import (BOX16, BOX32, LOG2E, ROWS32, TILE16, _dq_descriptor, _key_block,
                                               _key_blocks, _loader as _item_loader, _query_walk, _sequence,
                                               _store_dkdv, reinterpret, thread_barrier, tma_load, tma_reduce_add)
from longattn.backends.cached_launch import launch
from longattn.backends import device as _device
from longattn.backends.gluon.shapes import WIDE_BWD_BLOCK_M
from longattn.backends.gluon.tma import bhnd_descriptor, box_strides, matrix_descriptor
from longattn.backends.kernel_args import cdiv as _cdiv, ensure_allocator as _ensure_allocator

BLOCK_M = WIDE_BWD_BLOCK_M  # query rows per step (both consumers)
SUB_N = 64  # keys per consumer: a program owns 2 * SUB_N = 128 keys
HEAD_DIMS = (64,)
CONSUMER_REGS = 240


@gluon.jit
def _work_count(seq_k, n_kv_heads, n_batch, PAIRED: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(work items, first key blocks a head)``: a work item is one key block of one key/value head and batch row
    (two with ``PAIRED``, :func:`longattn.backends.gluon.bwd_parts._key_blocks`)."""
    n_p = gl.cdiv(seq_k, BLOCK_N)
    if PAIRED:
        n_p = (n_p + 1) // 2
    return n_p * n_kv_heads * n_batch, n_p


@gluon.jit
def _work_item(w, n_p, n_kv_heads, n_batch, LONGEST_FIRST: gl.constexpr):
    """Work item ``w``'s ``(first key block, key/value head, batch row)``: key blocks fastest (the order of the
    non-persistent grid's programs; the programs at work at one time share their heads' queries in L2), or with
    ``LONGEST_FIRST`` heads and batch rows fastest, so that the items come in order of their key blocks (a causal
    key block has no more query blocks than the one before it: the longest items first)."""
    if LONGEST_FIRST:
        bh = w % (n_kv_heads * n_batch)
        return w // (n_kv_heads * n_batch), bh % n_kv_heads, bh // n_kv_heads
    return w % n_p, (w // n_p) % n_kv_heads, w // (n_p * n_kv_heads)


@gluon.jit
def _dq_descriptor_all(DQ, n_batch, seq_q, n_heads, HEAD_D: gl.constexpr, ROWS: gl.constexpr):
    """The descriptor of the float32 dQ, ``(B, N, H, D)`` contiguous, in boxes of ``ROWS`` rows of one batch row and
    head (coordinates ``[b, h, row, 0]``; the reduce-add drops rows past the end)."""
    return tma.make_tensor_descriptor(DQ, shape=[n_batch, n_heads, seq_q, HEAD_D],
                                      strides=[seq_q * n_heads * HEAD_D, HEAD_D, n_heads * HEAD_D, 1],
                                      block_shape=[1, 1, ROWS, HEAD_D], layout=BOX32)


@gluon.jit
def _descriptors(Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads,
                 n_kv_heads, n_batch, n_pad, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr,
                 HOST_DESC: gl.constexpr):
    """The loader's descriptors ``(Q, dO, K, V, statistics)`` over every batch row and head (coordinates ``[b, h,
    row, 0]``; the statistics ``[(b * H + h) * 2, row]``): the parameters themselves with ``HOST_DESC`` (made on
    the host, :func:`host_descriptors_of`), else made here (each a round trip to global memory, one after another)."""
    if HOST_DESC:
        q_desc, do_desc, k_desc, v_desc, stats_desc = Q, DO, K, V, STATS
    else:
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
    return q_desc, do_desc, k_desc, v_desc, stats_desc


@gluon.jit
def _loader(Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads,
            group, n_batch, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready, empty,
            HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr,
            PAIRED: gl.constexpr, LONGEST_FIRST: gl.constexpr, PERSISTENT: gl.constexpr, HOST_DESC: gl.constexpr):
    """The loader partition: for each work item of this program (:func:`_work_item`) and each of its key blocks,
    K and V in two ``SUB_N``-row halves (``kv_bar`` one barrier a half; refilled once ``kv_free`` completes), then
    Q, dO and the row statistics of every query block of every query head of the group into the two buffers (a
    buffer is refilled once both consumers are done with it). The descriptors span every batch row and head, so a
    program makes them once whatever number of work items it takes; with ``HOST_DESC`` they are the kernel's
    parameters (:func:`_descriptors`), made on the host. Without ``PERSISTENT`` the one work item of the grid's
    program ``(key block, head, batch row)``."""
    BLOCK_N: gl.constexpr = 2 * SUB_N
    n_kv_heads = n_heads // group
    q_desc, do_desc, k_desc, v_desc, stats_desc = _descriptors(Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb,
                                                               svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads,
                                                               n_kv_heads, n_batch, n_pad, HEAD_D, BLOCK_M, SUB_N,
                                                               HOST_DESC)
    t0 = 0  # query tiles loaded so far (the buffers' ring position)
    kb = 0  # key blocks loaded so far
    n_work, n_p = _work_count(seq_k, n_kv_heads, n_batch, PAIRED, BLOCK_N)
    if PERSISTENT:
        first = gl.program_id(0)
        step = gl.num_programs(0)
    else:  # the grid's program, as a work item's number (key blocks fastest): one trip
        first = gl.program_id(0) + n_p * (gl.program_id(1) + n_kv_heads * gl.program_id(2))
        step = n_work
    for w in range(first, n_work, step):
        # (the grid's item in the grid's order, as the consumers take it, whatever LONGEST_FIRST says)
        p, h, b = _work_item(w, n_p, n_kv_heads, n_batch, LONGEST_FIRST and PERSISTENT)
        for j in range(_key_blocks(p, seq_k, PAIRED, BLOCK_N)):
            n0 = _key_block(p, j, seq_k, PAIRED, BLOCK_N) * BLOCK_N
            if kb > 0:  # both consumers are done with the previous key block's K and V
                mbarrier.wait(kv_free.index(0), (kb - 1) & 1)
            for part in gl.static_range(2):
                mbarrier.expect(kv_bar.index(part), 2 * k_desc.block_type.nbytes)
                tma_load(k_desc, [b, h, n0 + part * SUB_N, 0], kv_bar.index(part), k_smem.index(part))
                tma_load(v_desc, [b, h, n0 + part * SUB_N, 0], kv_bar.index(part), v_smem.index(part))
            kb += 1
            # (Q_NUM, n_pad here, is read only with block lists)
            lo, n_blocks, row = _query_walk(n0, seq_q, seq_k, 0, 0, b, h, group, n_pad, 0, 0, BLOCK_M, BLOCK_N, False,
                                            CAUSAL, False, BLOCK_M, BLOCK_N)
            for i in range(group * n_blocks):  # query head h * group + i // n_blocks, its (i % n_blocks)-th block
                t = t0 + i
                st = t % 2
                hq = h * group + i // n_blocks
                m0 = (lo + i % n_blocks) * BLOCK_M
                # A fresh barrier counts as having finished the phase before its first, so the first lap does not
                # wait.
                mbarrier.wait(empty.index(st), ((t // 2) & 1) ^ 1)
                mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
                tma_load(q_desc, [b, hq, m0, 0], ready.index(st), q_smem.index(st))
                tma_load(do_desc, [b, hq, m0, 0], ready.index(st), do_smem.index(st))
                tma_load(stats_desc, [(b * n_heads + hq) * 2, m0], ready.index(st), stats_smem.index(st))
            t0 += group * n_blocks


@gluon.jit
def _program_loader(Q, K, V, DO, STATS, DQ, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k,
                    n_heads, group, n_batch, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready,
                    empty, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr,
                    PAIRED: gl.constexpr, PERSISTENT: gl.constexpr, LONGEST_FIRST: gl.constexpr,
                    HOST_DESC: gl.constexpr):
    """The loader partition: :func:`_loader` with ``PERSISTENT`` or ``HOST_DESC``, else the fused backward's (one
    work item, from the grid)."""
    if PERSISTENT or HOST_DESC:
        _loader(Q, K, V, DO, STATS, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads,
                group, n_batch, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready, empty,
                HEAD_D, BLOCK_M, SUB_N, CAUSAL, PAIRED, LONGEST_FIRST, PERSISTENT, HOST_DESC)
    else:
        _item_loader(Q, K, V, DO, STATS, DQ, DQ, DQ, DQ, DQ, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh,
                     seq_q, seq_k, n_heads, group, n_batch, n_pad, 0, 0, 0, 0, 0, 0, k_smem, v_smem, q_smem, do_smem,
                     stats_smem, kv_bar, kv_free, ready, empty, HEAD_D, BLOCK_M, 2 * SUB_N, False, CAUSAL, PAIRED,
                     False, CAUSAL, False, BLOCK_M, 2 * SUB_N, 2, BOX16)


@gluon.jit
def _consumer_item(p, h, b, b_dq, t0, kb, DQ, DK, DV, seq_q, seq_k, n_heads, group, scale, k_smem, v_smem, q_smem,
                   do_smem, stats_smem, ds_smem, dq_smem, dq_desc, kv_bar, kv_free, ready, empty, ds_ready,
                   HALF: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr,
                   CAUSAL: gl.constexpr, PAIRED: gl.constexpr):
    """Consumer ``HALF``'s work item: first key block ``p`` of key/value head ``h`` and batch row ``b`` (``b_dq`` the
    batch coordinate of ``dq_desc``); the query tiles counted so far ``t0`` and the key blocks ``kb`` before it in,
    after it out."""
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)
    COLS: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)  # a value per query row (the columns of S^T)
    HM: gl.constexpr = BLOCK_M // 2  # this consumer's dQ rows
    dtype: gl.constexpr = k_smem.dtype
    n_kv_heads = n_heads // group
    nq = seq_q
    nk = seq_k
    k0 = 0
    shift = nk - nq
    qk_scale = scale * LOG2E
    inv_qk_scale = 1.0 / qk_scale
    dq_tile = dq_smem.index(HALF)
    # The row statistics as (stage * 2 + [lse2, delta], row): the unswizzled TMA tiles read as plain rows.
    stats_rows = reinterpret(stats_smem, gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    k_tile = k_smem.index(HALF).reshape([SUB_N, HEAD_D])
    v_tile = v_smem.index(HALF).reshape([SUB_N, HEAD_D])
    k_all0 = k_smem.index(0).reshape([SUB_N, HEAD_D])
    k_all1 = k_smem.index(1).reshape([SUB_N, HEAD_D])
    # Unrolled (measured: with PAIRED, a loop over the two key blocks spills 92-120 B inside the query loop).
    n_key_blocks = _key_blocks(p, nk, PAIRED, 2 * SUB_N)
    for j in gl.static_range(2 if PAIRED else 1):
        if j < n_key_blocks:
            n0 = _key_block(p, j, nk, PAIRED, 2 * SUB_N) * (2 * SUB_N)
            lo, n_blocks, row = _query_walk(n0, nq, nk, 0, 0, b, h, group, DK, 0, 0, BLOCK_M, 2 * SUB_N, False, CAUSAL,
                                            False, BLOCK_M, 2 * SUB_N)
            n0 = n0 + HALF * SUB_N  # this consumer's keys
            keys = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ST_LAYOUT))
            # Per key row, a value 0 that the compiler cannot fold (see dp_init); without CAUSAL -1 for a key past the
            # end (loaded as zeros), which, scaled huge into S^T's initial accumulator, gives it P = 0 without a mask.
            # With CAUSAL the band already excludes those keys for every row that exists (rows past the end have
            # lse2 = +inf, hence P = 0).
            if CAUSAL:
                kbias = keys.to(gl.float32) * 0.0
            else:
                kbias = gl.where(keys < nk, 0.0, -1.0)
            mbarrier.wait(kv_bar.index(0), kb & 1)  # both halves: dQ reads all the keys
            mbarrier.wait(kv_bar.index(1), kb & 1)
            dk = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
            dv = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
            # The walk as the loader's (query head h * group + i // n_blocks, its block lo + i % n_blocks), counted
            # without a division (a division by n_blocks keeps its reciprocal in registers).
            hq = h * group
            blk = lo
            for i in range(group * n_blocks):
                t = t0 + i
                st = t % 2
                m0 = blk * BLOCK_M
                mbarrier.wait(ready.index(st), (t // 2) & 1)
                ds_all = ds_smem.index(st)  # both consumers' dS^T rows (one buffer per Q stage)
                ds_tile = ds_all.slice(HALF * SUB_N, SUB_N, dim=0)
                q_tile = q_smem.index(st).reshape([BLOCK_M, HEAD_D])
                do_tile = do_smem.index(st).reshape([BLOCK_M, HEAD_D])
                # The row statistics enter as the products' initial accumulators (S^T - lse2 / c, dP^T - delta): no
                # per-query values stay live in registers (32 a thread each) while the tiles are (FA3/FA4 spread them
                # across lanes with shuffles instead).
                lse2 = stats_rows.index(2 * st).load(COLS)
                delta = stats_rows.index(2 * st + 1).load(COLS)
                if CAUSAL:
                    s_init = gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT) - (lse2 * inv_qk_scale)[None, :]
                else:
                    s_init = kbias[:, None] * 3.0e38 - (lse2 * inv_qk_scale)[None, :]
                # kbias makes the init differ per key row: with one value per column (a plain broadcast) the two rows of
                # a thread share a register, and the copies that the product needs (distinct registers) land after the
                # wgmma fence, where ptxas first waits for S^T (C7517: S^T and dP^T serialised).
                dp_init = kbias[:, None] - delta[None, :]
                s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, is_async=True)
                dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), dp_init, is_async=True)
                s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
                p_t = gl.exp2(s_t * qk_scale)  # exp2(S^T * scale * log2(e) - lse2)
                if CAUSAL:  # only the tiles the band cuts: some key lies past the first row's last key
                    if n0 + SUB_N - 1 > m0 + shift:
                        rows = m0 + gl.arange(0, BLOCK_M, layout=COLS)
                        p_t = gl.where(keys[:, None] <= rows[None, :] + shift, p_t, 0.0)
                    if n0 + SUB_N > nk:
                        # Keys past the end load as zeros: weight 0 (for the rows that exist the band already excludes
                        # them; the mask, measured, keeps ptxas from spilling).
                        p_t = gl.where(keys[:, None] < nk, p_t, 0.0)
                dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
                ds_t = (p_t * dp_t).to(dtype)
                ds_tile.store(ds_t)
                fence_async_shared()
                thread_barrier()  # every thread's dS stored before the other consumer is told
                mbarrier.arrive(ds_ready.index(st), count=1)
                dk = warpgroup_mma(gl.convert_layout(ds_t, OP_LAYOUT), q_tile, dk, is_async=True)
                dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), OP_LAYOUT), do_tile, dv, is_async=True)
                mbarrier.wait(ds_ready.index(st), (t // 2) & 1)
                # dQ rows HALF * HM ...: dS (queries x keys) is dS^T's column slice, transposed.
                ds_rows = ds_all.slice(HALF * HM, HM, dim=1)
                dq = warpgroup_mma(ds_rows.slice(0, SUB_N, dim=0).permute((1, 0)), k_all0,
                                   gl.zeros([HM, HEAD_D], gl.float32, ACC_LAYOUT), use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_rows.slice(SUB_N, SUB_N, dim=0).permute((1, 0)), k_all1, dq, is_async=True)
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                # Q, dO and this stage's dS read for the last time by this consumer: the stage is refilled (and its dS
                # rewritten) once both consumers are here.
                mbarrier.arrive(empty.index(st), count=1)
                tma.store_wait(0)  # the previous block's reduce-add has read the staging tile
                dq_tile.reshape([HM, HEAD_D]).store(dq * scale)
                fence_async_shared()
                tma_reduce_add(dq_desc, [b_dq, hq, m0 + HALF * HM, 0], dq_tile)
                blk += 1
                if blk == lo + n_blocks:
                    blk = lo
                    hq += 1
            t0 += group * n_blocks
            kb += 1
            mbarrier.arrive(kv_free.index(0), count=1)  # this key block's K and V read for the last time
            _store_dkdv(DK, DV, dk, dv, scale, b, seq_k, k0, n0, 0, nk, n_kv_heads, h, HEAD_D, SUB_N, HEAD_D,
                        ACC_LAYOUT)
    return t0, kb


@gluon.jit
def _consumer(DQ, DK, DV, seq_q, seq_k, n_heads, group, n_batch, scale, k_smem, v_smem, q_smem, do_smem, stats_smem,
              ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready, HALF: gl.constexpr, HEAD_D: gl.constexpr,
              BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr, PAIRED: gl.constexpr,
              PERSISTENT: gl.constexpr, LONGEST_FIRST: gl.constexpr, HOST_DESC: gl.constexpr):
    """Consumer ``HALF`` (one warpgroup): keys ``HALF * SUB_N ...`` of each work item's (S^T, dP^T, dK, dV, summed
    over the group's query heads) and query rows ``HALF * BLOCK_M / 2 ...`` of every block's dQ (over all the keys);
    the work items ``program_id, program_id + programs, ...`` with ``PERSISTENT``, else the one ``program_id``
    (measured: the loop over one item costs spills inside the query loop)."""
    if PERSISTENT:
        if HOST_DESC:
            dq_desc = DQ
        else:
            dq_desc = _dq_descriptor_all(DQ, n_batch, seq_q, n_heads, HEAD_D, BLOCK_M // 2)
        n_work, n_p = _work_count(seq_k, n_heads // group, n_batch, PAIRED, 2 * SUB_N)
        t0 = gl.program_id(0) * 0  # query tiles taken so far (the buffers' ring position, as the loader's)
        kb = t0  # key blocks taken so far (the K/V buffers' phase)
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            p, h, b = _work_item(w, n_p, n_heads // group, n_batch, LONGEST_FIRST)
            t0, kb = _consumer_item(p, h, b, b, t0, kb, DQ, DK, DV, seq_q, seq_k, n_heads, group, scale, k_smem, v_smem,
                                    q_smem, do_smem, stats_smem, ds_smem, dq_smem, dq_desc, kv_bar, kv_free, ready,
                                    empty, ds_ready, HALF, HEAD_D, BLOCK_M, SUB_N, CAUSAL, PAIRED)
    else:
        # One work item, from the grid (key block, head, batch row); dQ's descriptor of that batch row.
        b, s, p, nq, nk, q0, k0, stats_col0 = _sequence(DK, DK, DK, 0, seq_q, seq_k, False)
        none = b * 0
        if HOST_DESC:  # (over every batch row: coordinate b)
            dq_desc = DQ
            b_dq = b
        else:
            dq_desc = _dq_descriptor(DQ, b, q0, nq, seq_q, n_heads, HEAD_D, BLOCK_M // 2, HEAD_D)
            b_dq = none
        _consumer_item(p, gl.program_id(1), b, b_dq, none, none, DQ, DK, DV, seq_q, seq_k, n_heads, group, scale,
                       k_smem, v_smem, q_smem, do_smem, stats_smem, ds_smem, dq_smem, dq_desc, kv_bar, kv_free, ready,
                       empty, ds_ready, HALF, HEAD_D, BLOCK_M, SUB_N, CAUSAL, PAIRED)
    tma.store_wait(0)


@gluon.jit
def flash_bwd_wide_tile(Q, K, V, DO, STATS, DQ, DK, DV, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh,
                        seq_q, seq_k, n_heads, group, n_batch, n_pad, scale, HEAD_D: gl.constexpr,
                        BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr, PAIRED: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr = False,
                        LONGEST_FIRST: gl.constexpr = False, HOST_DESC: gl.constexpr = False):
    """Work items: ``cdiv(seq_k, 2 * SUB_N)`` key blocks (half as many with ``PAIRED``: key blocks ``p`` and ``last -
    p``) of each key/value head and batch row. Grid ``(key blocks, Hk, B)``, one work item a program; with
    ``PERSISTENT`` ``(programs,)``, program ``i`` taking the work items ``i, i + programs, ...`` (key blocks fastest,
    or with ``LONGEST_FIRST`` in order of key blocks, :func:`_work_item`). ``num_warps`` 4 (the loader) and two
    consumer warpgroups of ``CONSUMER_REGS`` registers. The tensors as
    :func:`longattn.backends.gluon.bwd_fused.flash_bwd_fused`'s for a dense call: Q, dO ``(B, N, H, D)``, K, V ``(B,
    M, Hk, D)`` (unit stride along D, the strides given), STATS float32 ``(B * H * 2, n_pad)`` (``_row_stats`` with
    ``BLOCK = BLOCK_M``), DQ float32 ``(B, N, H, D)`` contiguous and zeroed, DK and DV contiguous ``(B, M, Hk, D)``;
    with ``HOST_DESC`` Q, K, V, DO, STATS and DQ are their TMA descriptors instead (:func:`host_descriptors_of`).
    ``CAUSAL``: bottom-right aligned (query ``i`` sees keys ``j <= i + M - N``)."""
    dtype: gl.constexpr = Q.dtype if HOST_DESC else Q.dtype.element_ty  # (a descriptor's: its elements')
    HM: gl.constexpr = BLOCK_M // 2
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * SUB_N, BLOCK_M], TILE16)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, HM, HEAD_D], BOX32)
    stats_smem = gl.allocate_shared_memory(gl.float32, [2, 2, BLOCK_M], ROWS32)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_free.index(0), count=2)  # both consumers done with a key block's K and V (PAIRED)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' dS stored
        mbarrier.init(kv_bar.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    first: gl.constexpr = 0
    second: gl.constexpr = 1
    gl.warp_specialize([
        (_program_loader, (Q, K, V, DO, STATS, DQ, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q,
                           seq_k, n_heads, group, n_batch, n_pad, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar,
                           kv_free, ready, empty, HEAD_D, BLOCK_M, SUB_N, CAUSAL, PAIRED, PERSISTENT,
                           LONGEST_FIRST, HOST_DESC)),
        (_consumer, (DQ, DK, DV, seq_q, seq_k, n_heads, group, n_batch, scale, k_smem, v_smem, q_smem, do_smem,
                     stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready, first, HEAD_D, BLOCK_M,
                     SUB_N, CAUSAL, PAIRED, PERSISTENT, LONGEST_FIRST, HOST_DESC)),
        (_consumer, (DQ, DK, DV, seq_q, seq_k, n_heads, group, n_batch, scale, k_smem, v_smem, q_smem, do_smem,
                     stats_smem, ds_smem, dq_smem, kv_bar, kv_free, ready, empty, ds_ready, second, HEAD_D, BLOCK_M,
                     SUB_N, CAUSAL, PAIRED, PERSISTENT, LONGEST_FIRST, HOST_DESC)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# --- Launcher (the planner routes dense D=64 calls here through gluon/launch.py's wide_backward) ----------------------

def host_descriptors_of(q: Tensor, k: Tensor, v: Tensor, do: Tensor, stats: Tensor, dq32: Tensor) -> tuple:
    """The kernel's ``HOST_DESC`` parameters: host-side TMA descriptors of q, k, v, do ``(B, N, H, D)`` read as
    ``(B, H, N, D)`` (boxes of ``BLOCK_M`` query or ``SUB_N`` key rows of one batch row and head), of the
    statistics ``(B·H·2, n_pad)`` (boxes of 2 x ``BLOCK_M``) and of the float32 dQ (boxes of ``BLOCK_M / 2``
    rows), the layouts :func:`_descriptors` and :func:`_dq_descriptor_all` give on the device."""
    return (bhnd_descriptor(q, BLOCK_M, BOX16), bhnd_descriptor(k, SUB_N, BOX16), bhnd_descriptor(v, SUB_N, BOX16),
            bhnd_descriptor(do, BLOCK_M, BOX16), matrix_descriptor(stats, (2, BLOCK_M), ROWS32),
            bhnd_descriptor(dq32, BLOCK_M // 2, BOX32))


def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
             scale: float, causal: bool, *, paired: bool = True, stats: Optional[Tensor] = None,
             dq32: Optional[Tensor] = None, persistent: Optional[bool] = None, longest_first: bool = False,
             host_descriptors: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of dense attention on an sm_90 GPU, into ``dq``, ``dk``, ``dv`` (returned): q, o, do ``(B, N, H,
    64)``, k, v ``(B, M, Hk, 64)`` (``Hk`` dividing ``H``), float16 or bfloat16; ``lse`` the natural-log log-sum-exp
    ``(B, H, N)`` float32; ``dq`` ``(B, N, H, 64)`` and ``dk``, ``dv`` like k, v, contiguous (any float dtype).
    ``causal``: bottom-right aligned, as :func:`longattn.backends.gluon.bwd_fused.fused_backward`. Runs
    ``bwd_fused._row_stats`` (128-row blocks), the kernel into a zeroed float32 dQ, then rounds dQ into ``dq``.
    ``paired``: let :func:`longattn.backends.gluon.bwd_fused.paired_schedule` decide whether a program takes two
    key blocks (causal calls only, as the routed fused backward); False: never. ``stats`` (float32
    ``(B·H·2, n_pad)``, ``n_pad`` the rows rounded up to ``BLOCK_M``) and ``dq32`` (float32 like q, zeroed): the
    buffers its launches write besides the gradients, made here where None (a caller recording the launches passes
    its own, :func:`longattn.backends.gluon.workspace.make_workspace`'s). ``persistent``: one program an SM walks the
    work items in turn, making its TMA descriptors once (True), or one program a work item (False); None (the
    routed schedule): persistent for non-causal calls (measured: 1.17x at 1k keys, 1.005-1.007x at 4k), one program a
    work item for causal ones (measured as fast either way, with two key blocks a program). A persistent program
    takes one key block an item (``paired`` does not apply). ``longest_first`` (persistent only): the items in order
    of their key blocks, heads fastest, rather than key blocks fastest (:func:`_work_item`). ``host_descriptors``:
    the TMA descriptors of Q, dO, K, V, the statistics and dQ made here (:func:`host_descriptors_of`) and passed as
    the kernel's parameters, rather than by every program on the device (a round trip to global memory each, one
    after another, before a program's first load; the launcher encodes them on every launch; a replay copies them
    over its tensors, :mod:`longattn.backends.replay`): the planner's option, ``Routing.wide_bwd_host_descriptors``
    (measured 1.03-1.15x at 1k-4k causal, docs/kernel_notes.md). ``longest_first`` is for
    ``tools/check_bwd_wide_tile.py --schedules``, not routed."""
    from longattn.backends.gluon.bwd_fused import _check, _row_stats, _tma_ready, paired_schedule
    _check(do, q, k, v, o, lse, scale, causal, None, None)
    for name, flag in (("persistent", persistent), ("longest_first", longest_first),
                       ("host_descriptors", host_descriptors)):
        if not isinstance(flag, bool) and not (name == "persistent" and flag is None):
            raise TypeError(f"bwd_wide_tile.backward: {name} must be a bool, got {type(flag).__name__}")
    B, N, H, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    if D not in HEAD_DIMS:
        raise ValueError(f"bwd_wide_tile.backward: head dim must be one of {HEAD_DIMS}, got {D}")
    for name, t, shape in (("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, v.shape)):
        if tuple(t.shape) != tuple(shape) or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"bwd_wide_tile.backward: {name} must be contiguous of shape {tuple(shape)} on "
                             f"q's device, got {tuple(t.shape)}")
    if q.numel() == 0 or k.numel() == 0:  # (empty: no kernel, no descriptor of an empty tensor)
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    q, k, v, do = (_tma_ready(t) for t in (q, k, v, do))
    o = o if o.stride(-1) == 1 else o.contiguous()
    lse = lse.contiguous()
    n_pad = _cdiv(N, BLOCK_M) * BLOCK_M
    if stats is None:
        stats = torch.empty((B * H * 2, n_pad), dtype=torch.float32, device=q.device)
    elif (tuple(stats.shape) != (B * H * 2, n_pad) or not stats.is_contiguous() or stats.dtype != torch.float32
          or stats.device != q.device):
        raise ValueError(f"bwd_wide_tile.backward: stats must be a contiguous float32 tensor of shape "
                         f"{(B * H * 2, n_pad)} on q's device, got {stats.dtype} {tuple(stats.shape)}")
    launch(
        _row_stats, (n_pad // BLOCK_M * B * H,),
        o, do, lse, lse, stats, lse, lse, lse, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
        do.stride(2), N, H, n_pad, B, HEAD_D=D, BLOCK=BLOCK_M, HAS_DLSE=False, VARLEN=False)
    if dq32 is None:
        dq32 = dq if dq.dtype == torch.float32 else torch.empty((B, N, H, D), dtype=torch.float32, device=q.device)
        dq32.zero_()
    _ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    key_blocks = _cdiv(M, 2 * SUB_N)
    persistent = not causal if persistent is None else persistent
    paired = paired and not persistent and paired_schedule(causal, N, M, B, Hk, H // Hk, BLOCK_M, 2 * SUB_N,
                                                           _device.sm_count(q.device))
    n_p = _cdiv(key_blocks, 2) if paired else key_blocks
    grid = (min(n_p * Hk * B, _device.sm_count(q.device)),) if persistent else (n_p, Hk, B)
    tensors = (q, k, v, do, stats, dq32)
    if host_descriptors:
        tensors = host_descriptors_of(q, k, v, do, stats, dq32)
    launch(
        flash_bwd_wide_tile, grid,
        *tensors, dk, dv, *box_strides(q), *box_strides(k), *box_strides(v), *box_strides(do), N, M,
        H, H // Hk, B, n_pad, float(scale), HEAD_D=D, BLOCK_M=BLOCK_M, SUB_N=SUB_N, CAUSAL=causal, PAIRED=paired,
        CONSUMER_REGS=CONSUMER_REGS, PERSISTENT=persistent, LONGEST_FIRST=persistent and longest_first,
        HOST_DESC=host_descriptors, num_warps=4)
    if dq32 is not dq:
        dq.copy_(dq32)
    return dq, dk, dv
