"""Hopper (sm_90) forward kernel in Gluon: persistent, warp-specialised, softmax overlapping the tensor cores.

A tile is ``N_CONS * SUB_M`` query rows of one (batch, head) (two consumers of 64 rows at D=128, three at D=64).
The grid has one program per SM (persistent): each
program takes its first tile by its index and every later one from a global counter (dynamic scheduling, so the
unequal tiles of a causal mask spread evenly); tiles are numbered head by head (the programs at work share a
head's K and V in L2) and, within a head, from the last query block (under a causal mask the longest first).
Each program has three partitions:

- the **loader** (four warps, or one beside two consumers: ``LOADER_WARPS``; few registers) picks the tiles,
  loads the query parts of a tile into one of two Q buffers and streams the K and V tiles of ``BLOCK_N`` keys
  through a ring of ``STAGES`` shared-memory buffers by TMA. It runs ahead into the next tile while the consumers finish
  the current one, so a tile's start costs no compute time (at D=256 one Q buffer, for shared memory: the next tile's Q
  loads once the consumers are done with the current one's);
- ``N_CONS`` **consumers** (one warpgroup each, ``SUB_M`` rows each) take every K/V tile in turn. For key block ``c``
  a consumer issues ``S_c = Q K_c^T`` and the previous block's ``O += P_{c-1} V_{c-1}`` as asynchronous
  ``wgmma``, waits for the scores only and runs the online softmax of block ``c`` while the tensor cores finish
  the product (FlashAttention-3's overlap within a warpgroup; with ``PV_WAIT``, the band-free float8 tiles, the
  previous product is waited for before ``S_c`` is issued, for registers); the consumers take turns to issue their
  products (an mbarrier each, round robin), so one's softmax runs while another's products keep the tensor cores
  busy (its ping-pong between warpgroups). At D=64 the products are half as deep for the same softmax work per
  score, so three consumers (at 160 registers each) keep the tensor cores fed. Each consumer stores its rows of the output and log-sum-exp.

The key blocks a tile walks are the Triton forward's (``jit.visible_key_blocks``): masked edge blocks cut by the
causal band, the window or the sequence end, unmasked interior ones. Tiles are loaded through 4-D descriptors of
(batch, heads, rows, head dim), so rows past the end of a sequence arrive as zeros, never another head's values.
Grouped-query heads read K/V head
``h // group``. Scores are scaled into base 2 once; the output is normalised at the end and the log-sum-exp
(natural log) stored in float32, ``-inf`` (output 0) for rows that see no key.

With ``VARLEN`` the tensors hold a packed batch (one batch row; sequence ``b`` is rows ``CU_Q[b]:CU_Q[b + 1]``
of Q and ``CU_K[b]:CU_K[b + 1]`` of K and V): the tiles are the query blocks of all sequences in a row, each
sequence's causal band and window aligned bottom-right as in the Triton forward, and V is read through a
descriptor bounded by the tile's sequence (see :func:`_loader`).

With ``FP8`` q, k and v are float8 (sm_90's FP8 tensor cores), V given sequence-major (``svd`` its head-dim
stride, unit stride along the keys; with ``FP8 == 2``, the launcher's, the keys of each group of 16 permuted and the
rows padded to a multiple of 16 keys) so that ``P V``'s second operand is K-major; descale factors per (batch, KV head)
join the score scale and the output, and the probabilities are rounded to float8 in units of ``2**-P_SHIFT`` as in
the Triton forward.

Barrier phases: every ring (K, V, Q, turns) is indexed by a counter that runs over the whole program (not one
tile), so the loader and the consumers agree on the buffer and phase of every use; the loader tells the
consumers which tile comes next through a shared-memory slot beside each Q buffer.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from longattn.backends import kernel_args

# Triton 3.6 calls the TMA load async_copy_global_to_shared; later releases async_load (the old name raises).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# The same for the TMA store (O_TMA): async_copy_shared_to_global in Triton 3.6, async_store later.
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

# Tiles are loaded as (1, 1, rows, head dim) boxes of 4-D descriptors and used as (rows, head dim) matrices
# (float8 values: (1, 1, head dim, keys) boxes of the sequence-major V, used transposed). BOX16: the layout of
# 16-bit tiles at every head dim (rows of 128 bytes or more), which fwd_pingpong.py allocates with.
BOX16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4))
P_SHIFT = gl.constexpr(kernel_args.P_SHIFT)
LOG2E = gl.constexpr(kernel_args.LOG2E)
LN2 = gl.constexpr(kernel_args.LN2)
FLT_MAX = gl.constexpr(3.4028234663852886e38)  # the largest float32
# The cubic of _exp2_asm (its PTX spells the coefficients' bits; tests/test_gluon.py checks the two agree).
EXP2_CUBIC = (0.078024030, 0.22606707, 0.69583398, 0.99992514)


@gluon.constexpr_function
def box_layout(rows, cols, dtype):
    """The shared layout of a (1, 1, ``rows``, ``cols``) box of ``dtype`` (a TMA load's destination and a ``wgmma``
    operand, K-major): the widest swizzle the rows take, from their bytes (Gluon's default). Rows of 128 bytes or
    more (16-bit tiles, float8 ones from 128 columns) take the 128-byte swizzle, longer rows being several
    128-byte atoms side by side (TMA loads them as one box per atom, the ``wgmma`` steps through them along K);
    64-byte rows (float8 at D=64, or V's 64-key float8 tiles) the 64-byte swizzle."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], dtype)


@gluon.constexpr_function
def q_buffers(head_d, dtype):
    """Q buffers of the forward: two (the next tile's Q loads while this one's runs) for rows of up to 256 bytes,
    one for longer rows (bf16 at D=256, whose 64-key K/V stages and two Q buffers would need 256 KB of shared
    memory)."""
    return 2 if head_d * dtype.primitive_bitwidth // 8 <= 256 else 1


@gluon.jit
def _key_blocks(m0, n_q, n_k, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                HAS_RIGHT: gl.constexpr):
    """Key blocks ``lo <= full_lo <= full_hi <= hi`` of the query block from row ``m0`` of a sequence of ``n_q``
    queries and ``n_k`` keys (blocks in ``[full_lo, full_hi)`` need no mask; the rule of
    ``longattn.backends.triton.jit.visible_key_blocks``)."""
    shift = n_k - n_q
    lo_key = m0 * 0
    hi_key = m0 * 0 + n_k
    full_lo_key = m0 * 0
    full_hi_key = m0 * 0 + n_k
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
def _tile(t, n_tiles_m, n_heads, seq_q, seq_k, CU_Q, CU_K, CUM, n_seqs, BLOCK_M: gl.constexpr,
          VARLEN: gl.constexpr):
    """Tile ``t``: ``(b, h, m0, q0, n_q, k0, n_k)``, its sequence, head, first query row in the sequence, and the
    sequence's first rows and lengths in the tensors (``q0 = k0 = 0`` unless packed). Tiles run head by head (the
    programs working at one time share a head's K and V in L2), from the last query block of the head to the
    first (under a causal mask, the longest first). A packed batch (``VARLEN``) numbers the query blocks of all its
    sequences in a row (``CUM[b]``: blocks before sequence ``b``, ``n_tiles_m`` of them in all) and finds a block's
    sequence by bisection."""
    h = t // n_tiles_m
    j = n_tiles_m - 1 - t % n_tiles_m
    if VARLEN:
        lo = j * 0
        hi = j * 0 + n_seqs  # CUM[lo] <= j < CUM[hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            below = gl.load(CUM + mid) <= j
            lo = gl.where(below, mid, lo)
            hi = gl.where(below, hi, mid)
        b = lo
        m0 = (j - gl.load(CUM + b)) * BLOCK_M
        q0 = gl.load(CU_Q + b)
        k0 = gl.load(CU_K + b)
        n_q = gl.load(CU_Q + b + 1) - q0
        n_k = gl.load(CU_K + b + 1) - k0
    else:
        b = h // n_heads
        m0 = j * BLOCK_M
        q0 = j * 0
        k0 = j * 0
        n_q = j * 0 + seq_q
        n_k = j * 0 + seq_k
    return b, h % n_heads, m0, q0, n_q, k0, n_k


@gluon.jit
def _put(slot, i, value, WARPS: gl.constexpr):
    SCALAR: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    slot.index(i).store(gl.full([1], value, gl.int32, SCALAR))


@gluon.jit
def _get(slot, i):
    SCALAR: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(slot.index(i).load(SCALAR), 0)


SLOT = gl.constexpr(8)  # fields of a tile handed to the consumers: t, and when packed b, h, m0, q0, n_q, n_k


@gluon.jit
def _ring(c, STAGES: gl.constexpr):
    """Slot and phase of the ``c``-th K/V tile (``c >= 0``) of a ring of ``STAGES`` buffers. Unsigned: with a ring of
    two the pair costs a mask and a shift where signed division and remainder take about eight uniform instructions
    each (their rounding toward zero), every key block."""
    u = c.to(gl.uint32)
    return (u % STAGES).to(gl.int32), ((u // STAGES) & 1).to(gl.int32)


@gluon.jit
def _load_kv(k_desc, v_desc, bd, kvh, k0, n_k, lo, hi, c0, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr, RAGGED: gl.constexpr = False):
    """K and V of key blocks ``lo .. hi`` of one tile into the ring (``c0``: blocks loaded before). K rows are
    those of ``k_desc`` from row ``k0``; V rows those of ``v_desc`` from row 0 (a packed batch's V descriptor
    starts at its sequence; ``bd`` is 0 there), or with ``RAGGED`` those of :func:`_ragged_desc`'s descriptor from
    row ``k0``, bounded at ``k0 + n_k``."""
    for blk in range(lo, hi):
        c = c0 + blk - lo
        st, lap = _ring(c, STAGES)
        mbarrier.wait(k_empty.index(st), lap ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma_load(k_desc, [bd, kvh, k0 + blk * BLOCK_N, 0], k_ready.index(st), k_smem.index(st))
        mbarrier.wait(v_empty.index(st), lap ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        if FP8:
            tma_load(v_desc, [bd, kvh, 0, blk * BLOCK_N], v_ready.index(st), v_smem.index(st))
        elif RAGGED:
            tma_load(v_desc, [RAGGED_ROWS, k0 + n_k, kvh, RAGGED_ROWS - n_k + blk * BLOCK_N, 0], v_ready.index(st),
                     v_smem.index(st))
        else:
            tma_load(v_desc, [bd, kvh, blk * BLOCK_N, 0], v_ready.index(st), v_smem.index(st))


@gluon.jit
def _sequence_desc(X, row0, n_rows, sxb, sxn, sxh, n_kv_heads, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                   BOX: gl.constexpr):
    """A device-side descriptor of rows ``row0 .. row0 + n_rows`` of the packed ``X`` (K/V heads x rows x head
    dim boxes of ``BLOCK_N`` rows): loads past the sequence's end read zeros, not the next sequence's rows."""
    shape = [1, n_kv_heads, gl.maximum(n_rows, 1), HEAD_D]
    return tma.make_tensor_descriptor(X + row0.to(gl.int64) * sxn, shape=shape, strides=[sxb, sxh, sxn, 1],
                                      block_shape=[1, 1, BLOCK_N, HEAD_D], layout=BOX)


# The ragged descriptor's row bound (2**30): a sequence's rows are indices RAGGED_ROWS - n .. RAGGED_ROWS - 1 of it.
RAGGED_ROWS = gl.constexpr(1 << 30)


@gluon.constexpr_function
def ragged_box_layout(rows, cols, dtype):
    """The shared layout of a (1, 1, 1, ``rows``, ``cols``) box of :func:`_ragged_desc` (as :func:`box_layout`)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, 1, rows, cols], dtype)


@gluon.jit
def _ragged_desc(X, sxn, sxh, n_kv_heads, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr):
    """One descriptor of the packed ``X`` (rows x K/V heads x head dim) that reads any sequence bounded by its own
    rows (Triton's ``triton.tools.ragged_tma`` construction, made on the device): five dims, the first two of stride
    ``2**34 - sxn`` and ``sxn`` (elements), then heads, rows (bound ``RAGGED_ROWS``) and the head dim. Coordinates
    ``(RAGGED_ROWS, k0 + n, kvh, RAGGED_ROWS - n + r, 0)`` address row ``k0 + r`` of K/V head ``kvh``: the first
    coordinate adds ``2**64`` elements (a multiple of ``2**64`` bytes: the address wraps back) less
    ``RAGGED_ROWS * sxn``, the rest ``(k0 + n + RAGGED_ROWS - n + r) * sxn``; rows ``r >= n`` fall past the bound
    and read zeros. So a tile's V rows past its sequence's end are zeros, with no descriptor per tile. Strides are
    16-byte multiples as TMA needs where ``sxn`` is (the launcher's alignment check)."""
    sxn64 = sxn.to(gl.int64)
    return tma.make_tensor_descriptor(X, shape=[0x7FFF0000, 0x7FFF0000, n_kv_heads, RAGGED_ROWS, HEAD_D],
                                      strides=[(1 << 34) - sxn64, sxn64, sxh, sxn, 1],
                                      block_shape=[1, 1, 1, BLOCK_N, HEAD_D], layout=BOX)


@gluon.jit
def _loader(Q, K, V, COUNTER, CU_Q, CU_K, CUM, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svd, seq_q, seq_k, B,
            n_seqs, n_heads, group, left, right, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready,
            q_empty, k_ready, v_ready, k_empty, v_empty,
            HEAD_D: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, FP8: gl.constexpr, VARLEN: gl.constexpr,
            N_CONS: gl.constexpr, LOADER_WARPS: gl.constexpr, PACKED_SCHED: gl.constexpr = 0):
    """The loader partition: per tile, the ``N_CONS`` query parts, then K and V of its key blocks. The descriptors are
    made once, of the whole tensors as (batch, heads, rows, head dim) boxes, so each (batch, head) view is bounded
    by its own rows. A packed batch is one batch row: its query and key rows past a sequence's end are the next
    sequence's (the query rows' outputs are not stored, the keys' scores are masked), but a value row read there
    would meet a zero probability, and ``0 * inf`` is NaN; so V gets a descriptor per tile, bounded by the
    sequence, made in one of two scratch slots by tile parity (one at D=256, with one Q buffer; a slot is rewritten
    only once the tile that last used it is done: the loader waits for its Q buffer first). The loader picks the tiles: its program's index
    first, then the next from the global ``COUNTER`` (dynamic scheduling: causal tiles differ in length), handed to
    the consumers with what they need of them in ``tile_slot`` (``SLOT`` fields per Q buffer).

    ``PACKED_SCHED`` (packed batches, see flash_fwd) takes the serial set-up of a tile off the path between two tiles:
    V is read through one ragged descriptor (:func:`_ragged_desc`, made once) instead of a descriptor per tile, and the
    next tile is claimed and found (the atomic, the bisection and the sequence's bounds, all dependent loads) once
    this tile's first key block is on its way rather than after its last (1), or there is no next tile: one program a
    tile (2)."""
    Q_BUFS: gl.constexpr = q_smem.shape[0] // N_CONS  # Q buffers (see flash_fwd)
    # The descriptors' boxes are laid out as the buffers they load into.
    V_BOX: gl.constexpr = v_smem.layout
    q_desc = tma.make_tensor_descriptor(Q, shape=[B, n_heads, seq_q, HEAD_D], strides=[sqb, sqh, sqn, 1],
                                        block_shape=[1, 1, SUB_M, HEAD_D], layout=q_smem.layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, n_heads // group, seq_k, HEAD_D], strides=[skb, skh, skn, 1],
                                        block_shape=[1, 1, BLOCK_N, HEAD_D], layout=k_smem.layout)
    if FP8:
        # With FP8 == 2 the keys are stored permuted in groups of 16 (see _to_operand_permuted), so a sequence's
        # last keys may sit past seq_k: V's rows hold ceil(seq_k / 16) * 16 keys, the padding zero.
        v_keys = (seq_k + 15) // 16 * 16 if FP8 == 2 else seq_k
        v_desc = tma.make_tensor_descriptor(V, shape=[B, n_heads // group, HEAD_D, v_keys], strides=[svb, svh, svd, 1],
                                            block_shape=[1, 1, HEAD_D, BLOCK_N], layout=V_BOX)
    elif PACKED_SCHED:
        v_desc = _ragged_desc(V, svn, svh, n_heads // group, HEAD_D, BLOCK_N, V_BOX)
    else:
        v_desc = tma.make_tensor_descriptor(V, shape=[B, n_heads // group, seq_k, HEAD_D],
                                            strides=[svb, svh, svn, 1], block_shape=[1, 1, BLOCK_N, HEAD_D],
                                            layout=V_BOX)
    c0 = 0  # K/V blocks loaded by this program before the current tile
    n = 0  # tiles of this program before the current one
    t = gl.program_id(0)  # the first tiles go one per program, the rest to whichever program asks first
    # With PACKED_SCHED the fields of the tile to come are found ahead, also for a tile past the end (which are
    # some sequence's, unused; the divisor kept from 0 where there is no tile at all).
    blocks = gl.maximum(n_tiles_m, 1)
    if PACKED_SCHED:
        nb, nh, nm0, nq0, nn_q, nk0, nn_k = _tile(t, blocks, n_heads, seq_q, seq_k, CU_Q, CU_K, CUM, n_seqs,
                                                  N_CONS * SUB_M, VARLEN)
    while t < n_tiles:
        if PACKED_SCHED:
            b, h, m0, q0, n_q, k0, n_k = nb, nh, nm0, nq0, nn_q, nk0, nn_k
        else:
            b, h, m0, q0, n_q, k0, n_k = _tile(t, n_tiles_m, n_heads, seq_q, seq_k, CU_Q, CU_K, CUM, n_seqs,
                                               N_CONS * SUB_M, VARLEN)
        lo, full_lo, full_hi, hi = _key_blocks(m0, n_q, n_k, left, right, N_CONS * SUB_M, BLOCK_N, HAS_LEFT,
                                               HAS_RIGHT)
        kvh = h // group
        bd = b  # the descriptors' batch index (a packed batch has one)
        if VARLEN:
            bd = b * 0
        qb = n % Q_BUFS
        # A fresh barrier counts as having finished the phase before its first, so the first lap does not wait.
        mbarrier.wait(q_empty.index(qb), ((n // Q_BUFS) & 1) ^ 1)
        _put(tile_slot, qb * SLOT, t, LOADER_WARPS)  # the consumers read the fields after q_ready
        if VARLEN:  # found by bisection: handed over (a dense tile's fields are cheaper to compute again)
            _put(tile_slot, qb * SLOT + 1, b, LOADER_WARPS)
            _put(tile_slot, qb * SLOT + 2, h, LOADER_WARPS)
            _put(tile_slot, qb * SLOT + 3, m0, LOADER_WARPS)
            _put(tile_slot, qb * SLOT + 4, q0, LOADER_WARPS)
            _put(tile_slot, qb * SLOT + 5, n_q, LOADER_WARPS)
            _put(tile_slot, qb * SLOT + 6, n_k, LOADER_WARPS)
        mbarrier.expect(q_ready.index(qb), N_CONS * q_desc.block_type.nbytes)
        for part in gl.static_range(N_CONS):
            tma_load(q_desc, [bd, h, q0 + m0 + part * SUB_M, 0], q_ready.index(qb), q_smem.index(N_CONS * qb + part))
        if PACKED_SCHED:
            # The first key block, then the next tile's claim and look-up while the consumers work, then the rest.
            first = gl.minimum(lo + 1, hi)
            _load_kv(k_desc, v_desc, bd, kvh, k0, n_k, lo, first, c0, k_smem, v_smem, k_ready, v_ready, k_empty,
                     v_empty, BLOCK_N, STAGES, FP8, True)
            if PACKED_SCHED == 2:
                t = n_tiles
                nb, nh, nm0, nq0, nn_q, nk0, nn_k = b, h, m0, q0, n_q, k0, n_k
            else:  # (a ticket, publishing nothing: relaxed, without the acquire's fence and L1 invalidation)
                t = gl.atomic_add(COUNTER, 1, sem="relaxed") + gl.num_programs(0)
                nb, nh, nm0, nq0, nn_q, nk0, nn_k = _tile(t, blocks, n_heads, seq_q, seq_k, CU_Q, CU_K, CUM,
                                                          n_seqs, N_CONS * SUB_M, VARLEN)
            _load_kv(k_desc, v_desc, bd, kvh, k0, n_k, first, hi, c0 + first - lo, k_smem, v_smem, k_ready, v_ready,
                     k_empty, v_empty, BLOCK_N, STAGES, FP8, True)
        elif VARLEN:
            # Two call sites of the (inlined) descriptor helper, so two scratch slots, used by tile parity.
            if qb == 0:
                _load_kv(k_desc, _sequence_desc(V, k0, n_k, svb, svn, svh, n_heads // group, HEAD_D, BLOCK_N, V_BOX),
                         bd, kvh, k0, n_k, lo, hi, c0, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, BLOCK_N,
                         STAGES, FP8)
            else:
                _load_kv(k_desc, _sequence_desc(V, k0, n_k, svb, svn, svh, n_heads // group, HEAD_D, BLOCK_N, V_BOX),
                         bd, kvh, k0, n_k, lo, hi, c0, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, BLOCK_N,
                         STAGES, FP8)
        else:
            _load_kv(k_desc, v_desc, bd, kvh, k0, n_k, lo, hi, c0, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     BLOCK_N, STAGES, FP8)
        c0 += hi - lo
        n += 1
        if not PACKED_SCHED:
            t = gl.atomic_add(COUNTER, 1) + gl.num_programs(0)
    # No tile left: hand the consumers an index past the end, which ends their loops.
    qb = n % Q_BUFS
    mbarrier.wait(q_empty.index(qb), ((n // Q_BUFS) & 1) ^ 1)
    _put(tile_slot, qb * SLOT, t, LOADER_WARPS)
    mbarrier.arrive(q_ready.index(qb), count=1)


@gluon.jit
def _visible(start_n, rows, n_k, shift, left, right, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr,
             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Which (row, key) pairs of the score tile of keys ``start_n ...`` the band and the sequence end allow."""
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    hi = n_k - 1 + rows * 0
    if HAS_RIGHT:
        hi = gl.minimum(rows + shift + right, hi)
    ok = cols[None, :] <= hi[:, None]
    if HAS_LEFT:
        ok = ok & (cols[None, :] >= (rows + shift - left)[:, None])
    return ok


@gluon.jit
def _tanh(x):
    """``tanh(x)`` by the hardware's ``tanh.approx.f32``: one special-function op where
    ``1 - 2 / (2**(2x·log2 e) + 1)`` takes two (an exponential and a reciprocal), which made soft-capping bound by the
    special-function unit. Measured on an H200 over 2**24 points of [-20, 20]: at most 7.9e-6 from float64's tanh
    (1.1e-5 relative; PTX documents only 2**-11 relative), so a capped score ``cap * tanh(s / cap)`` was off by at
    most ``cap * 7.9e-6`` (4e-4 at cap 50), a tenth of the bfloat16 rounding of the probabilities
    (docs/kernel_notes.md). The backward recomputes the exact form; its probabilities differ from the forward's by as
    much. Taken with ``SOFTCAP == 2`` (the tiles' ``fast_tanh``, the default: 1.2-1.8x faster than the exact form)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.constexpr_function
def _exp2_asm(every):
    """PTX for :func:`_exp2_fma`: ``every`` exponentials, all but the last by ``ex2.approx`` (the special-function
    unit), the last as ``2**n * c(f)`` (``x = n + f``) on the FMA and integer pipes: ``x`` clamped at -126 (a NaN
    stays NaN), ``n`` found by adding 1.5 * 2**23 rounding down (the integer lands in the sum's low bits), ``c`` a
    cubic fitted to ``2**f`` on [0, 1) for relative error (at most 7.5e-5 in float32; its coefficients, highest
    first, 0.078024030, 0.22606707, 0.69583398, 0.99992514: :data:`EXP2_CUBIC`), ``2**n`` made by adding ``n`` to the
    exponent field of 1.0 (from a NaN: 0.5, the product NaN). Nine instructions in place of one, none of them on the
    special-function unit."""
    code = ["{ .reg .f32 t, j, q, f; .reg .b32 jb, sb;"]
    code += [f"ex2.approx.ftz.f32 ${i}, ${every + i};" for i in range(every - 1)]
    code += [f"max.NaN.ftz.f32 t, ${2 * every - 1}, 0fC2FC0000;", "add.rm.ftz.f32 j, t, 0f4B400000;",
             "sub.ftz.f32 q, j, 0f4B400000;", "sub.ftz.f32 f, t, q;", "fma.rn.ftz.f32 q, f, 0f3D9FCB10, 0f3E677E20;",
             "fma.rn.ftz.f32 q, q, f, 0f3F32222D;", "fma.rn.ftz.f32 q, q, f, 0f3F7FFB18;", "mov.b32 jb, j;",
             "shl.b32 sb, jb, 23;", "add.s32 sb, sb, 1065353216;", "mov.b32 f, sb;",
             f"mul.ftz.f32 ${every - 1}, q, f; }}"]
    return " ".join(code)


@gluon.constexpr_function
def _exp2_constraints(every):
    return ",".join(["=f"] * every + ["f"] * every)


@gluon.jit
def _exp2_fma(x, EVERY: gl.constexpr):
    """``2**x`` elementwise, one value in ``EVERY`` of each thread's (``GluonTiles.fma_exp2``) by a polynomial on the
    FMA pipes and the rest by the special-function unit (FlashAttention-4's split of its exponentials): where a
    softmax is bound by that unit's 16 exponentials a clock and SM, not by the issue slots. For ``-125 <= x <= 8``
    (float8's shifted scores are at most ``P_SHIFT``): relative error 7.5e-5 (``ex2.approx``: 2**-22), far below
    float8's rounding of ``P`` (2**-4); below, at most 2**-125 (float8's smallest step is 2**-9: 0 after rounding)."""
    return gl.inline_asm_elementwise(_exp2_asm(EVERY), _exp2_constraints(EVERY), [x], dtype=gl.float32,
                                     is_pure=True, pack=EVERY)


@gluon.jit
def _to_operand(p, dtype: gl.constexpr, P_LAYOUT: gl.constexpr):
    """Probabilities ``p`` (float32) rounded to ``dtype`` in the register-operand layout of ``P V``. Two 16-bit
    values are packed by one ``cvt`` with the first in the low half, the order the operand's registers hold them:
    Triton 3.6's own cast packed them the other way and swapped every register's halves after (32 ``PRMT`` a key
    block, docs/kernel_notes.md); the values are the same (round to nearest even)."""
    if dtype == gl.bfloat16:
        p16 = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [p], dtype=gl.bfloat16,
                                        is_pure=True, pack=2)
    elif dtype == gl.float16:
        p16 = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [p], dtype=gl.float16,
                                        is_pure=True, pack=2)
    else:
        p16 = p.to(dtype)
    return gl.convert_layout(p16, P_LAYOUT)


@gluon.jit
def _to_operand_permuted(p, P_LAYOUT: gl.constexpr):
    """Float8 ``P`` for ``P V`` with the keys of each group of 16 permuted as V's are stored (``FP8 == 2``), packed:
    an int32 ``(rows, BLOCK_N // 4)`` tensor, four float8 a register, for :func:`_operand_of` to hand to the
    ``wgmma``. Key ``16 h + 8 c3 + 4 c2 + 2 c1 + c0`` of the scores goes to column ``16 h + 8 c2 + 4 c1 + 2 c3 + c0``
    of the operand. The wgmma accumulator gives a lane keys ``2 c1 + 4 c2`` (its lane bits) and ``c0 + 8 c3 + 16 h``
    (its registers); the float8 register operand (``k_width=4``) gives a lane columns ``4 c1 + 8 c2`` and
    ``c0 + 2 c3 + 16 h``: under the permutation every lane already holds its operand's values, so the layout change
    is a renaming of registers (``assert_trivial``), and each 32-bit operand register is two
    ``cvt.rn.satfinite.e4m3x2.f32`` (keys ``c, c + 1`` and ``c + 8, c + 9`` of one row) and one byte pack. Carried
    between key blocks as 32-bit words: a float8 tensor would be carried as bytes, unpacked after the conversion
    and packed again before the product (compile-only, Triton 3.6: 128 ``PRMT`` and 64 ``LOP3`` a key block). Made
    after the previous product's wait (:func:`_step`): made before it, Triton 3.6's ptxas gave the new words the
    registers the product in flight still read and serialised every wgmma (C7513)."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    x = gl.reshape(p, [M, N // 16, 2, 2, 2, 2])  # (row, h, c3, c2, c1, c0)
    x = gl.permute(x, [0, 1, 3, 4, 2, 5])  # (row, h, c2, c1, c3, c0): column 16 h + 8 c2 + 4 c1 + 2 c3 + c0
    x = gl.convert_layout(gl.reshape(x, [M, N]), P_LAYOUT, assert_trivial=True)
    # Columns 4 j + 2 a + b: the operand's four bytes of one register.
    x0, x1 = gl.split(gl.reshape(x, [M, N // 4, 2, 2]))  # b = 0, 1
    a0, a2 = gl.split(x0)
    a1, a3 = gl.split(x1)
    # cvt puts its first source in the high byte: the low byte is the first column.
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", [a0, a1, a2, a3], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _operand_of(w, P_LAYOUT: gl.constexpr):
    """The float8 register operand (``P_LAYOUT``) of :func:`_to_operand_permuted`'s words ``w``: bytes taken apart
    and put together again where the ``wgmma`` reads them, which LLVM folds back to the words."""
    M: gl.constexpr = w.shape[0]
    N: gl.constexpr = w.shape[1] * 4
    b0 = w.to(gl.int8)
    b1 = (w >> 8).to(gl.int8)
    b2 = (w >> 16).to(gl.int8)
    b3 = (w >> 24).to(gl.int8)
    x = gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [M, N])
    return gl.convert_layout(x.to(gl.float8e4nv, bitcast=True), P_LAYOUT, assert_trivial=True)


@gluon.jit
def _row_parts(p, BLOCK_N: gl.constexpr):
    """Each thread's share of the row sums of a ``(rows, BLOCK_N)`` tile in the wgmma accumulator's layout: a
    ``(rows, 4)`` tensor whose four columns are the four lanes that hold a row (each lane two keys of every eight), so
    that adding a tile is a sum over registers, with no shuffle; :func:`_row_sums` adds the four at the end."""
    return gl.sum(gl.sum(gl.reshape(p, [p.shape[0], BLOCK_N // 8, 4, 2]), 3), 1)


@gluon.jit
def _row_sums(parts, LAYOUT: gl.constexpr):
    """The row sums of :func:`_row_parts`' shares, in ``LAYOUT``."""
    return gl.convert_layout(gl.sum(parts, 1), LAYOUT)


@gluon.jit
def _softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, mods, S_LAYOUT: gl.constexpr,
             BLOCK_N: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
             FP8: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, NEG: gl.constexpr = False,
             FOLD_MASK: gl.constexpr = False, EXP2_FMA: gl.constexpr = 0):
    """Online-softmax step on a score tile: ``(p, m_new, l_new, alpha)``, ``alpha`` rescaling what came before;
    ``l_i`` and ``l_new`` are the row sums, or per-thread shares of them (2-D, :func:`_row_parts`).
    ``mods = (cap, slope, alibi_shift)``, the cap and the slope in base 2: soft-capping and ALiBi (the Triton
    kernels' ``modified_scores``), then the mask. ``NEG`` (float8, unmasked tiles): ``qk_scale < 0``. ``FOLD_MASK``:
    a masked tile without score modifications (and not float8) is scaled and shifted as an unmasked one, by one FMA a
    score (``qk_scale`` then a normal positive float, so that a masked score stays ``-inf``). ``EXP2_FMA`` (float8,
    unmasked tiles): one exponential in ``EXP2_FMA`` by :func:`_exp2_fma`."""
    if ALIBI == 2 and not SOFTCAP:
        # No visible key right of ALiBi's diagonal: -slope * (i + shift - j) is a column term, added by the FMA that
        # scales the scores, and a row term, kept out of the tile and added to the row maxima (both relative to
        # the tile's first key, so small where the probabilities are not).
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        key_pos = cols.to(gl.float32) - start_n.to(gl.float32)
        row_bias = (rows + (mods[2] - start_n)).to(gl.float32) * mods[1]
        s = s * qk_scale + (key_pos * mods[1])[None, :]
        if MASKED:
            s = gl.where(_visible(start_n, rows, n_k, shift, left, right, S_LAYOUT, BLOCK_N, HAS_LEFT, HAS_RIGHT), s,
                         float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) - row_bias)
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - (m_sub + row_bias)[:, None])
    elif SOFTCAP or ALIBI:
        s = s * qk_scale
        if SOFTCAP == 2:  # cap * tanh(s / cap): one special-function op a score (tanh.approx, see _tanh)
            s = mods[0] * _tanh(s * (1.0 / mods[0]))
        elif SOFTCAP:  # cap * tanh(s / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            e = gl.exp2(s * (2.0 * LOG2E / mods[0]))
            s = mods[0] * (1.0 - gl.fdiv(gl.full(s.shape, 2.0, gl.float32, S_LAYOUT), e + 1.0,
                                         ieee_rounding=False))
        if ALIBI:
            # |i + shift - j| from float32 positions relative to the tile's first key: exact integers below 2**24,
            # without an integer-to-float conversion per score.
            row_pos = (rows + (mods[2] - start_n)).to(gl.float32)
            key_pos = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT)).to(gl.float32)
            s = s - mods[1] * gl.abs(row_pos[:, None] - key_pos[None, :])
        if MASKED:
            s = gl.where(_visible(start_n, rows, n_k, shift, left, right, S_LAYOUT, BLOCK_N, HAS_LEFT, HAS_RIGHT), s,
                         float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[:, None])
    elif FP8 and not MASKED:
        # As below, one FMA per score, p in units of 2**-P_SHIFT. The descaled scale may be negative (NEG, a branch
        # of the caller's): the row maxima of the scaled tile are then the scaled minima.
        if NEG:
            m_new = gl.maximum(m_i, gl.min(s, 1) * qk_scale)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = gl.maximum(m_new, -FLT_MAX)  # (keys of score -inf, weight 0: exp2(-inf) = 0, not NaN)
        if EXP2_FMA:
            p = _exp2_fma(s * qk_scale - (m_sub - P_SHIFT)[:, None], EXP2_FMA)
        else:
            p = gl.exp2(s * qk_scale - (m_sub - P_SHIFT)[:, None])
    elif FP8:
        # Masked: the tile is scaled before taking maxima (the scale may be negative or zero, where a masked -inf
        # would give inf * 0). p in units of 2**-P_SHIFT.
        s = s * qk_scale
        if MASKED:
            s = gl.where(_visible(start_n, rows, n_k, shift, left, right, S_LAYOUT, BLOCK_N, HAS_LEFT, HAS_RIGHT), s,
                         float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - (m_sub - P_SHIFT)[:, None])
    elif MASKED and not FOLD_MASK:
        ok = _visible(start_n, rows, n_k, shift, left, right, S_LAYOUT, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        s = gl.where(ok, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[:, None])
    else:
        # Scale the row maxima rather than the tile (scale > 0), so scaling and shifting is one FMA per score.
        if MASKED:  # masked scores -inf, unscaled: -inf after the FMA too
            s = gl.where(_visible(start_n, rows, n_k, shift, left, right, S_LAYOUT, BLOCK_N, HAS_LEFT, HAS_RIGHT), s,
                         float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # Rows that have seen no key yet, or only keys of score -inf (weight 0, unmasked tiles too): subtract the
        # lowest float instead of -inf, so that exp2 gives 0, not NaN (one max a row, no predicate).
        m_sub = gl.maximum(m_new, -FLT_MAX)
        p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    if len(l_i.shape) == 2:  # per-thread shares (_row_parts)
        l_new = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None]
        l_new += _row_parts(p, BLOCK_N)
    else:
        l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _step(acc, m_i, l_i, p_prev, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, c, g, start_n, rows,
          n_k, shift, left, right, qk_scale, mods, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
          P_LAYOUT: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HALF: gl.constexpr, N_CONS: gl.constexpr,
          HEAD_D: gl.constexpr, FP8: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
          NEG: gl.constexpr = False, FOLD_MASK: gl.constexpr = False, PV_WAIT: gl.constexpr = False,
          EXP2_FMA: gl.constexpr = 0):
    """Key block ``c`` (the program's count) with the previous block's ``P V`` in flight: issue ``S_c = Q K_c^T``
    and ``O += P_{c-1} V_{c-1}``, wait for the scores only, run the softmax of block ``c`` while the tensor cores
    finish the product, then rescale ``O``. Returns ``P_c`` for the next step. ``g`` counts these steps in the
    program: the consumers issue their products in turns (consumer 0 first: its barrier's previous phase counts as
    done), each arriving on the other's barrier once its products are issued. ``NEG``, ``FOLD_MASK``: see
    :func:`_softmax`. ``PV_WAIT`` (``GluonTiles.pv_wait_before_qk``): ``O += P_{c-1} V_{c-1}`` is issued and waited
    for before ``S_c`` is issued, so that ``P_{c-1}``'s registers are free before the scores' are taken (the
    softmax then overlaps the other consumer's products only). ``EXP2_FMA``: see :func:`_softmax`."""
    st, lap = _ring(c, STAGES)
    prev, prev_lap = _ring(c - 1, STAGES)
    mbarrier.wait(k_ready.index(st), lap)
    mbarrier.wait(v_ready.index(prev), prev_lap)
    mbarrier.wait(turn.index(HALF), (g & 1) ^ (1 if HALF == 0 else 0))
    if PV_WAIT:
        if FP8 == 2:
            p_prev = _operand_of(p_prev, P_LAYOUT)
        acc = warpgroup_mma(p_prev, _v_tile(v_smem, prev, HEAD_D, BLOCK_N, FP8), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                          gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
        mbarrier.arrive(turn.index((HALF + 1) % N_CONS), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(st), count=1)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, mods, S_LAYOUT,
                                      BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, FP8, SOFTCAP, ALIBI, NEG, FOLD_MASK,
                                      EXP2_FMA)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        if FP8 == 2:
            p16 = _to_operand_permuted(p, P_LAYOUT)
        else:
            p16 = _to_operand(p, v_smem.dtype, P_LAYOUT)
    else:
        s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                          gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
        if FP8 == 2:
            p_prev = _operand_of(p_prev, P_LAYOUT)
        acc = warpgroup_mma(p_prev, _v_tile(v_smem, prev, HEAD_D, BLOCK_N, FP8), acc, is_async=True)
        mbarrier.arrive(turn.index((HALF + 1) % N_CONS), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        mbarrier.arrive(k_empty.index(st), count=1)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, mods, S_LAYOUT,
                                      BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, FP8, SOFTCAP, ALIBI, NEG, FOLD_MASK,
                                      EXP2_FMA)
        if FP8 != 2:
            p16 = _to_operand(p, v_smem.dtype, P_LAYOUT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if FP8 == 2:
            # Packed once the product in flight is done: its operand's registers may then be reused (ptxas of Triton 3.6
            # gave the new words the registers the product still read, and serialised every wgmma: C7513).
            p16 = _to_operand_permuted(p, P_LAYOUT)
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    return acc, m_i, l_i, p16


@gluon.jit
def _v_tile(v_smem, i, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, FP8: gl.constexpr):
    """Stage ``i`` of the V ring as ``P V``'s (keys x head dim) operand: float8 tiles are stored (head dim x keys)
    and used transposed (K-major)."""
    if FP8:
        return v_smem.index(i).reshape([HEAD_D, BLOCK_N]).permute((1, 0))
    else:
        return v_smem.index(i).reshape([BLOCK_N, HEAD_D])


@gluon.jit
def _consumer(O, LSE, DESCALE, SLOPES, seq_q, seq_k, B, n_heads, group, left, right, scale, softcap, alibi_offset,
              n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty,
              v_empty, turn, HALF: gl.constexpr, N_CONS: gl.constexpr, HEAD_D: gl.constexpr, SUB_M: gl.constexpr,
              BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, FP8: gl.constexpr,
              VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, ROW_PARTS: gl.constexpr,
              FOLD_MASK: gl.constexpr = False, PV_WAIT: gl.constexpr = False, EXP2_FMA: gl.constexpr = 0,
              O_TMA: gl.constexpr = False):
    """A consumer partition (one warpgroup): rows ``HALF * SUB_M`` on of every tile of the program (the tile's
    index from the loader's ``tile_slot``, and a packed batch's tile fields too). ``PV_WAIT``, ``EXP2_FMA``: see
    :func:`_step`. ``O_TMA`` (dense 16-bit calls): the output is written into this consumer's part of the tile's Q
    buffer (its last ``Q K^T`` is done by then) and stored from there by one TMA store, through a descriptor of
    (batch, heads, rows, head dim) like Q's, which drops the rows past ``seq_q``; the buffer is released
    (``q_empty``) once the store has read it, not before the epilogue."""
    Q_BUFS: gl.constexpr = q_smem.shape[0] // N_CONS  # Q buffers (see flash_fwd)
    INSTR_K: gl.constexpr = 32 if FP8 else 16  # the depth of one wgmma: 32 bytes of each operand row
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, INSTR_K])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=4 if FP8 else 2)
    if O_TMA:  # O is contiguous (B, N, H, D): rows of n_heads * HEAD_D values (strides in elements, 64-bit)
        # (from a tensor: Triton passes an integer argument equal to 1 as a constant, which has no .to)
        o_row = gl.program_id(0).to(gl.int64) * 0 + n_heads * HEAD_D
        o_desc = tma.make_tensor_descriptor(O, shape=[B, n_heads, seq_q, HEAD_D],
                                            strides=[o_row * seq_q, HEAD_D, o_row, 1],
                                            block_shape=[1, 1, SUB_M, HEAD_D], layout=q_smem.layout)
    c0 = 0  # K/V blocks consumed before the current tile
    g = 0  # overlapped steps before the current tile (the turn barriers' count)
    n = 0  # tiles before the current one
    mbarrier.wait(q_ready.index(0), 0)
    t = _get(tile_slot, 0)  # the loader's choice of tile
    while t < n_tiles:
        qb = n % Q_BUFS
        if VARLEN:
            b = _get(tile_slot, qb * SLOT + 1)
            h = _get(tile_slot, qb * SLOT + 2)
            m0 = _get(tile_slot, qb * SLOT + 3)
            q0 = _get(tile_slot, qb * SLOT + 4)
            n_q = _get(tile_slot, qb * SLOT + 5)
            n_k = _get(tile_slot, qb * SLOT + 6)
        else:
            b, h, m0, q0, n_q, k0, n_k = _tile(t, n_tiles_m, n_heads, seq_q, seq_k, O, O, O, B, N_CONS * SUB_M,
                                               False)
        lo, full_lo, full_hi, hi = _key_blocks(m0, n_q, n_k, left, right, N_CONS * SUB_M, BLOCK_N, HAS_LEFT,
                                               HAS_RIGHT)
        shift = n_k - n_q
        row0 = m0 + HALF * SUB_M
        rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, S_LAYOUT))
        qk_scale = scale * LOG2E
        slope = 0.0
        if ALIBI:  # SLOPES (sequences, H) float32: this tile's sequence and head, in base 2
            slope = gl.load(SLOPES + b * n_heads + h) * LOG2E
        mods = (softcap * LOG2E, slope, shift + alibi_offset)
        if FP8:  # DESCALE (3, B, Hk): q's, k's and v's factors of this (batch, KV head)
            ds = DESCALE + b * (n_heads // group) + h // group
            qk_scale = qk_scale * gl.load(ds) * gl.load(ds + B * (n_heads // group))
        m_i = gl.full([SUB_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
        if ROW_PARTS:  # per-thread shares of the row sums, added up once a tile
            l_i = _row_parts(gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT), BLOCK_N)
        else:
            l_i = gl.zeros([SUB_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
        acc = gl.zeros([SUB_M, HEAD_D], gl.float32, O_LAYOUT)
        q = q_smem.index(N_CONS * qb + HALF).reshape([SUB_M, HEAD_D])
        if hi > lo:
            # The first block alone (masked: it may be an edge block), then each block with the previous one's
            # P V in flight, then the last P V.
            st, lap = _ring(c0, STAGES)
            mbarrier.wait(k_ready.index(st), lap)
            s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                              gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(k_empty.index(st), count=1)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, lo * BLOCK_N, rows, n_k, shift, left, right, qk_scale, mods,
                                          S_LAYOUT, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, FP8, SOFTCAP, ALIBI,
                                          False, FOLD_MASK)
            if FP8 == 2:
                p16 = _to_operand_permuted(p, P_LAYOUT)
            else:
                p16 = _to_operand(p, v_smem.dtype, P_LAYOUT)
            for blk in range(lo + 1, full_lo):
                acc, m_i, l_i, p16 = _step(acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                           turn, c0 + blk - lo, g + blk - lo - 1, blk * BLOCK_N, rows, n_k, shift,
                                           left, right, qk_scale, mods, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M,
                                           BLOCK_N, STAGES, True, HAS_LEFT, HAS_RIGHT, HALF, N_CONS, HEAD_D, FP8,
                                           SOFTCAP, ALIBI, False, FOLD_MASK, PV_WAIT)
            # The unmasked blocks: with float8 the descaled scale's sign picks the row reduction (see _softmax),
            # one branch a tile.
            neg = False
            if FP8:
                neg = qk_scale < 0.0
            if neg:
                for blk in range(gl.maximum(lo + 1, full_lo), full_hi):
                    acc, m_i, l_i, p16 = _step(acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty,
                                               v_empty, turn, c0 + blk - lo, g + blk - lo - 1, blk * BLOCK_N, rows, n_k,
                                               shift, left, right, qk_scale, mods, S_LAYOUT, O_LAYOUT, P_LAYOUT,
                                               SUB_M, BLOCK_N, STAGES, False, HAS_LEFT, HAS_RIGHT, HALF, N_CONS,
                                               HEAD_D, FP8, SOFTCAP, ALIBI, True, False, PV_WAIT, EXP2_FMA)
            else:
                for blk in range(gl.maximum(lo + 1, full_lo), full_hi):
                    acc, m_i, l_i, p16 = _step(acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty,
                                               v_empty, turn, c0 + blk - lo, g + blk - lo - 1, blk * BLOCK_N, rows, n_k,
                                               shift, left, right, qk_scale, mods, S_LAYOUT, O_LAYOUT, P_LAYOUT,
                                               SUB_M, BLOCK_N, STAGES, False, HAS_LEFT, HAS_RIGHT, HALF, N_CONS,
                                               HEAD_D, FP8, SOFTCAP, ALIBI, False, False, PV_WAIT, EXP2_FMA)
            for blk in range(gl.maximum(lo + 1, full_hi), hi):
                acc, m_i, l_i, p16 = _step(acc, m_i, l_i, p16, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                           turn, c0 + blk - lo, g + blk - lo - 1, blk * BLOCK_N, rows, n_k, shift,
                                           left, right, qk_scale, mods, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M,
                                           BLOCK_N, STAGES, True, HAS_LEFT, HAS_RIGHT, HALF, N_CONS, HEAD_D, FP8,
                                           SOFTCAP, ALIBI, False, FOLD_MASK, PV_WAIT)
            last, last_lap = _ring(c0 + hi - lo - 1, STAGES)
            mbarrier.wait(v_ready.index(last), last_lap)
            if FP8 == 2:
                p16 = _operand_of(p16, P_LAYOUT)
            acc = warpgroup_mma(p16, _v_tile(v_smem, last, HEAD_D, BLOCK_N, FP8), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(last), count=1)
            g += hi - lo - 1
        if not O_TMA:  # (with O_TMA the buffer holds the output until its store has read it)
            mbarrier.arrive(q_empty.index(qb), count=1)
        c0 += hi - lo
        n += 1

        if ROW_PARTS:
            l_i = _row_sums(l_i, gl.SliceLayout(1, S_LAYOUT))
        seen = l_i != 0.0  # (a NaN sum, from a NaN or +inf score: NaN output and lse, not a row without keys)
        l_safe = gl.where(seen, l_i, 1.0)
        if FP8:
            m_i = m_i - P_SHIFT  # l_i counts in units of 2**-P_SHIFT
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        if FP8:  # normalised, times v's factor
            out = acc * gl.convert_layout(gl.load(ds + 2 * B * (n_heads // group)) / l_safe,
                                          gl.SliceLayout(1, O_LAYOUT))[:, None]
        else:
            out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, O_LAYOUT))[:, None]
        # O is contiguous (B, N, H, D) and LSE (B, H, N): the backend allocates both (a packed batch: B = 1, the
        # sequence from row q0).
        if O_TMA:
            # Into this consumer's part of the Q buffer (the warpgroup's Q K^T products are done: the last P V was
            # waited for after them), then one TMA store of the part; the LSE store runs while it reads.
            o_smem = q_smem.index(N_CONS * qb + HALF)
            o_smem.reshape([SUB_M, HEAD_D]).store(out.to(O.dtype.element_ty))
            fence_async_shared()
            tma_store(o_desc, [b, h, row0, 0], o_smem)
        else:
            o_rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, O_LAYOUT))
            d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_LAYOUT))
        bd = b.to(gl.int64)
        if VARLEN:
            bd = bd * 0
        if not O_TMA:
            o_ptrs = O + ((bd * seq_q + q0 + o_rows[:, None].to(gl.int64)) * n_heads + h) * HEAD_D + d[None, :]
            gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(o_rows < n_q)[:, None])
        lse_row0 = (bd * n_heads + h) * seq_q + q0
        gl.store(LSE + lse_row0 + rows, lse, mask=rows < n_q)
        if O_TMA:  # the buffer is free once the store has read it (the loader may then load the next Q there)
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(qb), count=1)
        mbarrier.wait(q_ready.index(n % Q_BUFS), (n // Q_BUFS) & 1)
        t = _get(tile_slot, (n % Q_BUFS) * SLOT)


@gluon.jit
def flash_fwd(Q, K, V, O, LSE, COUNTER, DESCALE, CU_Q, CU_K, CUM, SLOPES, sqb, sqn, sqh, skb, skn, skh, svb, svn,
              svh, svd, seq_q, seq_k, B, n_seqs, n_heads, group, scale, left, right, softcap, alibi_offset,
              HEAD_D: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, CONSUMER_REGS: gl.constexpr, FP8: gl.constexpr,
              VARLEN: gl.constexpr, SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = 0,
              N_CONS: gl.constexpr = 2, ROW_PARTS: gl.constexpr = False, LOADER_WARPS: gl.constexpr = 4,
              FOLD_MASK: gl.constexpr = False, PV_WAIT: gl.constexpr = False, EXP2_FMA: gl.constexpr = 0,
              PACKED_SCHED: gl.constexpr = 0, O_TMA: gl.constexpr = False):
    """Grid: (programs,), at most one per SM (with ``PACKED_SCHED == 2`` one per tile). ``num_warps`` 4: the
    loader, or with ``LOADER_WARPS == 1`` (two consumers only) the first consumer, the loader then one warp. The
    ``N_CONS`` (2 or 3) consumers are four warps each with ``CONSUMER_REGS`` registers per thread. ``DESCALE``:
    float8 inputs' factors ``(3, n_seqs, Hk)`` (unread without ``FP8``). ``FP8 == 2``: V's keys stored permuted
    within each group of 16
    (``_to_operand_permuted``; ``v[..., 16 g + 8 c3 + 4 c2 + 2 c1 + c0]`` at ``16 g + 8 c2 + 4 c1 + 2 c3 + c0`` of the
    sequence-major rows, which hold ``ceil(seq_k / 16) * 16`` keys, the padding zero), so that ``P`` needs no
    exchange between lanes. ``B`` is the tensors' batch, ``n_seqs`` the sequences (``B`` unless ``VARLEN``).
    With ``VARLEN`` the tensors hold a packed batch (``B = 1``): sequence ``b`` is rows ``CU_Q[b]:CU_Q[b + 1]``
    of Q and ``CU_K[b]:CU_K[b + 1]`` of K and V (int32), and ``CUM[b]`` counts the query blocks of
    ``N_CONS * SUB_M`` rows of the sequences before ``b`` (``n_seqs + 1`` entries). ``SOFTCAP`` (0 off, 1, 2):
    scores capped at ``softcap`` (2: by ``tanh.approx``);
    ``ALIBI`` (0 off, 1, 2): ``SLOPES`` float32 ``(n_seqs, n_heads)`` contiguous, distances shifted by
    ``alibi_offset`` (as the Triton kernels'; not with ``FP8``); 2 where no visible key lies right of ALiBi's
    diagonal (``HAS_RIGHT`` and ``right <= alibi_offset``: causal calls), which takes one operation per score less.
    ``ROW_PARTS``: each thread keeps its share of the row sums and the shares are added once a tile
    (:func:`_row_parts`), not at every key block. ``FOLD_MASK``: see :func:`_softmax` (``scale * log2 e`` must then be a
    normal float). ``PV_WAIT``: each key block waits for the previous block's ``P V`` before issuing its ``Q K^T``
    (:func:`_step`). ``EXP2_FMA`` (float8 only; 0 off): one exponential in ``EXP2_FMA`` of the unmasked key blocks on
    the FMA pipes (:func:`_exp2_fma`). ``PACKED_SCHED`` (``VARLEN`` without ``FP8`` only; 0 off):
    V through one ragged descriptor bounded per sequence (:func:`_ragged_desc`) and the next tile found while this one
    loads (1, persistent), or one program per tile, as FlashAttention's varlen scheduler (2, the grid at least the
    tiles, those past the last returning at once) (:func:`_loader`). ``O_TMA`` (dense calls of 16-bit inputs only):
    the output stored by TMA from the Q buffer (:func:`_consumer`)."""
    gl.static_assert(PACKED_SCHED == 0 or (VARLEN and not FP8), "PACKED_SCHED: packed batches of 16-bit inputs only")
    gl.static_assert(not O_TMA or not (VARLEN or FP8), "O_TMA: dense calls of 16-bit inputs only")
    gl.static_assert(not O_TMA or O.dtype.element_ty == Q.dtype.element_ty, "O_TMA: the output in Q's dtype only")
    if VARLEN:
        n_tiles_m = gl.load(CUM + n_seqs)  # query blocks of all sequences (B = 1)
    else:
        n_tiles_m = gl.cdiv(seq_q, N_CONS * SUB_M)  # query blocks of one (batch, head)
    n_tiles = n_tiles_m * B * n_heads
    dtype: gl.constexpr = Q.dtype.element_ty
    # Q and K tiles have rows of HEAD_D values, float8 V tiles (head dim x keys) rows of BLOCK_N: each buffer takes
    # the swizzle of its rows' bytes (box_layout).
    ROWS: gl.constexpr = box_layout(SUB_M, HEAD_D, dtype)
    # Q_BUFS buffers of N_CONS parts (q_buffers: two, so that the next tile's Q loads while this one's runs, but one
    # for bf16 at D=256).
    Q_BUFS: gl.constexpr = q_buffers(HEAD_D, dtype)
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * N_CONS, 1, 1, SUB_M, HEAD_D], ROWS)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], ROWS)
    if FP8:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, HEAD_D, BLOCK_N], box_layout(HEAD_D, BLOCK_N, dtype))
    elif PACKED_SCHED:  # the ragged descriptor's boxes (:func:`_ragged_desc`): one dim more, the same bytes
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, 1, BLOCK_N, HEAD_D],
                                           ragged_box_layout(BLOCK_N, HEAD_D, dtype))
    else:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], ROWS)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_slot = gl.allocate_shared_memory(gl.int32, [2 * SLOT, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    turn = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=N_CONS)  # every consumer releases a buffer
    for i in gl.static_range(N_CONS):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=N_CONS)
        mbarrier.init(v_empty.index(i), count=N_CONS)

    # The partitions' argument tuples are written out in full: Gluon (Triton 3.6-3.9) cannot hold constexprs or
    # layouts in a tuple variable, so the consumers' common arguments cannot be named once and extended.
    c0: gl.constexpr = 0
    c1: gl.constexpr = 1
    c2: gl.constexpr = 2
    if N_CONS == 3:
        gl.warp_specialize([
            (_loader, (Q, K, V, COUNTER, CU_Q, CU_K, CUM, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svd, seq_q,
                       seq_k, B, n_seqs, n_heads, group, left, right, n_tiles_m, n_tiles, q_smem, k_smem, v_smem,
                       tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, HEAD_D, SUB_M, BLOCK_N,
                       STAGES, HAS_LEFT, HAS_RIGHT, FP8, VARLEN, N_CONS, LOADER_WARPS, PACKED_SCHED)),
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c0, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c1, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c2, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    elif LOADER_WARPS == 1:  # the first consumer as the default partition, the loader one warp
        gl.warp_specialize([
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c0, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
            (_loader, (Q, K, V, COUNTER, CU_Q, CU_K, CUM, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svd, seq_q,
                       seq_k, B, n_seqs, n_heads, group, left, right, n_tiles_m, n_tiles, q_smem, k_smem, v_smem,
                       tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, HEAD_D, SUB_M, BLOCK_N,
                       STAGES, HAS_LEFT, HAS_RIGHT, FP8, VARLEN, N_CONS, LOADER_WARPS, PACKED_SCHED)),
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c1, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
        ], [1, 4], [24, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_loader, (Q, K, V, COUNTER, CU_Q, CU_K, CUM, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svd, seq_q,
                       seq_k, B, n_seqs, n_heads, group, left, right, n_tiles_m, n_tiles, q_smem, k_smem, v_smem,
                       tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, HEAD_D, SUB_M, BLOCK_N,
                       STAGES, HAS_LEFT, HAS_RIGHT, FP8, VARLEN, N_CONS, LOADER_WARPS, PACKED_SCHED)),
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c0, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
            (_consumer, (O, LSE, DESCALE, SLOPES, seq_q, seq_k, n_seqs, n_heads, group, left, right, scale, softcap,
                         alibi_offset, n_tiles_m, n_tiles, q_smem, k_smem, v_smem, tile_slot, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, turn, c1, N_CONS, HEAD_D, SUB_M, BLOCK_N, STAGES,
                         HAS_LEFT, HAS_RIGHT, FP8, VARLEN, SOFTCAP, ALIBI, ROW_PARTS, FOLD_MASK, PV_WAIT,
                         EXP2_FMA, O_TMA)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
