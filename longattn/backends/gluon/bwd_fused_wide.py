"""The fused Hopper backward for wide heads (D = 256): the two consumers split the head dim, not the keys.

At D = 256 a consumer owning half of a program's keys would need ``2 * D`` accumulator registers a key row for dK
and dV, more than a warpgroup has. Here a program owns ``BLOCK_N = 64`` keys (both consumers read all of them) and
walks 64-row query blocks; consumer ``C`` takes

- the query rows ``[C * 32, C * 32 + 32)`` of the block for the scores: ``S^T = K Q_C^T`` and ``dP^T = V dO_C^T``
  (64 keys x 32 queries each), hence ``P^T`` and ``dS^T`` of those rows;
- the head-dim columns ``[C * 128, C * 128 + 128)`` of dK, dV (64 keys x 128 in registers, float32) and dQ.

Per query block, with ``o = 1 - C`` the other consumer::

    S^T, dP^T                                   (asynchronous, issued together)
    P^T = exp2(S^T * scale * log2(e) - lse2)    (masked, soft-capped, ALiBi), stored to shared memory
    dV[:, C] += P^T_C dO[C rows, C cols]        (P^T from registers)
    dS^T = P^T (dP^T - delta), stored to shared memory
    dK[:, C] += dS^T_C Q[C rows, C cols]        (dS^T from registers)
    -- both consumers' P^T and dS^T stored --
    dV[:, C] += P^T_o dO[o rows, C cols],  dK[:, C] += dS^T_o Q[o rows, C cols]     (from shared memory)
    dQ[:, C cols] = dS K[:, C cols]             (in four 32-column slices, each added into the float32 dQ by a TMA
                                                 reduce-add through a 64 x 32 staging tile)

Five products per block pair, as FlashAttention-3's D = 256 backward (whose warpgroups also split the head dim).
Shared memory: K and V (32 KB each), Q and dO double-buffered (128 KB), P^T and dS^T (16 KB), two dQ staging tiles
(16 KB), the row statistics: 225 KB of an H100's 227. K and V use the 64-byte swizzle so that dQ's 32-column
slices of K are whole swizzle atoms.

The loader, the walk over query blocks (dense, banded, grouped-query heads, packed batches, block lists) and
the probabilities are shared with the D = 64/128 kernel (:mod:`longattn.backends.gluon.bwd_parts`), the row
statistics and the launcher are :mod:`longattn.backends.gluon.bwd_fused`'s: only the consumers differ.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from longattn.backends.gluon.bwd_parts import (BOX16, BOX16_64B, BOX32, LOG2E, ROWS32, _dq_descriptor, _key_block,
                                               _key_blocks, _loader, _probabilities, _query_start, _query_walk,
                                               _sequence, _store_dkdv, reinterpret, thread_barrier, tma_reduce_add)

TILE16_64B = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))


@gluon.jit
def _add_dq(dq, scale, dq_tile, dq_desc, hq, m0, col, BLOCK_M: gl.constexpr, DQN: gl.constexpr):
    """``dq * scale`` (a finished ``BLOCK_M x DQN`` slice) added into the float32 dQ at rows ``m0``, column ``col``
    of query head ``hq``, by a TMA reduce-add through this consumer's staging tile."""
    tma.store_wait(0)  # the previous slice's reduce-add has read the staging tile
    dq_tile.reshape([BLOCK_M, DQN]).store(dq * scale)
    fence_async_shared()
    tma_reduce_add(dq_desc, [0, hq, m0, col], dq_tile)


@gluon.jit
def _consumer(DQ, DK, DV, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, seq_q, seq_k, n_heads, group, n_batch, n_work,
              scale, left, right, softcap, alibi_offset, list_sb, list_sh, list_w, k_smem, v_smem, q_smem, do_smem,
              stats_smem, pt_smem, dst_smem, dq_smem, kv_bar, kv_free, ready, empty, pds_ready, pds_free,
              C: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, PAIRED: gl.constexpr, VARLEN: gl.constexpr,
              SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, CAUSAL: gl.constexpr, USE_LIST: gl.constexpr,
              LIST_M: gl.constexpr, LIST_N: gl.constexpr):
    """Consumer ``C`` (one warpgroup): query rows ``C * BLOCK_M / 2 ...`` of every block's scores, head-dim columns
    ``C * HEAD_D / 2 ...`` of dK, dV (summed over the group's query heads) and of every block's dQ."""
    HM: gl.constexpr = BLOCK_M // 2  # this consumer's query rows of S^T
    DC: gl.constexpr = HEAD_D // 2  # this consumer's columns of dK, dV, dQ
    DQN: gl.constexpr = 32  # dQ leaves in slices of DQN columns
    NSL: gl.constexpr = DC // DQN
    gl.static_assert(NSL >= 2, "the Q/dO stage is released after the second dQ slice's product")
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HM, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DC, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)
    DQ_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQN, 16])
    COLS: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)  # a value per query row (the columns of S^T)
    dtype: gl.constexpr = k_smem.dtype
    if CAUSAL:
        right = 0  # known at compile time
    n_kv_heads = n_heads // group
    h = gl.program_id(1)
    b, s, p, nq, nk, q0, k0, stats_col0 = _sequence(CU_Q, CU_K, WORK, n_work, seq_q, seq_k, VARLEN)
    dq_desc = _dq_descriptor(DQ, b, q0, nq, seq_q, n_heads, HEAD_D, BLOCK_M, DQN)
    shift = nk - nq
    qk_scale = scale * LOG2E
    dq_tile = dq_smem.index(C)
    stats_rows = reinterpret(stats_smem, gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    t0 = 0  # query tiles taken so far (the buffers' ring position, as the loader's)
    for j in range(_key_blocks(p, nk, PAIRED, BLOCK_N)):
        n0 = _key_block(p, j, nk, PAIRED, BLOCK_N) * BLOCK_N
        lo, n_blocks, row = _query_walk(n0, nq, nk, left, right, b, h, group, Q_NUM, list_sb, list_sh, BLOCK_M,
                                        BLOCK_N, HAS_LEFT, HAS_RIGHT, USE_LIST, LIST_M, LIST_N)
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ST_LAYOUT))
        mbarrier.wait(kv_bar.index(0), j & 1)
        dk = gl.zeros([BLOCK_N, DC], gl.float32, ACC_LAYOUT)
        dv = gl.zeros([BLOCK_N, DC], gl.float32, ACC_LAYOUT)
        for i in range(group * n_blocks):  # as the loader's
            t = t0 + i
            st = t % 2
            hq = h * group + i // n_blocks
            m0 = _query_start(i % n_blocks, lo, row, Q_IDX, list_w, BLOCK_M, USE_LIST, LIST_M)
            # K and V through a loop-variant index (always 0): with one hoisted out of the loop the compiler keeps
            # every k-step's shared-memory address in registers and spills them (FlashAttention-3 saw the same).
            kz = t >> 30
            k_tile = k_smem.index(kz).reshape([BLOCK_N, HEAD_D])
            v_tile = v_smem.index(kz).reshape([BLOCK_N, HEAD_D])
            slope = qk_scale * 0.0
            if ALIBI:  # SLOPES (sequences, H) float32: this sequence's and query head's slope, in base 2
                slope = gl.load(SLOPES + s * n_heads + hq) * LOG2E
            mbarrier.wait(ready.index(st), (t // 2) & 1)
            q_all = q_smem.index(st).reshape([BLOCK_M, HEAD_D])
            do_all = do_smem.index(st).reshape([BLOCK_M, HEAD_D])
            q_mine = q_all.slice(C * HM, HM, dim=0)
            do_mine = do_all.slice(C * HM, HM, dim=0)
            s_t = warpgroup_mma(k_tile, q_mine.permute((1, 0)), gl.zeros([BLOCK_N, HM], gl.float32, ST_LAYOUT),
                                use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_tile, do_mine.permute((1, 0)), gl.zeros([BLOCK_N, HM], gl.float32, ST_LAYOUT),
                                 use_acc=False, is_async=True)
            lse2 = stats_rows.index(2 * st).slice(C * HM, HM).load(COLS)
            rows = m0 + C * HM + gl.arange(0, HM, layout=COLS)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
            p_t, tanh_t = _probabilities(s_t, keys, rows, n0, m0 + C * HM, nk, shift, left, right, qk_scale, lse2,
                                         softcap, slope, alibi_offset, ST_LAYOUT, BLOCK_N, HM, HAS_LEFT, HAS_RIGHT,
                                         SOFTCAP, ALIBI, True)
            p_op = p_t.to(dtype)
            mbarrier.wait(pds_free.index(0), (t & 1) ^ 1)  # both consumers done with the last block's P^T and dS^T
            pt_smem.slice(C * HM, HM, dim=1).store(p_op)
            dv = warpgroup_mma(gl.convert_layout(p_op, OP_LAYOUT), do_mine.slice(C * DC, DC, dim=1), dv,
                               is_async=True)
            if SOFTCAP:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2, folded into P for dS
                p_t = p_t * (1.0 - tanh_t * tanh_t)
            delta = stats_rows.index(2 * st + 1).slice(C * HM, HM).load(COLS)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
            ds_op = (p_t * (dp_t - delta[None, :])).to(dtype)
            dst_smem.slice(C * HM, HM, dim=1).store(ds_op)
            dk = warpgroup_mma(gl.convert_layout(ds_op, OP_LAYOUT), q_mine.slice(C * DC, DC, dim=1), dk,
                               is_async=True)
            fence_async_shared()
            thread_barrier()  # every thread's P^T and dS^T stored before the other consumer is told
            mbarrier.arrive(pds_ready.index(0), count=1)
            mbarrier.wait(pds_ready.index(0), t & 1)
            # The other consumer's query rows (P^T and dS^T from shared memory), and dQ[:, this consumer's
            # columns] = dS K[:, those columns] in NSL slices of DQN columns, each slice's product running while
            # the one before it is staged and added into dQ (the serial order measured the same).
            dq = warpgroup_mma(dst_smem.permute((1, 0)), k_tile.slice(C * DC, DQN, dim=1),
                               gl.zeros([BLOCK_M, DQN], gl.float32, DQ_LAYOUT), use_acc=False, is_async=True)
            dv = warpgroup_mma(pt_smem.slice((1 - C) * HM, HM, dim=1),
                               do_all.slice((1 - C) * HM, HM, dim=0).slice(C * DC, DC, dim=1), dv, is_async=True)
            dk = warpgroup_mma(dst_smem.slice((1 - C) * HM, HM, dim=1),
                               q_all.slice((1 - C) * HM, HM, dim=0).slice(C * DC, DC, dim=1), dk, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq,))
            for jj in gl.static_range(1, NSL):
                nxt = warpgroup_mma(dst_smem.permute((1, 0)), k_tile.slice(C * DC + jj * DQN, DQN, dim=1),
                                    gl.zeros([BLOCK_M, DQN], gl.float32, DQ_LAYOUT), use_acc=False,
                                    is_async=True)
                _add_dq(dq, scale, dq_tile, dq_desc, hq, m0, C * DC + (jj - 1) * DQN, BLOCK_M, DQN)
                if jj == 1:
                    dv, dk = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dk))
                    mbarrier.arrive(empty.index(st), count=1)  # Q, dO and the statistics read for the last time
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(nxt,))
            mbarrier.arrive(pds_free.index(0), count=1)  # P^T and dS^T read for the last time
            _add_dq(dq, scale, dq_tile, dq_desc, hq, m0, C * DC + (NSL - 1) * DQN, BLOCK_M, DQN)
        t0 += group * n_blocks
        mbarrier.arrive(kv_free.index(0), count=1)  # this key block's K and V read for the last time
        _store_dkdv(DK, DV, dk, dv, scale, b, seq_k, k0, n0, C * DC, nk, n_kv_heads, h, HEAD_D, BLOCK_N, DC,
                    ACC_LAYOUT)  # this consumer's columns
    tma.store_wait(0)


@gluon.jit
def flash_bwd_fused_wide(Q, K, V, DO, STATS, DQ, DK, DV, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, sqb, sqn, sqh, skb,
                         skn, skh, svb, svn, svh, sdb, sdn, sdh, seq_q, seq_k, n_heads, group, n_batch, n_pad, n_work,
                         scale, left, right, softcap, alibi_offset, list_sb, list_sh, list_w, HEAD_D: gl.constexpr,
                         BLOCK_M: gl.constexpr, SUB_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, SPLIT_DQ: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         PAIRED: gl.constexpr, VARLEN: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                         ALIBI: gl.constexpr = False, CAUSAL: gl.constexpr = False, USE_LIST: gl.constexpr = False,
                         LIST_M: gl.constexpr = 64, LIST_N: gl.constexpr = 128):
    """:func:`longattn.backends.gluon.bwd_fused.flash_bwd_fused`'s arguments and grid (a program owns ``2 * SUB_N``
    keys; ``SPLIT_DQ`` is not read: dQ is always split along D), for ``HEAD_D`` 256."""
    dtype: gl.constexpr = Q.dtype.element_ty
    BLOCK_N: gl.constexpr = 2 * SUB_N
    DQN: gl.constexpr = 32
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, BLOCK_N, HEAD_D], BOX16_64B)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, BLOCK_N, HEAD_D], BOX16_64B)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_D], BOX16)
    # P^T and dS^T (keys x queries): each consumer's 32 query columns are whole 64-byte swizzle atoms.
    pt_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], TILE16_64B)
    dst_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], TILE16_64B)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, DQN], BOX32)
    stats_smem = gl.allocate_shared_memory(gl.float32, [2, 2, BLOCK_M], ROWS32)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    pds_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    mbarrier.init(kv_free.index(0), count=2)  # both consumers done with a key block's K and V (PAIRED)
    mbarrier.init(pds_ready.index(0), count=2)  # both consumers' P^T and dS^T stored
    mbarrier.init(pds_free.index(0), count=2)  # ... and read by both
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    first: gl.constexpr = 0
    second: gl.constexpr = 1
    one_part: gl.constexpr = 1
    gl.warp_specialize([
        (_loader, (Q, K, V, DO, STATS, CU_Q, CU_K, WORK, Q_NUM, Q_IDX, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh,
                   sdb, sdn, sdh, seq_q, seq_k, n_heads, group, n_batch, n_pad, n_work, left, right, list_sb, list_sh,
                   list_w, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready, empty, HEAD_D, BLOCK_M,
                   BLOCK_N, HAS_LEFT, HAS_RIGHT, PAIRED, VARLEN, CAUSAL, USE_LIST, LIST_M, LIST_N, one_part,
                   BOX16_64B)),
        (_consumer, (DQ, DK, DV, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, seq_q, seq_k, n_heads, group, n_batch,
                     n_work, scale, left, right, softcap, alibi_offset, list_sb, list_sh, list_w, k_smem, v_smem,
                     q_smem, do_smem, stats_smem, pt_smem, dst_smem, dq_smem, kv_bar, kv_free, ready, empty,
                     pds_ready, pds_free, first, HEAD_D, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, PAIRED, VARLEN,
                     SOFTCAP, ALIBI, CAUSAL, USE_LIST, LIST_M, LIST_N)),
        (_consumer, (DQ, DK, DV, CU_Q, CU_K, WORK, SLOPES, Q_NUM, Q_IDX, seq_q, seq_k, n_heads, group, n_batch,
                     n_work, scale, left, right, softcap, alibi_offset, list_sb, list_sh, list_w, k_smem, v_smem,
                     q_smem, do_smem, stats_smem, pt_smem, dst_smem, dq_smem, kv_bar, kv_free, ready, empty,
                     pds_ready, pds_free, second, HEAD_D, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, PAIRED, VARLEN,
                     SOFTCAP, ALIBI, CAUSAL, USE_LIST, LIST_M, LIST_N)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
