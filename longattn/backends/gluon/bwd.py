"""Hopper (sm_90) dK/dV kernel in Gluon: warp-specialised, asynchronous ``wgmma`` with explicit waits.

One program owns ``2 * SUB_N`` keys of one (batch, KV head) and walks the query blocks (``BLOCK_M`` rows) of every
query head of its group that can see them. Three partitions: a **loader** (one warp) loads each consumer's K and V
rows once, then the Q and dO tiles of every block by TMA into a ring of ``STAGES`` slots; two **consumers** (one
warpgroup each, ``SUB_N`` keys each, ``CONSUMER_REGS`` registers) take every block in turn. Per block, with their
K and V tiles resident::

    S^T  = K Q^T          dP^T = V dO^T                 (both issued at once, asynchronously)
    P^T  = exp(scale S^T - lse)                         (while dP^T finishes)
    dV  += P^T dO                                       (issued, then dP^T waited for)
    dS^T = P^T (dP^T - delta)
    dK  += dS^T Q                                       (dK scaled once at the end)

A consumer's dK/dV products stay in flight into the next block's ``S^T``/``dP^T`` issue, and the two consumers
take turns to issue (a pair of mbarriers), so one's exponentials run while the other's products keep the tensor
cores busy. dQ is the Triton pass's. The band (causal, window) masks the pairs of the blocks it cuts; rows past
the query sequence's end load as zeros with log-sum-exp ``+inf`` (weight 0), keys past the key sequence's end only
touch dK/dV rows that are not stored; a query with log-sum-exp ``-inf`` (it saw no key) has weight 0. A loop-carried
value keeps one type in Gluon, so the first block is peeled (the in-flight accumulators then enter the loop in
flight), and a program without query blocks computes one block with weight 0.

Routed to only where measured faster than the Triton pass (``launch.DKDV_HEAD_DIMS``; docs/kernel_notes.md).
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
def _loader(Q, DO, K, V, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, seq_q, seq_k, n_heads, group, left, right,
            k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
            SUB_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """The loader partition: each consumer's K and V rows once, then the Q and dO tiles of every (query head,
    query block) pair through the ring (a slot is refilled once both consumers are done with it)."""
    n_kv = n_heads // group
    n_batch = gl.num_programs(1) // n_kv
    b = gl.program_id(1) // n_kv
    kvh = gl.program_id(1) % n_kv
    n0 = gl.program_id(0) * (2 * SUB_N)
    q_desc = tma.make_tensor_descriptor(Q, shape=[n_batch, n_heads, seq_q, HEAD_D], strides=[sqb, sqh, sqn, 1],
                                        block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    do_desc = tma.make_tensor_descriptor(DO, shape=[n_batch, n_heads, seq_q, HEAD_D],
                                         strides=[seq_q * n_heads * HEAD_D, HEAD_D, n_heads * HEAD_D, 1],
                                         block_shape=[1, 1, BLOCK_M, HEAD_D], layout=BOX16)
    k_desc = tma.make_tensor_descriptor(K, shape=[n_batch, n_kv, seq_k, HEAD_D], strides=[skb, skh, skn, 1],
                                        block_shape=[1, 1, SUB_N, HEAD_D], layout=BOX16)
    v_desc = tma.make_tensor_descriptor(V, shape=[n_batch, n_kv, seq_k, HEAD_D], strides=[svb, svh, svn, 1],
                                        block_shape=[1, 1, SUB_N, HEAD_D], layout=BOX16)
    for half in gl.static_range(2):
        mbarrier.expect(kv_bar.index(half), 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [b, kvh, n0 + half * SUB_N, 0], kv_bar.index(half), k_smem.index(half))
        tma_load(v_desc, [b, kvh, n0 + half * SUB_N, 0], kv_bar.index(half), v_smem.index(half))
    lo, hi = _query_blocks(n0, seq_q, seq_k, left, right, BLOCK_M, 2 * SUB_N, HAS_LEFT, HAS_RIGHT)
    n_blocks = gl.maximum(hi - lo, 1)
    count = gl.maximum((hi - lo) * group, 1)  # a program without query blocks still walks one (with weight 0)
    for t in range(count):
        st = t % STAGES
        h = kvh * group + t // n_blocks
        m0 = (lo + t % n_blocks) * BLOCK_M
        # A fresh barrier counts as having finished the phase before its first, so the first lap does not wait.
        mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, m0, 0], ready.index(st), q_smem.index(st))
        tma_load(do_desc, [b, h, m0, 0], ready.index(st), do_smem.index(st))


@gluon.jit
def _block(dk, dv, t, q_smem, do_smem, ready, empty, turn, k_tile, v_tile, LSE, DELTA, total, n_blocks, lo, b, kvh,
           group, n_heads, n0, keys, seq_q, seq_k, qk_scale, left, right, ST_LAYOUT: gl.constexpr,
           OP_LAYOUT: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, SUB_N: gl.constexpr,
           STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HALF: gl.constexpr,
           FIRST: gl.constexpr):
    """Query block ``t`` for one consumer's keys: in its turn, issue ``S^T`` and ``dP^T``; then (after the first
    block) wait for the previous block's dK/dV products and release its ring slot; the softmax while ``dP^T``
    finishes; issue ``dV`` and ``dK`` and return them in flight."""
    st = t % STAGES
    h = kvh * group + t // n_blocks
    m0 = (lo + t % n_blocks) * BLOCK_M
    mbarrier.wait(ready.index(st), (t // STAGES) & 1)
    q_tile = q_smem.index(st).reshape([BLOCK_M, HEAD_D])
    do_tile = do_smem.index(st).reshape([BLOCK_M, HEAD_D])
    mbarrier.wait(turn.index(HALF), (t & 1) ^ (1 - HALF))  # the consumers take turns to issue (ping-pong)
    s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT),
                        use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros([SUB_N, BLOCK_M], gl.float32, ST_LAYOUT),
                         use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - HALF), count=1)
    if not FIRST:
        dk, dv = warpgroup_mma_wait(num_outstanding=2, deps=(dk, dv))
        mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
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
    cut = t >= total  # (the stand-in block of a program with no query block: weight 0)
    if HAS_RIGHT:
        cut = cut | (n0 + SUB_N - 1 > m0 + shift + right)
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
def _consumer(LSE, DELTA, DK, DV, seq_q, seq_k, n_heads, group, scale, left, right, k_smem, v_smem, q_smem,
              do_smem, kv_bar, ready, empty, turn, HALF: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              SUB_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """A consumer partition (one warpgroup): keys ``HALF * SUB_N`` on of the program's, their dK and dV."""
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    OP_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT, k_width=2)
    n_kv = n_heads // group
    b = gl.program_id(1) // n_kv
    kvh = gl.program_id(1) % n_kv
    n0 = gl.program_id(0) * (2 * SUB_N)
    lo, hi = _query_blocks(n0, seq_q, seq_k, left, right, BLOCK_M, 2 * SUB_N, HAS_LEFT, HAS_RIGHT)
    total = (hi - lo) * group
    n_blocks = gl.maximum(hi - lo, 1)
    n0 = n0 + HALF * SUB_N  # this consumer's keys
    keys = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ST_LAYOUT))
    mbarrier.wait(kv_bar.index(HALF), 0)
    k_tile = k_smem.index(HALF).reshape([SUB_N, HEAD_D])
    v_tile = v_smem.index(HALF).reshape([SUB_N, HEAD_D])
    zeros = gl.zeros([SUB_N, HEAD_D], gl.float32, ACC_LAYOUT)
    args = (q_smem, do_smem, ready, empty, turn, k_tile, v_tile, LSE, DELTA, total, n_blocks, lo, b, kvh, group,
            n_heads, n0, keys, seq_q, seq_k, scale * LOG2E, left, right)
    dk, dv = _block(zeros, zeros, 0, *args, ST_LAYOUT, OP_LAYOUT, HEAD_D, BLOCK_M, SUB_N, STAGES, HAS_LEFT,
                    HAS_RIGHT, HALF, True)
    for t in range(1, total):  # dK/dV products stay in flight from one block into the next
        dk, dv = _block(dk, dv, t, *args, ST_LAYOUT, OP_LAYOUT, HEAD_D, BLOCK_M, SUB_N, STAGES, HAS_LEFT,
                        HAS_RIGHT, HALF, False)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    # DK and DV are contiguous (B, M, Hk, D)
    out_rows = n0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, ACC_LAYOUT))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ACC_LAYOUT))
    offs = ((b.to(gl.int64) * seq_k + out_rows[:, None].to(gl.int64)) * n_kv + kvh) * HEAD_D + d[None, :]
    ok = (out_rows < seq_k)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def flash_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, seq_q, seq_k,
                   n_heads, group, scale, left, right, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                   SUB_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr):
    """Grid ``(cdiv(seq_k, 2 * SUB_N), B * Hk)``; ``num_warps`` 4 (the loader), two consumer warpgroups with
    ``CONSUMER_REGS`` registers per thread, ``SUB_N`` keys each. dO is contiguous ``(B, N, Hq, D)``, LSE and DELTA
    ``(B, Hq, N)`` float32, DK and DV contiguous ``(B, M, Hk, D)``."""
    dtype: gl.constexpr = Q.dtype.element_ty
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, SUB_N, HEAD_D], BOX16)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], BOX16)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], BOX16)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    first: gl.constexpr = 0
    second: gl.constexpr = 1
    # Consumer 0 is the default partition (the kernel's four warps), consumer 1 and the loader (one warp) are
    # workers: nine warps in all, so every partition may use more than 168 registers.
    gl.warp_specialize([
        (_consumer, (LSE, DELTA, DK, DV, seq_q, seq_k, n_heads, group, scale, left, right, k_smem, v_smem, q_smem,
                     do_smem, kv_bar, ready, empty, turn, first, HEAD_D, BLOCK_M, SUB_N, STAGES, HAS_LEFT,
                     HAS_RIGHT)),
        (_consumer, (LSE, DELTA, DK, DV, seq_q, seq_k, n_heads, group, scale, left, right, k_smem, v_smem, q_smem,
                     do_smem, kv_bar, ready, empty, turn, second, HEAD_D, BLOCK_M, SUB_N, STAGES, HAS_LEFT,
                     HAS_RIGHT)),
        (_loader, (Q, DO, K, V, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, seq_q, seq_k, n_heads, group, left,
                   right, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty, HEAD_D, BLOCK_M, SUB_N, STAGES,
                   HAS_LEFT, HAS_RIGHT)),
    ], [4, 1], [CONSUMER_REGS, 24])
