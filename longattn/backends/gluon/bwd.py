"""Hopper (sm_90) dK/dV kernel in Gluon: asynchronous ``wgmma`` with explicit waits, TMA loads of the query side.

One program owns ``BLOCK_N`` keys of one (batch, KV head) and walks the query blocks of every query head of its
group that can see them, in ``BLOCK_M`` rows, Q and dO tiles arriving by TMA into a ring of ``STAGES`` buffers
(the next ones load while a block computes). Per query block, with the keys' K and V tiles resident::

    S^T  = K Q^T          dP^T = V dO^T                 (both issued at once, asynchronously)
    P^T  = exp(scale S^T - lse)                         (while dP^T finishes)
    dV  += P^T dO                                       (issued, then dP^T waited for)
    dS^T = P^T (dP^T - delta)
    dK  += dS^T Q                                       (dK scaled once at the end)

Triton's own compiler waits for each of these products right after issuing it; here the exponentials overlap
``dP^T``, and a block's dK/dV products stay in flight while the next block's ``S^T`` and ``dP^T`` are issued. dQ
is the Triton pass's. The band (causal, window) masks the pairs of the query blocks it cuts; rows past the query
sequence's end load as zeros with log-sum-exp ``+inf`` (weight 0), keys past the key sequence's end only touch
dK/dV rows that are not stored. A query with log-sum-exp ``-inf`` (it saw no key) has weight 0.

One partition of eight warps (no warp specialisation yet): measured 0.95-0.98x the Triton pass end to end
(docs/kernel_notes.md), so no launch is routed to it yet (``launch.DKDV_HEAD_DIMS``).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

BOX16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4))
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _query_blocks(n0, seq_q, seq_k, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """The query blocks ``[lo, hi)`` whose rows can see any of the keys ``[n0, n0 + BLOCK_N)`` (query ``i`` sees
    key ``j`` for ``i + shift - left <= j <= i + shift + right``, ``shift = seq_k - seq_q``)."""
    shift = seq_k - seq_q
    first = n0 * 0
    last = n0 * 0 + seq_q
    if HAS_RIGHT:
        first = gl.maximum(n0 - shift - right, 0)
    if HAS_LEFT:
        last = gl.minimum(gl.maximum(n0 + BLOCK_N - shift + left, 0), seq_q)
    lo = first // BLOCK_M
    return lo, gl.maximum((last + BLOCK_M - 1) // BLOCK_M, lo)


@gluon.jit
def _prefetch(q_desc, do_desc, q_smem, do_smem, ready, t, total, n_blocks, lo, b, kvh, group, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr):
    """Start loading the Q and dO tiles of block ``t`` (query head ``t // n_blocks`` of the group, query block
    ``lo + t % n_blocks``) into ring slot ``t % STAGES``, if there is such a block."""
    if t < total:
        st = t % STAGES
        h = kvh * group + t // n_blocks
        m0 = (lo + t % n_blocks) * BLOCK_M
        mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, m0, 0], ready.index(st), q_smem.index(st))
        tma_load(do_desc, [b, h, m0, 0], ready.index(st), do_smem.index(st))


@gluon.jit
def _block(dk, dv, t, q_desc, do_desc, q_smem, do_smem, ready, k_tile, v_tile, LSE, DELTA, total, n_blocks, lo, b,
           kvh, group, n_heads, n0, keys, seq_q, seq_k, qk_scale, left, right, ST_LAYOUT: gl.constexpr,
           OP_LAYOUT: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, FIRST: gl.constexpr):
    """Query block ``t`` of the program: issue ``S^T`` and ``dP^T``; then (after the first block) wait for the
    previous block's dK/dV products and refill its buffers; the softmax while ``dP^T`` finishes; issue ``dV``
    and ``dK`` and return them in flight."""
    st = t % STAGES
    h = kvh * group + t // n_blocks
    m0 = (lo + t % n_blocks) * BLOCK_M
    mbarrier.wait(ready.index(st), (t // STAGES) & 1)
    q_tile = q_smem.index(st).reshape([BLOCK_M, HEAD_D])
    do_tile = do_smem.index(st).reshape([BLOCK_M, HEAD_D])
    s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ST_LAYOUT),
                        use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ST_LAYOUT),
                         use_acc=False, is_async=True)
    if not FIRST:
        dk, dv = warpgroup_mma_wait(num_outstanding=2, deps=(dk, dv))
        _prefetch(q_desc, do_desc, q_smem, do_smem, ready, t - 1 + STAGES, total, n_blocks, lo, b, kvh, group,
                  BLOCK_M, STAGES)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ST_LAYOUT))  # the query rows, as columns
    row_ok = rows < seq_q
    stat = (b.to(gl.int64) * n_heads + h) * seq_q + rows
    lse = gl.load(LSE + stat, mask=row_ok, other=float("inf"))
    lse = gl.where(lse == float("-inf"), float("inf"), lse) * LOG2E  # a query that saw no key weighs 0
    delta = gl.load(DELTA + stat, mask=row_ok, other=0.0)
    s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
    p_t = gl.exp2(s_t * qk_scale - lse[None, :])
    shift = seq_k - seq_q
    # Only the blocks the band cuts need a mask: some key sees a query past its band's edge.
    cut = t >= total  # (the stand-in first block of a program with no query block: weight 0)
    if HAS_RIGHT:
        cut = cut | (n0 + BLOCK_N - 1 > m0 + shift + right)
    if HAS_LEFT:
        cut = cut | (n0 < m0 + BLOCK_M - 1 + shift - left)
    if cut:
        ok = (keys[:, None] >= 0) & (t < total)
        if HAS_RIGHT:
            ok = ok & (keys[:, None] <= rows[None, :] + shift + right)
        if HAS_LEFT:
            ok = ok & (keys[:, None] >= rows[None, :] + shift - left)
        p_t = gl.where(ok, p_t, 0.0)
    dtype: gl.constexpr = k_tile.dtype
    dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), OP_LAYOUT), do_tile, dv, is_async=True)
    dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
    ds_t = p_t * (dp_t - delta[None, :])
    dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), OP_LAYOUT), q_tile, dk, is_async=True)
    return dk, dv


@gluon.jit
def flash_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, seq_q, seq_k,
                   n_heads, group, scale, left, right, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Grid ``(cdiv(seq_k, BLOCK_N), B * Hk)``, eight warps (two warpgroups share the ``BLOCK_N`` key rows). dO is
    contiguous ``(B, N, Hq, D)``, LSE and DELTA ``(B, Hq, N)`` float32, DK and DV contiguous ``(B, M, Hk, D)``."""
    n_kv = n_heads // group
    pid_n = gl.program_id(0)
    b = gl.program_id(1) // n_kv
    kvh = gl.program_id(1) % n_kv
    n0 = pid_n * BLOCK_N
    dtype: gl.constexpr = Q.dtype.element_ty

    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)

    q_desc = tma.make_tensor_descriptor(Q, shape=[gl.num_programs(1) // n_kv, n_heads, seq_q, HEAD_D],
                                        strides=[sqb, sqh, sqn, 1], block_shape=[1, 1, BLOCK_M, HEAD_D],
                                        layout=BOX16)
    do_desc = tma.make_tensor_descriptor(DO, shape=[gl.num_programs(1) // n_kv, n_heads, seq_q, HEAD_D],
                                         strides=[seq_q * n_heads * HEAD_D, HEAD_D, n_heads * HEAD_D, 1],
                                         block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    k_desc = tma.make_tensor_descriptor(K, shape=[gl.num_programs(1) // n_kv, n_kv, seq_k, HEAD_D],
                                        strides=[skb, skh, skn, 1], block_shape=[1, 1, BLOCK_N, HEAD_D],
                                        layout=BOX16)
    v_desc = tma.make_tensor_descriptor(V, shape=[gl.num_programs(1) // n_kv, n_kv, seq_k, HEAD_D],
                                        strides=[svb, svh, svn, 1], block_shape=[1, 1, BLOCK_N, HEAD_D],
                                        layout=BOX16)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], BOX16)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], BOX16)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], BOX16)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], BOX16)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma_load(k_desc, [b, kvh, n0, 0], kv_bar, k_smem)
    tma_load(v_desc, [b, kvh, n0, 0], kv_bar, v_smem)

    lo, hi = _query_blocks(n0, seq_q, seq_k, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    total = (hi - lo) * group  # (query head of the group, query block) pairs, head-major
    n_blocks = gl.maximum(hi - lo, 1)
    # With no query block to walk (keys outside every query's band), block 0 is loaded and computed with weight 0,
    # so that the first block is always there to start the pipeline.
    for i in gl.static_range(STAGES):
        _prefetch(q_desc, do_desc, q_smem, do_smem, ready, i, gl.maximum(total, 1), n_blocks, lo, b, kvh, group,
                  BLOCK_M, STAGES)  # n_blocks is at least 1 here
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ST_LAYOUT))
    mbarrier.wait(kv_bar, 0)
    k_tile = k_smem.reshape([BLOCK_N, HEAD_D])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_D])
    zeros = gl.zeros([BLOCK_N, HEAD_D], gl.float32, ACC_LAYOUT)
    args = (q_desc, do_desc, q_smem, do_smem, ready, k_tile, v_tile, LSE, DELTA, total, n_blocks, lo, b, kvh, group,
            n_heads, n0, keys, seq_q, seq_k, scale * LOG2E, left, right)
    dk, dv = _block(zeros, zeros, 0, *args, ST_LAYOUT, OP_LAYOUT, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT,
                    HAS_RIGHT, True)
    for t in range(1, total):  # dK/dV products stay in flight from one block into the next
        dk, dv = _block(dk, dv, t, *args, ST_LAYOUT, OP_LAYOUT, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT,
                        HAS_RIGHT, False)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(kv_bar)
    # DK and DV are contiguous (B, M, Hk, D)
    out_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC_LAYOUT))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ACC_LAYOUT))
    offs = ((b.to(gl.int64) * seq_k + out_rows[:, None].to(gl.int64)) * n_kv + kvh) * HEAD_D + d[None, :]
    ok = (out_rows < seq_k)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)
