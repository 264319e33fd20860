"""Backward kernels (FlashAttention-2 scheme, deterministic: no atomics).

1. :func:`_flash_bwd_stats`: the row statistics, once per call on the final output, in float32: ``lse2``, the
   log-sum-exp in base 2 (``+inf`` where it is ``-inf``: a query that saw no key weighs 0), and
   ``delta = rowsum(dO * O)``. Two planes (``PAIRED`` off), or interleaved pairs where the rows a program reads
   may start anywhere (packed sequences, dilated views): a row's pair is then one aligned 8-byte load, where the
   planes give the compiler no alignment to vectorise by and cost the dK/dV loop about half again as many
   instructions (docs/kernel_notes.md).
2. :func:`_flash_bwd_dkdv`: one program per key block (of one batch, segment, key/value head and offset class)
   walks the query blocks that see it, for every query head of its group that shares the key rows, and
   accumulates dK and dV in registers.
3. :func:`_flash_bwd_dq`: one program per query block walks its key blocks and accumulates dQ.

Both recompute ``P = exp(S - lse)`` from the saved log-sum-exp. Padded rows past a sequence end load as zeros and
contribute nothing, so only causal/window/list edges are masked. With ``ACCUMULATE`` the kernels add into the
gradients already in memory (the dilated branches share them).
"""
import triton
import triton.language as tl

from longattn.backends.triton.jit import (LOG2E, UNROLL_ELEMS, dense_strides, list_row, listed_start, load_row_tiles,
                                          modified_scores, pair_mask, pair_mask_t, query_program, row_source,
                                          sequence_bounds, stat_row0, view_rows, visible_key_blocks,
                                          visible_query_blocks)


@triton.jit
def _flash_bwd_stats(O, DO, LSE, STATS, plane, sob, son, soh, sdb, sdn, sdh, seq, n_heads,
                     HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PAIRED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < seq)[:, None] & (offs_d < HEAD_D)[None, :]
    r64 = rows[:, None].to(tl.int64)
    o = tl.load(O + b * sob + h * soh + r64 * son + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + r64 * sdn + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = stat_row0(b, h, seq, n_heads) + rows.to(tl.int64)
    lse = tl.load(LSE + row, mask=rows < seq, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    if PAIRED:
        tl.store(STATS + 2 * row, lse, mask=rows < seq)
        tl.store(STATS + 2 * row + 1, delta, mask=rows < seq)
    else:
        tl.store(STATS + row, lse, mask=rows < seq)
        tl.store(STATS + plane + row, delta, mask=rows < seq)


@triton.jit
def _load_row_stats(STATS, plane, stat_base, rows, n_q, dilation, PAIRED: tl.constexpr, PAD_INF: tl.constexpr):
    """Log-sum-exp in base 2 and delta of query rows (see :func:`_flash_bwd_stats`); rows past ``n_q`` read 0, or
    with ``PAD_INF`` a log-sum-exp of +inf, so that their probabilities are 0 whatever the scores: a negative ALiBi
    slope makes the zero-padded rows' scores large, and with a log-sum-exp of 0 they overflowed (inf times their
    zero dO is NaN in dK/dV). Only ALiBi calls pay for it (the select costs the two-pass backward up to 10% at
    short lengths on an H100)."""
    ok = rows < n_q
    row = stat_base + rows.to(tl.int64) * dilation
    if PAIRED:
        lse, delta = tl.split(tl.load(STATS + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=ok[:, None],
                                      other=0.0))
    else:
        lse, delta = tl.load(STATS + row, mask=ok, other=0.0), tl.load(STATS + plane + row, mask=ok, other=0.0)
    if PAD_INF:
        lse = tl.where(ok, lse, float("inf"))
    return lse, delta


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, q_offs, do_offs, STATS, plane, stat_base, start_m, cols, n_q, shift,
                left, right, qk_scale, stride_qn, stride_don, dilation, d_ok, mods,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                EVEN_D: tl.constexpr, TMA: tl.constexpr, PAIRED: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr):
    rows = start_m + tl.arange(0, BLOCK_M)
    q, do = load_row_tiles(q_base, do_base, q_offs, do_offs, start_m, rows, stride_qn, stride_don, n_q, d_ok, EVEN_D,
                           TMA)
    lse, delta = _load_row_stats(STATS, plane, stat_base, rows, n_q, dilation, PAIRED, ALIBI)
    if SOFTCAP or ALIBI:  # mods = (scale, softcap, slope, alibi_offset): see fwd._attend_block
        s_t, tanh_t = modified_scores(tl.dot(k, tl.trans(q)) * qk_scale, rows, cols, shift + mods[3], mods[1] * LOG2E,
                                      mods[2] * LOG2E, SOFTCAP, ALIBI, True)
    else:
        s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M): keys by queries
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        p_t = tl.where(pair_mask_t(rows, cols, shift, left, right, HAS_LEFT, HAS_RIGHT), p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # d(softcap * tanh(x / softcap)) / dx
        ds_t = ds_t * (1.0 - tanh_t * tanh_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _head_sources(Q, DO, h, b64, q_start, sqb, sqh, sqn, sdob, sdoh, sdon, slb, slh, n_q, stride_qn, stride_don,
                  HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Where query head ``h``'s rows of Q and dO (contiguous) load from (base pointers, or descriptors with TMA), and
    its offset into the log-sum-exp and delta."""
    h64 = tl.cast(h, tl.int64)
    q_src = row_source(Q + b64 * sqb + h64 * sqh + q_start * sqn, n_q, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, TMA)
    do_src = row_source(DO + b64 * sdob + h64 * sdoh + q_start * sdon, n_q, stride_don, HEAD_D, BLOCK_M, BLOCK_D,
                        TMA)
    return q_src, do_src, b64 * slb + h64 * slh + q_start


@triton.jit
def _dkdv_head(dk, dv, k, v, Q, DO, q_offs, do_offs, STATS, plane, h, b64, q_start, sqb, sqh, sqn, sdob, sdoh, sdon,
               slb, slh, cols, n0, n_q, shift, left, right, qk_scale, stride_qn, stride_don, dilation, d_ok, mods,
               SLOPES, seq_b, n_q_heads,
               HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr,
               PAIRED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Range path: accumulate query head ``h``'s contribution over the query blocks that see this key block
    (masked edge blocks, unmasked interior, masked edge). ``mods`` = (scale, softcap, any, alibi_offset); with
    ``ALIBI`` head ``h``'s slope is read from ``SLOPES`` (row ``seq_b``)."""
    q_base, do_base, stat_base = _head_sources(Q, DO, h, b64, q_start, sqb, sqh, sqn, sdob, sdoh, sdon, slb, slh, n_q,
                                               stride_qn, stride_don, HEAD_D, BLOCK_M, BLOCK_D, TMA)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + seq_b * n_q_heads + h)
    mods = (mods[0], mods[1], slope, mods[3])
    lo, full_lo, full_hi, hi = visible_query_blocks(n0, n_q, shift, left, right, BLOCK_M, BLOCK_N,
                                                    HAS_LEFT, HAS_RIGHT)
    for blk in range(lo, full_lo):
        dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_offs, do_offs, STATS, plane, stat_base, blk * BLOCK_M,
                             cols, n_q, shift, left, right, qk_scale, stride_qn, stride_don, dilation, d_ok, mods,
                             BLOCK_M, True, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, PAIRED, SOFTCAP, ALIBI)
    for blk in range(full_lo, full_hi):
        dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_offs, do_offs, STATS, plane, stat_base, blk * BLOCK_M,
                             cols, n_q, shift, left, right, qk_scale, stride_qn, stride_don, dilation, d_ok, mods,
                             BLOCK_M, False, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, PAIRED, SOFTCAP, ALIBI)
    for blk in range(full_hi, hi):
        dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_offs, do_offs, STATS, plane, stat_base, blk * BLOCK_M,
                             cols, n_q, shift, left, right, qk_scale, stride_qn, stride_don, dilation, d_ok, mods,
                             BLOCK_M, True, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, PAIRED, SOFTCAP, ALIBI)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv(
    Q, K, V, DO, DK, DV, STATS, plane, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh,
    Q_NUM, Q_IDX, list_sb, list_sh, list_w, CU_Q, CU_K, SLOPES, softcap, alibi_offset,
    seq_q, seq_k, seg_q, seg_k, n_seg, dilation, offset, head_start, n_heads, n_q_heads, n_kv_heads, group, scale,
    left, right,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, USE_LIST: tl.constexpr, PER_HEAD_OFFSET: tl.constexpr,
    N_CLASSES: tl.constexpr, ACCUMULATE: tl.constexpr, LIST_M: tl.constexpr, LIST_N: tl.constexpr,
    ONE_HEAD: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr, PAIRED: tl.constexpr,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    # DO, DK and DV are contiguous (the backend makes them so); STATS: see _flash_bwd_stats.
    pid_n = tl.program_id(0)
    pid_z = tl.program_id(1)
    pid_hc = tl.program_id(2)
    b = pid_z // n_seg
    seg = pid_z % n_seg
    kvh = head_start // group + pid_hc // N_CLASSES
    h_lo = tl.maximum(head_start, kvh * group)
    h_hi = tl.minimum(head_start + n_heads, kvh * group + group)
    h_first = h_lo + pid_hc % N_CLASSES
    if h_first >= h_hi:
        return
    if PER_HEAD_OFFSET:
        off = h_first % dilation
        h_step = dilation
    else:
        off = offset
        h_step = 1
    q0, k0, len_q, len_k = sequence_bounds(CU_Q, CU_K, b, seq_q, seq_k, VARLEN)
    seq_b = b  # the batch element (sequence of a packed batch): its row of ALiBi slopes
    mods = (scale, softcap, scale * 0.0, alibi_offset)  # (the slope, per query head, where ALIBI reads it)
    n_q = view_rows(len_q, seg_q, seg, off, dilation)
    n_k = view_rows(len_k, seg_k, seg, off, dilation)
    n0 = pid_n * BLOCK_N
    if n0 >= n_k:
        return
    if VARLEN:
        # A packed batch: the batch index addresses nothing; the key rows start at k0 (K and V bases, for the loads
        # just below; dK and dV after the loops), the query rows at q0 (q_start). No base that the loops use moves:
        # a moved pointer is held in registers through them (a kernel parameter is not), and this kernel is at the
        # register limit (docs/kernel_notes.md).
        K += k0.to(tl.int64) * skn
        V += k0.to(tl.int64) * svn
        b = b * 0
    shift = n_k - n_q

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    EVEN_D: tl.constexpr = HEAD_D == BLOCK_D
    cols = n0 + tl.arange(0, BLOCK_N)
    kv_mask = (cols < n_k)[:, None] & d_ok[None, :]
    b64 = b.to(tl.int64)
    pos_k = seg.to(tl.int64) * seg_k + off + cols[:, None].to(tl.int64) * dilation
    k = tl.load(K + b64 * skb + kvh.to(tl.int64) * skh + pos_k * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b64 * svb + kvh.to(tl.int64) * svh + pos_k * svn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    stride_qn = sqn * dilation
    sdob, sdon, sdoh = dense_strides(seq_q, n_q_heads, HEAD_D)
    slb, slh = n_q_heads * seq_q, seq_q  # rows of the statistics: (B, n_q_heads, seq_q)
    stride_don = sdon * dilation
    q_start = seg.to(tl.int64) * seg_q + off
    if VARLEN:
        q_start += q0
    q_offs = tl.arange(0, BLOCK_M)[:, None] * stride_qn + offs_d[None, :]
    do_offs = tl.arange(0, BLOCK_M)[:, None] * stride_don + offs_d[None, :]

    # The query heads this program covers: several for grouped-query heads, one for MHA. With one (ONE_HEAD) the
    # head loop is left out altogether: a loop over heads around the pipelined block loops, even with one trip, makes
    # the compiler spill dK/dV out of registers (docs/kernel_notes.md).
    n_h = (h_hi - h_first + h_step - 1) // h_step
    if USE_LIST:
        for hh in range(0, 1 if ONE_HEAD else n_h):  # lists differ per head
            h = h_first + hh * h_step
            q_base, do_base, stat_base = _head_sources(Q, DO, h, b64, q_start, sqb, sqh, sqn, sdob, sdoh, sdon, slb,
                                                       slh, n_q, stride_qn, stride_don, HEAD_D, BLOCK_M, BLOCK_D, TMA)
            if ALIBI:
                mods = (scale, softcap, tl.load(SLOPES + seq_b * n_q_heads + h), alibi_offset)
            SUB_M: tl.constexpr = LIST_M // BLOCK_M
            idx_ptr, n_part, n_full = list_row(Q_NUM, Q_IDX, b, h, n0 // LIST_N, list_sb, list_sh, list_w)
            for t in range(0, n_part * SUB_M):
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_offs, do_offs, STATS, plane, stat_base,
                                     listed_start(idx_ptr, t, SUB_M, LIST_M, BLOCK_M), cols, n_q, shift, left, right,
                                     qk_scale, stride_qn, stride_don, dilation, d_ok, mods, BLOCK_M,
                                     HAS_LEFT or HAS_RIGHT, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, PAIRED, SOFTCAP, ALIBI)
            # Full blocks: UNROLL tiles of a listed block in the loop body, one index load for them (all of the
            # block's tiles up to D = 64, one at a time above: docs/kernel_notes.md).
            UNROLL: tl.constexpr = 1 if BLOCK_D > 64 else (SUB_M if SUB_M * BLOCK_M * BLOCK_D <= UNROLL_ELEMS else (
                UNROLL_ELEMS // (BLOCK_M * BLOCK_D) if BLOCK_M * BLOCK_D <= UNROLL_ELEMS else 1))
            STEPS: tl.constexpr = SUB_M // UNROLL
            for t in range(n_part * STEPS, (n_part + n_full) * STEPS):
                first_m = listed_start(idx_ptr, t, STEPS, LIST_M, UNROLL * BLOCK_M)
                for j in tl.static_range(UNROLL):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_offs, do_offs, STATS, plane, stat_base,
                                         first_m + j * BLOCK_M, cols, n_q, shift, left, right, qk_scale, stride_qn,
                                         stride_don, dilation, d_ok, mods, BLOCK_M, False, HAS_LEFT, HAS_RIGHT, EVEN_D,
                                         TMA, PAIRED, SOFTCAP, ALIBI)
    elif ONE_HEAD:
        dk, dv = _dkdv_head(dk, dv, k, v, Q, DO, q_offs, do_offs, STATS, plane, h_first, b64, q_start, sqb, sqh,
                            sqn, sdob, sdoh, sdon, slb, slh, cols, n0, n_q, shift, left, right, qk_scale, stride_qn,
                            stride_don, dilation, d_ok, mods, SLOPES, seq_b, n_q_heads, HEAD_D, BLOCK_M, BLOCK_N,
                            BLOCK_D, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, PAIRED, SOFTCAP, ALIBI)
    else:
        for hh in range(0, n_h):
            dk, dv = _dkdv_head(dk, dv, k, v, Q, DO, q_offs, do_offs, STATS, plane, h_first + hh * h_step, b64,
                                q_start, sqb, sqh, sqn, sdob, sdoh, sdon, slb, slh, cols, n0, n_q, shift, left, right,
                                qk_scale, stride_qn, stride_don, dilation, d_ok, mods, SLOPES, seq_b, n_q_heads,
                                HEAD_D, BLOCK_M, BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, PAIRED, SOFTCAP,
                                ALIBI)

    dk = dk * scale
    if VARLEN:
        k_first = tl.load(CU_K + pid_z // n_seg).to(tl.int64)  # loaded again rather than held through the loops
        DK += k_first * (n_kv_heads * HEAD_D)
        DV += k_first * (n_kv_heads * HEAD_D)
    sdkb, sdkn, sdkh = dense_strides(seq_k, n_kv_heads, HEAD_D)  # dK and dV alike
    kv_offs = b64 * sdkb + kvh.to(tl.int64) * sdkh + pos_k * sdkn + offs_d[None, :]
    if ACCUMULATE:
        dk += tl.load(DK + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        dv += tl.load(DV + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_base, v_base, k_offs, v_offs, start_n, rows, shift, left, right, qk_scale,
              stride_kn, stride_vn, n_k, d_ok, mods,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              EVEN_D: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              RAGGED: tl.constexpr = False):
    """dQ of one key block. Keys past ``n_k`` load as zeros and must weigh 0 (exp2(-lse) overflows for a
    log-sum-exp below about -88, and inf times their zero K is NaN): ``MASKED`` blocks mask them with the band;
    ``RAGGED`` (block lists, whose unmasked blocks may end past ``n_k``) checks at run time; the range path's
    unmasked blocks lie inside ``n_k`` (:func:`visible_key_blocks`)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    k, v = load_row_tiles(k_base, v_base, k_offs, v_offs, start_n, cols, stride_kn, stride_vn, n_k, d_ok, EVEN_D, TMA)
    if SOFTCAP or ALIBI:  # mods = (scale, softcap, slope, alibi_offset): see fwd._attend_block
        s, tanh_s = modified_scores(tl.dot(q, tl.trans(k)) * qk_scale, rows, cols, shift + mods[3], mods[1] * LOG2E,
                                    mods[2] * LOG2E, SOFTCAP, ALIBI, False)
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASKED:
        ok = pair_mask(rows, cols, 0, shift, left, right, HAS_LEFT, HAS_RIGHT, False) & (cols[None, :] < n_k)
        p = tl.where(ok, p, 0.0)
    elif RAGGED:
        if start_n + BLOCK_N > n_k:
            p = tl.where(cols[None, :] < n_k, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - tanh_s * tanh_s)
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _flash_bwd_dq(
    Q, K, V, DO, DQ, STATS, plane, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh,
    KV_NUM, KV_IDX, list_sb, list_sh, list_w, CU_Q, CU_K, SLOPES, softcap, alibi_offset,
    seq_q, seq_k, seg_q, seg_k, n_seg, dilation, offset, head_start, n_q_heads, group, scale, left, right,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, USE_LIST: tl.constexpr, PER_HEAD_OFFSET: tl.constexpr,
    ACCUMULATE: tl.constexpr, LIST_M: tl.constexpr, LIST_N: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr,
    PAIRED: tl.constexpr, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    # DO and DQ are contiguous (B, seq_q, n_q_heads, HEAD_D); STATS: see _flash_bwd_stats.
    pid_m, b, seg, h, off, n_q, n_k, q0, k0 = query_program(seq_q, seq_k, seg_q, seg_k, n_seg, dilation, offset,
                                                            head_start, CU_Q, CU_K, PER_HEAD_OFFSET, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    slope = 0.0
    if ALIBI:  # SLOPES (B, n_q_heads): a row per batch element (per sequence of a packed batch)
        slope = tl.load(SLOPES + b * n_q_heads + h)
    mods = (scale, softcap, slope, alibi_offset)
    if VARLEN:
        # A packed batch: the bases move to the sequence's first rows and the batch index addresses nothing.
        Q += q0.to(tl.int64) * sqn
        DO += q0.to(tl.int64) * (n_q_heads * HEAD_D)
        DQ += q0.to(tl.int64) * (n_q_heads * HEAD_D)
        STATS += 2 * q0 if PAIRED else q0
        K += k0.to(tl.int64) * skn
        V += k0.to(tl.int64) * svn
        b = b * 0
    shift = n_k - n_q
    kvh = h // group

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    EVEN_D: tl.constexpr = HEAD_D == BLOCK_D
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = (rows < n_q)[:, None] & d_ok[None, :]
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_start = seg.to(tl.int64) * seg_q + off
    pos_q = q_start + rows[:, None].to(tl.int64) * dilation
    q = tl.load(Q + b64 * sqb + h64 * sqh + pos_q * sqn + offs_d[None, :], mask=row_mask, other=0.0)
    sdob, sdon, sdoh = dense_strides(seq_q, n_q_heads, HEAD_D)  # dO and dQ alike
    row_offs = b64 * sdob + h64 * sdoh + pos_q * sdon + offs_d[None, :]
    do = tl.load(DO + row_offs, mask=row_mask, other=0.0)
    lse, delta = _load_row_stats(STATS, plane, stat_row0(b64, h64, seq_q, n_q_heads) + q_start, rows, n_q, dilation,
                                 PAIRED, ALIBI)
    k_start = seg.to(tl.int64) * seg_k + off
    k_base = K + b64 * skb + kvh.to(tl.int64) * skh + k_start * skn
    v_base = V + b64 * svb + kvh.to(tl.int64) * svh + k_start * svn
    stride_kn = skn * dilation
    stride_vn = svn * dilation
    k_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :]
    v_offs = tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :]
    k_base = row_source(k_base, n_k, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, TMA)  # a descriptor with TMA
    v_base = row_source(v_base, n_k, stride_vn, HEAD_D, BLOCK_N, BLOCK_D, TMA)
    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if USE_LIST:
        SUB: tl.constexpr = LIST_N // BLOCK_N
        idx_ptr, n_part, n_full = list_row(KV_NUM, KV_IDX, b, h, m0 // LIST_M, list_sb, list_sh, list_w)
        for t in range(0, n_part * SUB):
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, k_offs, v_offs,
                           listed_start(idx_ptr, t, SUB, LIST_N, BLOCK_N), rows, shift, left, right, qk_scale,
                           stride_kn, stride_vn, n_k, d_ok, mods, BLOCK_N, HAS_LEFT or HAS_RIGHT, HAS_LEFT, HAS_RIGHT,
                           EVEN_D, TMA, SOFTCAP, ALIBI, True)
        # Full blocks: as in dK/dV, a listed block's tiles unrolled up to D = 64, one at a time above.
        UNROLL: tl.constexpr = 1 if BLOCK_D > 64 else (SUB if SUB * BLOCK_N * BLOCK_D <= UNROLL_ELEMS else (
            UNROLL_ELEMS // (BLOCK_N * BLOCK_D) if BLOCK_N * BLOCK_D <= UNROLL_ELEMS else 1))
        STEPS: tl.constexpr = SUB // UNROLL
        for t in range(n_part * STEPS, (n_part + n_full) * STEPS):
            first_n = listed_start(idx_ptr, t, STEPS, LIST_N, UNROLL * BLOCK_N)
            for j in tl.static_range(UNROLL):
                dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, k_offs, v_offs, first_n + j * BLOCK_N, rows,
                               shift, left, right, qk_scale, stride_kn, stride_vn, n_k, d_ok, mods, BLOCK_N, False,
                               HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, SOFTCAP, ALIBI, True)
    else:
        lo, full_lo, full_hi, hi = visible_key_blocks(m0, n_k, shift, left, right, BLOCK_M, BLOCK_N,
                                                      HAS_LEFT, HAS_RIGHT)
        for blk in range(lo, full_lo):
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, k_offs, v_offs, blk * BLOCK_N, rows, shift, left,
                           right, qk_scale, stride_kn, stride_vn, n_k, d_ok, mods, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                           EVEN_D, TMA, SOFTCAP, ALIBI)
        for blk in range(full_lo, full_hi):  # whole blocks inside n_k
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, k_offs, v_offs, blk * BLOCK_N, rows, shift, left,
                           right, qk_scale, stride_kn, stride_vn, n_k, d_ok, mods, BLOCK_N, False, HAS_LEFT,
                           HAS_RIGHT, EVEN_D, TMA, SOFTCAP, ALIBI)
        for blk in range(full_hi, hi):
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, k_offs, v_offs, blk * BLOCK_N, rows, shift, left,
                           right, qk_scale, stride_kn, stride_vn, n_k, d_ok, mods, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                           EVEN_D, TMA, SOFTCAP, ALIBI)

    dq = dq * scale
    if ACCUMULATE:
        dq += tl.load(DQ + row_offs, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(DQ + row_offs, dq.to(DQ.dtype.element_ty), mask=row_mask)
