"""Hopper (sm_90) forward kernel in Gluon: a TMA loader and two consumer warpgroups, warp-specialised.

One program (CTA) computes ``2 * SUB_M`` query rows of one (batch, head): a loader partition streams K and V tiles
of ``BLOCK_N`` keys through a ring of ``STAGES`` shared-memory buffers by TMA, and two consumer partitions (one
warpgroup each, ``SUB_M`` rows each) take every tile in turn: ``S = Q K^T`` and ``O += P V`` on the tensor cores by
``wgmma``, the online softmax in registers. The two consumers share each tile, so while one works the softmax of
its scores the other's products keep the tensor cores busy (the warp schedulers interleave them); the loader holds
few registers, so the consumers get more (``warp_specialize``'s register counts).

The key blocks a program walks are the same range as the Triton forward's (``jit.visible_key_blocks``): masked
edge blocks cut by the causal band, the window or the sequence end, unmasked interior ones. Tiles are read
through device-side tensor descriptors of each (batch, head) view, bounded by its length, so rows past the end of
a sequence arrive as zeros and never as another head's values. Grouped-query heads read K/V head ``h // group``.
Scores are scaled into base 2 once; the output is normalised at the end and the log-sum-exp (natural log) stored
in float32, ``-inf`` (output 0) for rows that see no key.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# Triton 3.6 calls the TMA load async_copy_global_to_shared; later releases async_load (the old name raises).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _key_blocks(m0, n_k, shift, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Key blocks ``lo <= full_lo <= full_hi <= hi`` seen by query rows ``[m0, m0 + BLOCK_M)``; ``[full_lo,
    full_hi)`` need no mask (the rule of ``longattn.backends.triton.jit.visible_key_blocks``)."""
    lo_key = m0 * 0
    hi_key = n_k
    full_lo_key = m0 * 0
    full_hi_key = n_k
    if HAS_LEFT:
        lo_key = gl.maximum(m0 + shift - left, 0)
        full_lo_key = gl.maximum(m0 + BLOCK_M - 1 + shift - left, 0)
    if HAS_RIGHT:
        hi_key = gl.minimum(gl.maximum(m0 + BLOCK_M + shift + right, 0), n_k)
        full_hi_key = gl.minimum(gl.maximum(m0 + shift + right + 1, 0), n_k)
    lo = lo_key // BLOCK_N
    hi = gl.maximum((hi_key + BLOCK_N - 1) // BLOCK_N, lo)
    full_lo = gl.minimum(gl.maximum((full_lo_key + BLOCK_N - 1) // BLOCK_N, lo), hi)
    full_hi = gl.maximum(gl.minimum(full_hi_key // BLOCK_N, hi), full_lo)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, m0, lo, hi,
            SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition: the two query halves once, then K and V of blocks ``lo..hi`` into the ring."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [m0, 0], q_bar, q_smem.index(0))
    tma_load(q_desc, [m0 + SUB_M, 0], q_bar, q_smem.index(1))
    for blk in range(lo, hi):
        c = blk - lo
        st = c % STAGES
        # A fresh barrier counts as having finished the phase before its first, so the first lap does not wait.
        lap = (c // STAGES) & 1
        mbarrier.wait(k_empty.index(st), lap ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma_load(k_desc, [blk * BLOCK_N, 0], k_ready.index(st), k_smem.index(st))
        mbarrier.wait(v_empty.index(st), lap ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        tma_load(v_desc, [blk * BLOCK_N, 0], v_ready.index(st), v_smem.index(st))


@gluon.jit
def _softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, S_LAYOUT: gl.constexpr,
             BLOCK_N: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Online-softmax step on a score tile: ``(p, m_new, l_new, alpha)``, ``alpha`` rescaling what came before."""
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        hi = n_k - 1 + rows * 0
        if HAS_RIGHT:
            hi = gl.minimum(rows + shift + right, hi)
        ok = cols[None, :] <= hi[:, None]
        if HAS_LEFT:
            ok = ok & (cols[None, :] >= (rows + shift - left)[:, None])
        s = gl.where(ok, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[:, None])
    else:
        # Scale the row maxima rather than the tile (scale > 0), so scaling and shifting is one FMA per score.
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = m_new
        p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _step(acc, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, c, start_n, rows, n_k, shift, left,
          right, qk_scale, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
          SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
          HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """One key block ``c`` (counted from the program's first), in order: scores, online softmax, ``P V``."""
    st = c % STAGES
    phase = (c // STAGES) & 1
    mbarrier.wait(k_ready.index(st), phase)
    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(st), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, BLOCK_N,
                                  MASKED, HAS_LEFT, HAS_RIGHT)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    p16 = gl.convert_layout(p.to(v_smem.dtype), P_LAYOUT)
    mbarrier.wait(v_ready.index(st), phase)
    acc = warpgroup_mma(p16, v_smem.index(st), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(st), count=1)
    return acc, m_i, l_i


@gluon.jit
def _step_overlapped(acc, m_i, l_i, p_prev, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, c, start_n,
                     rows, n_k, shift, left, right, qk_scale, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
                     P_LAYOUT: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HALF: gl.constexpr,
                     PINGPONG: gl.constexpr):
    """Key block ``c`` with the previous block's ``P V`` in flight: issue ``S_c = Q K_c^T`` and
    ``O += P_{c-1} V_{c-1}``, wait for the scores only, run the softmax of block ``c`` while the tensor cores finish
    the product, then rescale ``O``. Returns ``P_c`` for the next step.

    With ``PINGPONG`` the two consumers take turns to issue their products (``turn``: one barrier per consumer,
    each arriving on the other's after issuing), so one's softmax runs while the tensor cores work the other's."""
    st = c % STAGES
    prev = (c - 1) % STAGES
    mbarrier.wait(k_ready.index(st), (c // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
    if PINGPONG:
        # Consumer 0 goes first: its barrier counts as free on the first step (a fresh barrier's previous phase).
        mbarrier.wait(turn.index(HALF), (c & 1) ^ (1 - HALF))
    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT),
                      use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF), count=1)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    mbarrier.arrive(k_empty.index(st), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, BLOCK_N,
                                  MASKED, HAS_LEFT, HAS_RIGHT)
    p16 = gl.convert_layout(p.to(v_smem.dtype), P_LAYOUT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    return acc, m_i, l_i, p16


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE, b, h, m0, lo, full_lo, full_hi,
              hi, n_q, n_k, shift, left, right, n_heads, qk_scale,
              HALF: gl.constexpr, HEAD_D: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, OVERLAP: gl.constexpr,
              PINGPONG: gl.constexpr):
    """A consumer partition (one warpgroup): rows ``m0 + HALF * SUB_M`` on, over every key block of the program."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    row0 = m0 + HALF * SUB_M
    rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, S_LAYOUT))
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([SUB_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    acc = gl.zeros([SUB_M, HEAD_D], gl.float32, O_LAYOUT)
    mbarrier.wait(q_bar, 0)
    q = q_smem.index(HALF)
    if OVERLAP:
        if hi > lo:
            # The first block alone (masked: it may be an edge block), then each block with the previous one's
            # P V in flight, then the last P V.
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT),
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(k_empty.index(0), count=1)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, lo * BLOCK_N, rows, n_k, shift, left, right, qk_scale,
                                          S_LAYOUT, BLOCK_N, True, HAS_LEFT, HAS_RIGHT)
            p16 = gl.convert_layout(p.to(v_smem.dtype), P_LAYOUT)
            for blk in range(lo + 1, full_lo):
                acc, m_i, l_i, p16 = _step_overlapped(
                    acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, blk - lo,
                    blk * BLOCK_N, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M,
                    BLOCK_N, STAGES, True, HAS_LEFT, HAS_RIGHT, HALF, PINGPONG)
            for blk in range(gl.maximum(lo + 1, full_lo), full_hi):
                acc, m_i, l_i, p16 = _step_overlapped(
                    acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, blk - lo,
                    blk * BLOCK_N, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M,
                    BLOCK_N, STAGES, False, HAS_LEFT, HAS_RIGHT, HALF, PINGPONG)
            for blk in range(gl.maximum(lo + 1, full_hi), hi):
                acc, m_i, l_i, p16 = _step_overlapped(
                    acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, blk - lo,
                    blk * BLOCK_N, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M,
                    BLOCK_N, STAGES, True, HAS_LEFT, HAS_RIGHT, HALF, PINGPONG)
            last = hi - 1 - lo
            mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
            acc = warpgroup_mma(p16, v_smem.index(last % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    else:
        for blk in range(lo, full_lo):
            acc, m_i, l_i = _step(acc, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, blk - lo,
                                  blk * BLOCK_N, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT,
                                  P_LAYOUT, SUB_M, BLOCK_N, STAGES, True, HAS_LEFT, HAS_RIGHT)
        for blk in range(full_lo, full_hi):
            acc, m_i, l_i = _step(acc, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, blk - lo,
                                  blk * BLOCK_N, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT,
                                  P_LAYOUT, SUB_M, BLOCK_N, STAGES, False, HAS_LEFT, HAS_RIGHT)
        for blk in range(full_hi, hi):
            acc, m_i, l_i = _step(acc, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, blk - lo,
                                  blk * BLOCK_N, rows, n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT,
                                  P_LAYOUT, SUB_M, BLOCK_N, STAGES, True, HAS_LEFT, HAS_RIGHT)

    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, O_LAYOUT))[:, None]

    # O is contiguous (B, N, H, D) and LSE (B, H, N): the backend allocates both.
    o_rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, O_LAYOUT))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_LAYOUT))
    b64 = b.to(gl.int64)
    o_ptrs = (O + ((b64 * n_q + o_rows[:, None].to(gl.int64)) * n_heads + h) * HEAD_D + d[None, :])
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(o_rows < n_q)[:, None])
    gl.store(LSE + (b64 * n_heads + h) * n_q + rows, lse, mask=rows < n_q)


@gluon.jit
def flash_fwd(Q, K, V, O, LSE, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, seq_q, seq_k, n_heads, group, scale,
              left, right, HEAD_D: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
              OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    """Grid: (query blocks of ``2 * SUB_M`` rows, batch, query heads). ``num_warps`` 4 (the loader); the two
    consumers are four warps each."""
    BLOCK_M: gl.constexpr = 2 * SUB_M
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest (causal) programs first
    b = gl.program_id(1)
    h = gl.program_id(2)
    m0 = pid_m * BLOCK_M
    shift = seq_k - seq_q
    lo, full_lo, full_hi, hi = _key_blocks(m0, seq_k, shift, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    kvh = h // group

    dtype: gl.constexpr = Q.dtype.element_ty
    TILE_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    b64 = b.to(gl.int64)
    q_desc = tma.make_tensor_descriptor(Q + b64 * sqb + h.to(gl.int64) * sqh, shape=[seq_q, HEAD_D],
                                        strides=[sqn, 1], block_shape=[SUB_M, HEAD_D], layout=TILE_LAYOUT)
    k_desc = tma.make_tensor_descriptor(K + b64 * skb + kvh.to(gl.int64) * skh, shape=[seq_k, HEAD_D],
                                        strides=[skn, 1], block_shape=[BLOCK_N, HEAD_D], layout=TILE_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + b64 * svb + kvh.to(gl.int64) * svh, shape=[seq_k, HEAD_D],
                                        strides=[svn, 1], block_shape=[BLOCK_N, HEAD_D], layout=TILE_LAYOUT)

    q_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_D], TILE_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], TILE_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], TILE_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(v_empty.index(i), count=2)

    qk_scale = scale * LOG2E
    first: gl.constexpr = 0
    second: gl.constexpr = 1
    gl.warp_specialize([
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, m0, lo, hi,
                   SUB_M, BLOCK_N, STAGES)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE, b, h, m0, lo, full_lo,
                     full_hi, hi, seq_q, seq_k, shift, left, right, n_heads, qk_scale, first, HEAD_D, SUB_M, BLOCK_N,
                     STAGES, HAS_LEFT, HAS_RIGHT, OVERLAP, PINGPONG)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE, b, h, m0, lo, full_lo,
                     full_hi, hi, seq_q, seq_k, shift, left, right, n_heads, qk_scale, second, HEAD_D, SUB_M, BLOCK_N,
                     STAGES, HAS_LEFT, HAS_RIGHT, OVERLAP, PINGPONG)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
