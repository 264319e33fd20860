"""The fused Hopper backward's device-side parts that its two kernels share (:mod:`longattn.backends.gluon.bwd_fused`
for D = 64 and 128, :mod:`longattn.backends.gluon.bwd_fused_wide` for D = 256): the Triton-version switch, the
shared-memory layouts, the work a program does and the query blocks it walks, the loader partition, the modified and
masked probabilities of a tile, dQ's descriptor and the dK/dV store. See bwd_fused.py's docstring for the scheme."""
from __future__ import annotations

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from longattn.backends import kernel_args
from longattn.backends.gluon.fwd import tma_load, tma_store  # (the TMA copies' names in each Triton version)

# --- What else tells Triton versions apart in the backward ------------------------------------------------------
# Triton 3.6 has no Python wrapper of the TMA reduce-add (the builder method exists); 3.7+ names it
# async_atomic_add. A shared-memory view of another layout is ``_reinterpret`` in 3.6, ``reinterpret`` later.
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
BOX16_64B = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=4))
BOX32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4))
TILE16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
ROWS32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
LOG2E = gl.constexpr(kernel_args.LOG2E)


@gluon.jit
def _sequence(CU_Q, CU_K, WORK, n_work, seq_q, seq_k, VARLEN: gl.constexpr, HEADS_FIRST: gl.constexpr = False,
              BLOCK_N: gl.constexpr = 128):
    """What this program works on: ``(b, s, p, nq, nk, q0, k0, stats_col0)``: the batch row ``b`` of the tensors, the
    sequence ``s`` (the slopes' row), its first key block ``p``, its query and key lengths, its first query and key
    rows (0 unless packed), and where its rows start in the statistics. A packed batch (``VARLEN``) reads the
    sequence, key block and statistics column from the work table ``WORK`` (int32 ``(3, n_work)``, sequence -1 for
    a program with nothing to do); a dense call takes ``(key block, head, batch)`` from the grid, or with
    ``HEADS_FIRST`` ``(head, batch, key blocks from the last)`` (:func:`_kv_head`), so that the GPU starts the
    programs of the last key blocks of every head first (the deterministic dQ order, bwd_fused.py)."""
    if VARLEN:
        w = gl.program_id(0)
        s = gl.load(WORK + w)
        p = gl.load(WORK + n_work + w)
        stats_col0 = gl.load(WORK + 2 * n_work + w)
        s_ok = gl.maximum(s, 0)
        q0 = gl.load(CU_Q + s_ok)
        k0 = gl.load(CU_K + s_ok)
        nq = gl.load(CU_Q + s_ok + 1) - q0
        nk = (gl.load(CU_K + s_ok + 1) - k0) * (s >= 0).to(gl.int32)  # no sequence: no key block to walk
        b = s * 0
    else:
        if HEADS_FIRST:
            b = gl.program_id(1)
            p = gl.cdiv(seq_k, BLOCK_N) - 1 - gl.program_id(2)
        else:
            b = gl.program_id(2)
            p = gl.program_id(0)
        s = b
        stats_col0 = b * 0
        q0 = b * 0
        k0 = b * 0
        nq = seq_q
        nk = seq_k
    return b, s, p, nq, nk, q0, k0, stats_col0


@gluon.jit
def _kv_head(HEADS_FIRST: gl.constexpr = False):
    """The key/value head of this program: the grid's second axis, or its first with ``HEADS_FIRST``
    (:func:`_sequence`)."""
    if HEADS_FIRST:
        return gl.program_id(0)
    else:
        return gl.program_id(1)


@gluon.jit
def _query_blocks(n0, nq, nk, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr):
    """The query blocks ``[lo, hi)`` whose rows can see any of the keys ``n0 .. n0 + BLOCK_N - 1`` (query ``i`` sees
    key ``j`` for ``i + shift - left <= j <= i + shift + right``, ``shift = nk - nq``, a side without a bound
    unbounded)."""
    shift = nk - nq
    lo = n0 * 0
    if HAS_RIGHT:
        lo = gl.maximum(n0 - shift - right, 0) // BLOCK_M
    hi = gl.cdiv(nq, BLOCK_M)
    if HAS_LEFT:
        last = n0 + BLOCK_N - 1 - shift + left  # the last row that sees a key of the block
        hi = gl.minimum(hi, (last + BLOCK_M) // BLOCK_M)  # its block + 1 (<= 0 where no row sees one)
    return lo, gl.maximum(hi, lo)


@gluon.jit
def _key_blocks(p, nk, PAIRED: gl.constexpr, BLOCK_N: gl.constexpr):
    """How many key blocks this program owns: 0 past the keys' end, 1, or 2 when ``PAIRED`` (blocks ``p`` and
    ``last - p``, a long and a short causal column, so that every program gets about the same work)."""
    count = (p * BLOCK_N < nk).to(gl.int32)
    if PAIRED:
        if gl.cdiv(nk, BLOCK_N) - 1 - p != p:
            count += 1
    return count


@gluon.jit
def _key_block(p, j, nk, PAIRED: gl.constexpr, BLOCK_N: gl.constexpr):
    """The ``j``-th key block of a program whose first is ``p`` (``j`` 0 or 1)."""
    if PAIRED:
        if j > 0:
            p = gl.cdiv(nk, BLOCK_N) - 1 - p
    return p


@gluon.jit
def _query_walk(n0, nq, nk, left, right, b, h, group, Q_NUM, list_sb, list_sh, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, USE_LIST: gl.constexpr,
                LIST_M: gl.constexpr, LIST_N: gl.constexpr):
    """The query blocks a program walks for the key block from ``n0``, per query head of its group: ``(lo, count,
    row)``, blocks ``lo .. lo + count - 1`` of the band (:func:`_query_blocks`), or with ``USE_LIST`` the
    ``count = SUBS * entries`` kernel blocks of the block list's row ``row`` (the list of the group's first query
    head, which is every head's when the list is shared or the group has one head)."""
    if USE_LIST:
        row = b * list_sb + (h * group) * list_sh + n0 // LIST_N
        count = (gl.load(Q_NUM + row * 2) + gl.load(Q_NUM + row * 2 + 1)) * (LIST_M // BLOCK_M)
        lo = row * 0
    else:
        lo, hi = _query_blocks(n0, nq, nk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        count = hi - lo
        row = lo * 0
    return lo, count, row


@gluon.jit
def _query_start(i, lo, row, Q_IDX, list_w, BLOCK_M: gl.constexpr, USE_LIST: gl.constexpr, LIST_M: gl.constexpr):
    """The first row of the ``i``-th query block of a walk (:func:`_query_walk`)."""
    if USE_LIST:
        SUBS: gl.constexpr = LIST_M // BLOCK_M
        return gl.load(Q_IDX + row * list_w + i // SUBS) * LIST_M + (i % SUBS) * BLOCK_M
    else:
        return (lo + i) * BLOCK_M


@gluon.jit
def _rows_descriptor(X, b64, row0, rows, heads, sb, sh, sn, BLOCK: gl.constexpr, HEAD_D: gl.constexpr,
                     LAYOUT: gl.constexpr):
    """The descriptor of ``rows`` rows of batch row ``b64`` of ``X`` ``(B, N, H, D)`` (strides ``sb``, ``sn``,
    ``sh``) from row ``row0``, read as ``(1, heads, rows, D)`` in boxes of ``BLOCK`` rows of one head: past them,
    zeros."""
    return tma.make_tensor_descriptor(X + b64 * sb + row0.to(gl.int64) * sn, shape=[1, heads, rows, HEAD_D],
                                      strides=[sb, sh, sn, 1], block_shape=[1, 1, BLOCK, HEAD_D], layout=LAYOUT)


@gluon.jit
def _loader(Q, K, V, DO, STATS, CU_Q, CU_K, WORK, Q_NUM, Q_IDX, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb,
            sdn, sdh, seq_q, seq_k, n_heads, group, n_batch, n_pad, n_work, left, right, list_sb, list_sh, list_w,
            k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_free, ready, empty, HEAD_D: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
            PAIRED: gl.constexpr, VARLEN: gl.constexpr, CAUSAL: gl.constexpr, USE_LIST: gl.constexpr,
            LIST_M: gl.constexpr, LIST_N: gl.constexpr, KV_PARTS: gl.constexpr, KV_LAYOUT: gl.constexpr,
            HEADS_FIRST: gl.constexpr = False, HOST_DESC: gl.constexpr = False):
    """The loader partition: the program's ``BLOCK_N`` K and V rows once, in ``KV_PARTS`` parts (one per consumer
    that owns keys, or one for consumers that share them; ``kv_bar`` one barrier a part), then Q and dO of every
    query block of every query head of the group into the two buffers (a buffer is refilled once both consumers are
    done with it). ``HOST_DESC`` (dense calls): Q, K, V, DO and STATS are descriptors made on the host over every
    batch row (:func:`longattn.backends.gluon.tma.bhnd_descriptor`; coordinate ``b``), not made here from the
    sequence's rows (a round trip to global memory each)."""
    PART: gl.constexpr = BLOCK_N // KV_PARTS
    if CAUSAL:
        right = 0  # known at compile time
    n_kv_heads = n_heads // group
    h = _kv_head(HEADS_FIRST)
    b, s, p, nq, nk, q0, k0, stats_col0 = _sequence(CU_Q, CU_K, WORK, n_work, seq_q, seq_k, VARLEN, HEADS_FIRST,
                                                    BLOCK_N)
    if HOST_DESC:
        q_desc, do_desc, k_desc, v_desc, stats_desc = Q, DO, K, V, STATS
        bq = b  # (the descriptors span every batch row)
    else:
        b64 = b.to(gl.int64)
        # Descriptors of this sequence's rows (at least one: an empty sequence loads nothing): past its end, zeros.
        rows_q = gl.maximum(nq, 1)
        rows_k = gl.maximum(nk, 1)
        q_desc = _rows_descriptor(Q, b64, q0, rows_q, n_heads, sqb, sqh, sqn, BLOCK_M, HEAD_D, BOX16)
        do_desc = _rows_descriptor(DO, b64, q0, rows_q, n_heads, sdb, sdh, sdn, BLOCK_M, HEAD_D, BOX16)
        k_desc = _rows_descriptor(K, b64, k0, rows_k, n_kv_heads, skb, skh, skn, PART, HEAD_D, KV_LAYOUT)
        v_desc = _rows_descriptor(V, b64, k0, rows_k, n_kv_heads, svb, svh, svn, PART, HEAD_D, KV_LAYOUT)
        stats_desc = tma.make_tensor_descriptor(STATS, shape=[n_batch * n_heads * 2, n_pad], strides=[n_pad, 1],
                                                block_shape=[2, BLOCK_M], layout=ROWS32)
        bq = 0
    t0 = 0  # query tiles loaded so far (the buffers' ring position)
    for j in range(_key_blocks(p, nk, PAIRED, BLOCK_N)):
        n0 = _key_block(p, j, nk, PAIRED, BLOCK_N) * BLOCK_N
        if j > 0:
            mbarrier.wait(kv_free.index(0), 0)  # both consumers are done with the previous key block's K and V
        for part in gl.static_range(KV_PARTS):
            mbarrier.expect(kv_bar.index(part), 2 * k_desc.block_type.nbytes)
            tma_load(k_desc, [bq, h, n0 + part * PART, 0], kv_bar.index(part), k_smem.index(part))
            tma_load(v_desc, [bq, h, n0 + part * PART, 0], kv_bar.index(part), v_smem.index(part))
        lo, n_blocks, row = _query_walk(n0, nq, nk, left, right, b, h, group, Q_NUM, list_sb, list_sh, BLOCK_M,
                                        BLOCK_N, HAS_LEFT, HAS_RIGHT, USE_LIST, LIST_M, LIST_N)
        for i in range(group * n_blocks):  # query head h * group + i // n_blocks, its (i % n_blocks)-th block
            t = t0 + i
            st = t % 2
            hq = h * group + i // n_blocks
            m0 = _query_start(i % n_blocks, lo, row, Q_IDX, list_w, BLOCK_M, USE_LIST, LIST_M)
            # A fresh barrier counts as having finished the phase before its first, so the first lap does not wait.
            mbarrier.wait(empty.index(st), ((t // 2) & 1) ^ 1)
            mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma_load(q_desc, [bq, hq, m0, 0], ready.index(st), q_smem.index(st))
            tma_load(do_desc, [bq, hq, m0, 0], ready.index(st), do_smem.index(st))
            tma_load(stats_desc, [(b * n_heads + hq) * 2, stats_col0 + m0], ready.index(st), stats_smem.index(st))
        t0 += group * n_blocks


@gluon.jit
def _scores(s_t, key_pos, row_pos, qk_scale, mods, ST_LAYOUT: gl.constexpr, SOFTCAP: gl.constexpr,
            ALIBI: gl.constexpr, TIED: gl.constexpr):
    """The modified scores of a ``S^T`` tile (keys by queries) in base 2, and ``tanh`` of the capped ones (0 without
    ``SOFTCAP``): soft-capping at ``mods[0]`` (base 2), then ALiBi with slope ``mods[1]`` (base 2) over the distance
    ``|row_pos - key_pos|`` (the Triton kernels' ``modified_scores``). The positions are float32, relative to the
    tile's first key (``row_pos = i + shift + alibi_offset - n0``, ``key_pos = j - n0``): exact integers below
    ``2**24``, so the distance is the integer one without an integer-to-float conversion per score."""
    x = s_t * qk_scale
    t = x * 0.0
    if SOFTCAP:  # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        e = gl.exp2(x * (2.0 * LOG2E / mods[0]))
        t = 1.0 - gl.fdiv(gl.full(x.shape, 2.0, gl.float32, ST_LAYOUT), e + 1.0, ieee_rounding=False)
        x = mods[0] * t
    if ALIBI:
        if TIED:
            # ``x * 0`` ties the distances to the scores: without it they are computed before the wait for S^T, a
            # tile more of live registers while the products run (452 bytes of spills instead of 188 at D=128,
            # Triton 3.6). Where registers are not short (D=64) the early start is free, and the tie would cost.
            x = x - mods[1] * gl.abs((x * 0.0 + row_pos[None, :]) - key_pos[:, None])
        else:
            x = x - mods[1] * gl.abs(row_pos[None, :] - key_pos[:, None])
    return x, t


@gluon.jit
def _dq_descriptor(DQ, b, q0, nq, seq_q, n_heads, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, COLS: gl.constexpr):
    """The descriptor of this sequence's rows of the float32 dQ, ``(B, N, H, D)`` contiguous, in boxes of
    ``BLOCK_M`` rows by ``COLS`` columns (the reduce-add drops rows past the sequence's end)."""
    return tma.make_tensor_descriptor(DQ + (b.to(gl.int64) * seq_q + q0) * (n_heads * HEAD_D),
                                      shape=[1, n_heads, gl.maximum(nq, 1), HEAD_D],
                                      strides=[seq_q * n_heads * HEAD_D, HEAD_D, n_heads * HEAD_D, 1],
                                      block_shape=[1, 1, BLOCK_M, COLS], layout=BOX32)


@gluon.jit
def _store_dkdv(DK, DV, dk, dv, scale, b, seq_k, k0, n0, col0, nk, n_kv_heads, h, HEAD_D: gl.constexpr,
                N_KEYS: gl.constexpr, N_COLS: gl.constexpr, ACC_LAYOUT: gl.constexpr):
    """``dk * scale`` and ``dv`` (``N_KEYS`` keys from ``n0`` by ``N_COLS`` head-dim columns from ``col0``) into DK
    and DV, contiguous ``(B, M, Hk, D)``; keys past the sequence's end are not stored."""
    out_rows = n0 + gl.arange(0, N_KEYS, layout=gl.SliceLayout(1, ACC_LAYOUT))
    d = col0 + gl.arange(0, N_COLS, layout=gl.SliceLayout(0, ACC_LAYOUT))
    offs = (((b.to(gl.int64) * seq_k + k0) + out_rows[:, None].to(gl.int64)) * n_kv_heads + h) * HEAD_D + d[None, :]
    ok = (out_rows < nk)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def _dkdv_descriptor(X, b, seq_k, k0, nk, n_kv_heads, HEAD_D: gl.constexpr, N_KEYS: gl.constexpr):
    """The descriptor of this sequence's rows of DK or DV (contiguous ``(B, M, Hk, D)``, a packed batch's sequence
    from row ``k0``), in boxes of ``N_KEYS`` keys by all of D: a store drops the rows past the sequence's end."""
    return tma.make_tensor_descriptor(X + (b.to(gl.int64) * seq_k + k0) * (n_kv_heads * HEAD_D),
                                      shape=[1, n_kv_heads, gl.maximum(nk, 1), HEAD_D],
                                      strides=[seq_k * n_kv_heads * HEAD_D, HEAD_D, n_kv_heads * HEAD_D, 1],
                                      block_shape=[1, 1, N_KEYS, HEAD_D], layout=BOX16)


@gluon.jit
def _store_dkdv_tma(dk_desc, dv_desc, dk, dv, scale, n0, h, dk_smem, dv_smem, dk_free, dk_phase,
                    HEAD_D: gl.constexpr, N_KEYS: gl.constexpr, WAIT_DK: gl.constexpr, b=0):
    """:func:`_store_dkdv` through shared memory and TMA stores (all of D; DK and DV of the inputs' 16-bit dtype):
    ``dv`` into ``dv_smem`` and ``dk * scale`` into ``dk_smem`` (``[1, 1, N_KEYS, HEAD_D]`` tiles of layout
    ``BOX16`` that nothing reads or loads into any more; ``dk_smem`` only once the barrier ``dk_free`` has
    completed the phase ``dk_phase`` where ``WAIT_DK``), then one TMA store each by the descriptors of
    :func:`_dkdv_descriptor` (which clip the rows past the sequence's end), at batch coordinate ``b`` (0 there; a
    host-made descriptor of every batch row takes the row's). The caller waits for the stores (``tma.store_wait``)
    before its shared memory is released."""
    dv_smem.reshape([N_KEYS, HEAD_D]).store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma_store(dv_desc, [b, h, n0, 0], dv_smem)
    if WAIT_DK:
        mbarrier.wait(dk_free, dk_phase)
    dk_smem.reshape([N_KEYS, HEAD_D]).store((dk * scale).to(dk_desc.dtype))
    fence_async_shared()
    tma_store(dk_desc, [b, h, n0, 0], dk_smem)


@gluon.jit
def _probabilities(s_t, keys, rows, n0, row0, nk, shift, left, right, qk_scale, lse2, softcap, slope, alibi_offset,
                   ST_LAYOUT: gl.constexpr, N_KEYS: gl.constexpr, N_ROWS: gl.constexpr, HAS_LEFT: gl.constexpr,
                   HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, TIED: gl.constexpr,
                   LSE_IN_S: gl.constexpr = False):
    """``(P^T, tanh)`` of an ``S^T`` tile of keys ``n0 .. n0 + N_KEYS - 1`` (``keys``) by query rows ``row0 .. row0 +
    N_ROWS - 1`` (``rows``): the modified scores (:func:`_scores`), ``exp2(x - lse2)``, masked where the band cuts
    the tile and past the keys' end; ``tanh`` of the capped scores (0 without ``SOFTCAP``). ``LSE_IN_S`` (neither
    ``SOFTCAP`` nor ``ALIBI``): ``s_t`` already holds ``S^T - lse2 / qk_scale`` (the statistics folded into the
    product's initial accumulator), ``lse2`` is not read and ``P^T = exp2(s_t * qk_scale)``."""
    if LSE_IN_S:
        gl.static_assert(not (SOFTCAP or ALIBI), "lse2 folds into S^T only for unmodified scores")
        p_t = gl.exp2(s_t * qk_scale)
        tanh_t = p_t * 0.0  # (not read)
    elif SOFTCAP or ALIBI:
        row_pos = (rows + (shift + alibi_offset - n0)).to(gl.float32)
        key_pos = gl.arange(0, N_KEYS, layout=gl.SliceLayout(1, ST_LAYOUT)).to(gl.float32)
        x_t, tanh_t = _scores(s_t, key_pos, row_pos, qk_scale, (softcap * LOG2E, slope), ST_LAYOUT, SOFTCAP, ALIBI,
                              TIED)
        p_t = gl.exp2(x_t - lse2[None, :])
    else:
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        tanh_t = p_t * 0.0  # (not read)
    if HAS_RIGHT:
        # Only the tiles the band cuts: some key lies past the first row's last key.
        if n0 + N_KEYS - 1 > row0 + shift + right:
            p_t = gl.where(keys[:, None] <= rows[None, :] + (shift + right), p_t, 0.0)
    if HAS_LEFT:
        # ... or before the last row's first key.
        if n0 < row0 + N_ROWS - 1 + shift - left:
            p_t = gl.where(keys[:, None] >= rows[None, :] + (shift - left), p_t, 0.0)
    if n0 + N_KEYS > nk:
        # Keys past the end load as zeros: weight 0 (exp2(-lse2) could overflow, and inf * 0 is NaN in dQ).
        p_t = gl.where(keys[:, None] < nk, p_t, 0.0)
    return p_t, tanh_t
