"""Forward kernel: online-softmax attention over a list or a range of key blocks, on strided sequence views.

One program computes ``BLOCK_M`` query rows of one (batch, segment, head). It walks the key blocks the rows can see:

- range mode (``USE_LIST=False``): dense, causal or sliding-window attention. The range is split into edge blocks,
  which are masked, and interior blocks, which are not, so dense attention pays nothing for the masks;
- list mode (``USE_LIST=True``): the key blocks listed for this query block (block-sparse attention). Lists are
  kept at the block mask's granularity (``LIST_M`` x ``LIST_N``) and the kernel's tiles divide those blocks; each
  row lists first the blocks cut by the causal band or the sequence end (masked), then the full ones (not masked).

Scores are scaled into base 2 (``exp2``) once; the output is normalised at the end and the log-sum-exp (natural
log) stored in float32. With ``FP8`` q, k and v are float8 with descale factors per (batch, key/value head): the
q and k factors join the softmax scale, the v factor multiplies the output, and the probabilities are rounded to
float8 for the ``P V`` product, in units of ``2**-P_SHIFT`` (so they span [0, 256] and fewer small ones flush to
zero; the row sums carry the same unit, which cancels). With ``MERGE`` the result is merged into the output and
log-sum-exp already in memory by their softmax denominators, which is how the dilated branches combine without a
buffer per branch.
"""
import triton
import triton.language as tl

from longattn.backends.triton.jit import (LN2, LOG2E, P_SHIFT, UNROLL_ELEMS, dense_strides, list_row, listed_start,
                                          merge_partial, modified_scores, pair_mask, query_program, row_source,
                                          visible_key_blocks)


@triton.jit
def _row_tile(base, offs, start_n, cols, n_k, row_stride, d_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
              TMA: tl.constexpr):
    """The (keys x head dim) tile of K or V at key ``start_n``: with ``TMA`` ``base`` is a tensor descriptor of the
    view (rows past its end and columns past the head dim arrive as zeros, no mask), else a pointer with the tile's
    offsets ``offs``, masked by the view's end (``MASKED``) and the head dim (not ``EVEN_D``)."""
    if TMA:
        return base.load([start_n, 0])
    elif MASKED:
        ld_mask = (cols < n_k)[:, None]
        if not EVEN_D:
            ld_mask = ld_mask & d_ok[None, :]
        return tl.load(base + tl.cast(start_n, tl.int64) * row_stride + offs, mask=ld_mask, other=0.0)
    elif EVEN_D:
        return tl.load(base + tl.cast(start_n, tl.int64) * row_stride + offs)
    else:
        return tl.load(base + tl.cast(start_n, tl.int64) * row_stride + offs, mask=d_ok[None, :], other=0.0)


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, start_n, rows, n_k, shift, left, right,
                  qk_scale, stride_kn, stride_vn, d_ok, mods,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  EVEN_D: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr, V_TMA: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _row_tile(k_base, k_offs, start_n, cols, n_k, stride_kn, d_ok, MASKED, EVEN_D, TMA)
    if FP8:
        # float8 values lie sequence-innermost (the FP8 tensor cores take P V's second operand K-major): load the
        # (head dim x keys) tile and transpose it.
        if V_TMA:
            vt = v_base.load([0, start_n])
        else:
            vt = tl.load(v_base + tl.cast(start_n, tl.int64) * stride_vn + v_offs,
                         mask=(cols < n_k)[None, :] & d_ok[:, None], other=0.0)
        v = tl.trans(vt)
    else:
        v = _row_tile(v_base, v_offs, start_n, cols, n_k, stride_vn, d_ok, MASKED, EVEN_D, TMA)
    s = tl.dot(q, tl.trans(k))
    if FP8:
        # The descaled scale may be negative (a negative descale factor): scale the tile before taking maxima.
        if MASKED:
            ok = pair_mask(rows, cols, n_k, shift, left, right, HAS_LEFT, HAS_RIGHT, True)
            s = tl.where(ok, s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - (m_sub - P_SHIFT)[:, None])
    elif ALIBI == 2 and not SOFTCAP:
        # No visible key right of ALiBi's diagonal: -slope * (i + shift - j) splits into a column term, added by
        # the FMA that scales the scores, and a row term kept out of the tile and added to the row maxima (both
        # relative to the block's first key, so small where the probabilities are not).
        slope = mods[2] * LOG2E
        s = s * qk_scale + (tl.arange(0, BLOCK_N).to(tl.float32) * slope)[None, :]
        row_bias = (rows + (shift + mods[3] - start_n)).to(tl.float32) * slope
        if MASKED:
            ok = pair_mask(rows, cols, n_k, shift, left, right, HAS_LEFT, HAS_RIGHT, True)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) - row_bias)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - (m_sub + row_bias)[:, None])
    elif SOFTCAP or ALIBI:
        # mods = (scale, softcap, slope, alibi_offset): the scores, the cap and the slope all in base 2.
        s, _ = modified_scores(s * qk_scale, rows, cols, shift + mods[3], mods[1] * LOG2E, mods[2] * LOG2E, SOFTCAP,
                               ALIBI, False)
        if MASKED:
            ok = pair_mask(rows, cols, n_k, shift, left, right, HAS_LEFT, HAS_RIGHT, True)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
    elif MASKED:
        ok = pair_mask(rows, cols, n_k, shift, left, right, HAS_LEFT, HAS_RIGHT, True)
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        # Scale the row maxima rather than the tile (scale > 0), so scaling and shifting is one FMA per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row whose scores are all -inf so far (keys of weight 0, not masked ones) keeps m = -inf: subtract 0.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _flash_fwd(
    Q, K, V, O, LSE, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svd,
    KV_NUM, KV_IDX, list_sb, list_sh, list_w, CU_Q, CU_K, DESCALE, descale_rows, SLOPES, softcap,
    alibi_offset, seq_q, seq_k, seg_q, seg_k, n_seg, dilation, offset, head_start, n_heads, group, scale, left, right,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, USE_LIST: tl.constexpr, PER_HEAD_OFFSET: tl.constexpr,
    MERGE: tl.constexpr, LIST_M: tl.constexpr, LIST_N: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr,
    FP8: tl.constexpr, V_TMA: tl.constexpr, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = 0,
):
    pid_m, b, seg, h, off, n_q, n_k, q0, k0 = query_program(seq_q, seq_k, seg_q, seg_k, n_seg, dilation, offset,
                                                            head_start, CU_Q, CU_K, PER_HEAD_OFFSET, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    kvh = h // group
    qk_scale = scale * LOG2E
    if FP8:
        # DESCALE (3, B, Hk): q's, k's and v's factors of this (batch or sequence, key/value head).
        ds = DESCALE + b * (n_heads // group) + kvh
        qk_scale = qk_scale * tl.load(ds) * tl.load(ds + descale_rows)
        v_descale = tl.load(ds + 2 * descale_rows)
    slope = 0.0
    if ALIBI:  # SLOPES (B, n_heads) float32: a row per batch element (per sequence of a packed batch)
        slope = tl.load(SLOPES + b * n_heads + h)
    mods = (scale, softcap, slope, alibi_offset)
    if VARLEN:
        # A packed batch: the bases move to the sequence's first rows and the batch index addresses nothing.
        Q += q0.to(tl.int64) * sqn
        K += k0.to(tl.int64) * skn
        V += k0.to(tl.int64) * svn
        O += q0.to(tl.int64) * (n_heads * HEAD_D)
        LSE += q0
        b = b * 0
    shift = n_k - n_q

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    EVEN_D: tl.constexpr = HEAD_D == BLOCK_D
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h.to(tl.int64) * sqh + (seg.to(tl.int64) * seg_q + off) * sqn
    k_base = K + b64 * skb + kvh.to(tl.int64) * skh + (seg.to(tl.int64) * seg_k + off) * skn
    v_base = V + b64 * svb + kvh.to(tl.int64) * svh + (seg.to(tl.int64) * seg_k + off) * svn
    stride_qn = sqn * dilation
    stride_kn = skn * dilation
    stride_vn = svn * dilation
    # Offsets inside one key block stay in 32 bits; the block's start is added to the 64-bit base.
    k_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :]
    k_base = row_source(k_base, n_k, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, TMA)  # a descriptor with TMA
    if FP8:  # V sequence-innermost: svd is its head-dim stride, (head dim x keys) tiles
        v_offs = offs_d[:, None] * svd + tl.arange(0, BLOCK_N)[None, :] * stride_vn
        if V_TMA:
            v_base = tl.make_tensor_descriptor(v_base, shape=[HEAD_D, tl.maximum(n_k, 1)], strides=[svd, 1],
                                               block_shape=[BLOCK_D, BLOCK_N])
    else:
        v_offs = tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :]
        v_base = row_source(v_base, n_k, stride_vn, HEAD_D, BLOCK_N, BLOCK_D, TMA)

    q = tl.load(q_base + rows[:, None].to(tl.int64) * stride_qn + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if USE_LIST:
        # Partial blocks (cut by the causal band or the sequence end) come first in the row's list, then full ones.
        SUB: tl.constexpr = LIST_N // BLOCK_N
        idx_ptr, n_part, n_full = list_row(KV_NUM, KV_IDX, b, h, m0 // LIST_M, list_sb, list_sh, list_w)
        for t in range(0, n_part * SUB):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs,
                                          listed_start(idx_ptr, t, SUB, LIST_N, BLOCK_N), rows, n_k, shift, left,
                                          right, qk_scale, stride_kn, stride_vn, d_ok, mods, BLOCK_N, True, HAS_LEFT,
                                          HAS_RIGHT, EVEN_D, TMA, FP8, V_TMA, SOFTCAP, ALIBI)
        # Full blocks: UNROLL tiles of a listed block in the loop body, one index load for them: all SUB tiles, or
        # as many as keep the unrolled tiles' key span x head dim within 128 x 128 (beyond it the buffers of the
        # unrolled loads outgrow an H100's shared memory: 282 KB at D=128 with blocks of 64 x 256).
        UNROLL: tl.constexpr = SUB if SUB * BLOCK_N * BLOCK_D <= UNROLL_ELEMS else (
            UNROLL_ELEMS // (BLOCK_N * BLOCK_D) if BLOCK_N * BLOCK_D <= UNROLL_ELEMS else 1)
        STEPS: tl.constexpr = SUB // UNROLL
        for e in range(n_part * STEPS, (n_part + n_full) * STEPS):
            first_n = listed_start(idx_ptr, e, STEPS, LIST_N, UNROLL * BLOCK_N)
            for j in tl.static_range(UNROLL):
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, first_n + j * BLOCK_N,
                                              rows, n_k, shift, left, right, qk_scale, stride_kn, stride_vn, d_ok,
                                              mods, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, FP8, V_TMA,
                                              SOFTCAP, ALIBI)
    else:
        lo, full_lo, full_hi, hi = visible_key_blocks(m0, n_k, shift, left, right, BLOCK_M, BLOCK_N,
                                                      HAS_LEFT, HAS_RIGHT)
        for blk in range(lo, full_lo):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, blk * BLOCK_N, rows,
                                          n_k, shift, left, right, qk_scale, stride_kn, stride_vn, d_ok, mods, BLOCK_N,
                                          True, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, FP8, V_TMA, SOFTCAP, ALIBI)
        for blk in range(full_lo, full_hi):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, blk * BLOCK_N, rows,
                                          n_k, shift, left, right, qk_scale, stride_kn, stride_vn, d_ok, mods, BLOCK_N,
                                          False, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, FP8, V_TMA, SOFTCAP, ALIBI)
        for blk in range(full_hi, hi):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, blk * BLOCK_N, rows,
                                          n_k, shift, left, right, qk_scale, stride_kn, stride_vn, d_ok, mods, BLOCK_N,
                                          True, HAS_LEFT, HAS_RIGHT, EVEN_D, TMA, FP8, V_TMA, SOFTCAP, ALIBI)

    seen = l_i != 0.0  # a NaN sum (a NaN or +inf score) gives NaN output and lse, not a row without keys
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if FP8:
        out = out * v_descale
        m_i = m_i - P_SHIFT  # l_i counts in units of 2**-P_SHIFT
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))

    # O is contiguous (B, N, H, D) and LSE (B, H, N): the backend allocates both.
    sob, son, soh = dense_strides(seq_q, n_heads, HEAD_D)
    o_ptrs = (O + b64 * sob + h.to(tl.int64) * soh
              + (seg.to(tl.int64) * seg_q + off + rows[:, None].to(tl.int64) * dilation) * son + offs_d[None, :])
    lse_ptrs = (LSE + b64 * (n_heads * seq_q) + h.to(tl.int64) * seq_q
                + (seg.to(tl.int64) * seg_q + off + rows.to(tl.int64) * dilation))
    o_mask = row_ok[:, None] & d_ok[None, :]
    if MERGE:
        # Combine with what earlier branches left.
        lse_old = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        o_old = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        out, lse = merge_partial(o_old, lse_old, out, lse)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, lse, mask=row_ok)
