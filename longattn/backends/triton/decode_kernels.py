"""Decode kernels: attention of a few new query tokens against a KV cache (contiguous or paged), split over keys.

- :func:`_cache_append`: writes the new keys and values into the cache at each sequence's current length (rows
  past the cache's capacity are not written).
- :func:`_decode_split`: one program per (key split, batch x KV head, row tile). Its rows are the ``G x Nq``
  (query head of the group, new token) pairs of one KV head, so each K/V tile is read once for the whole group.
  It walks its share of the sequence's key blocks (flash-decoding), masks by the causal band and window (query
  token ``t`` sits at key position ``n_keys - Nq + t``), and writes a float32 partial output and log-sum-exp
  that :func:`longattn.backends.triton.decode_launch.attend` merges over the splits (with one split and no
  sinks, ``DIRECT``: the output in its dtype and the log-sum-exp, so that no merge kernel runs). With
  ``SOFTCAP`` / ``ALIBI`` the scores are soft-capped, then ALiBi subtracts ``slope[b, h] * |position - j|``, before the mask
  (:func:`longattn.call.modify_scores`); both are applied to the base-2 scores with the cap and slopes scaled by
  ``log2(e)`` (the same modification, since both are homogeneous in the score's units).

Float8 caches (``FP8_CACHE``) are read as float8 and widened in registers (half the bytes of a bfloat16 cache) to
the queries' dtype, float16 for bfloat16 queries (:func:`_fp8_query`: one conversion per two values instead of
three per two), their descale factors per (sequence, KV head) folded into the score scale and the output.

Keys of a paged cache are gathered row by row through the block table, so any page size works; when the page size
is a multiple of the key block (``PAGE_BLOCKS``), a block's rows lie in one page and one table read serves them.
"""
import triton
import triton.language as tl

from longattn.backends.triton.jit import LN2, LOG2E, modified_scores, row_source


@triton.jit
def _cache_row_offsets(BT, b, pos, bt_sb, page_size, n_pages, scb, scn, PAGED: tl.constexpr,
                       PAGE: tl.constexpr = 0):
    """Element offsets of cache rows ``pos`` (logical positions of sequence ``b``), int64, without the head.
    ``PAGE``: the page size where the plan knows it at compile time (a power of two: shifts and masks for the
    per-row division), else 0 (``page_size``, read at run time)."""
    if PAGED:
        if PAGE:
            page = tl.load(BT + b * bt_sb + pos // PAGE)
            in_page = pos % PAGE
        else:
            page = tl.load(BT + b * bt_sb + pos // page_size)
            in_page = pos % page_size
        page = tl.minimum(tl.maximum(page, 0), n_pages - 1)  # never address outside the cache
        return page.to(tl.int64) * scb + in_page.to(tl.int64) * scn
    else:
        return b.to(tl.int64) * scb + pos.to(tl.int64) * scn


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One key block of the online softmax: scores ``s`` (base-2 logits, -inf where masked), values ``v``; returns
    the updated running max, sum and accumulator (a row that has seen no key keeps max -inf and sum 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i):
    """The normalised output and natural log-sum-exp of each row (0 and -inf for a row without keys)."""
    seen = l_i != 0.0  # a NaN sum (a NaN or +inf score) gives NaN output and lse, not a row without keys
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    return out, lse


@triton.jit
def _cache_descales(qk_scale, KD, VD, b, kvh, kd_sb, kd_sh, vd_sb, vd_sh, FP8_CACHE: tl.constexpr):
    """``(qk_scale, v_factor)`` of (sequence ``b``, KV head ``kvh``): with float8 caches the keys' descale factor
    joins the score scale and the values' multiplies the output (the cached tiles are widened to the queries'
    dtype, exactly); otherwise unchanged and 1."""
    if FP8_CACHE:
        return qk_scale * tl.load(KD + b * kd_sb + kvh * kd_sh), tl.load(VD + b * vd_sb + kvh * vd_sh)
    else:
        return qk_scale, 1.0


@triton.jit
def _fp8_query(q, qk_scale):
    """bfloat16 queries against float8 caches: ``(q16, qk_scale)`` with ``q16`` float16 (the cached tiles then widen
    to float16 in one conversion per two values, where bfloat16 takes three) and the scale adjusted. The queries are
    first multiplied by a power of two bringing their largest magnitude to [2^13, 2^14): exact, and every bfloat16
    value within 2^-27 of that maximum is a float16 normal number, so float16 holds it exactly (8 mantissa bits in
    11); smaller ones keep an absolute error below 2^-38 of the maximum. The factor is divided out of the scale."""
    qf = q.to(tl.float32)
    top = tl.max(tl.max(tl.abs(qf), 1), 0)
    shift = tl.math.exp2(13.0 - tl.where(top > 0.0, tl.floor(tl.math.log2(top)), 0.0))
    return (qf * shift).to(tl.float16), qk_scale / shift


@triton.jit
def _cache_append(KN, VN, KC, VC, SEQLENS, BT, skb, skn, skh, svb, svn, svh, sckb, sckn, sckh, scvb, scvn, scvh,
                  bt_sb, page_size, n_pages, capacity, n_new, n_kv_heads,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGED: tl.constexpr):
    b = tl.program_id(0)
    t = tl.program_id(1)
    pos = tl.load(SEQLENS + b) + t
    if (pos >= capacity) | (pos < 0):
        return
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    mask = (hs < n_kv_heads)[:, None] & (ds < HEAD_D)[None, :]
    b64 = b.to(tl.int64)
    hs64 = hs[:, None].to(tl.int64)  # (a head stride times a head can pass 2**31: an HF (B, Hk, M, D) cache's M * D)
    k = tl.load(KN + b64 * skb + t * skn + hs64 * skh + ds[None, :], mask=mask)
    v = tl.load(VN + b64 * svb + t * svn + hs64 * svh + ds[None, :], mask=mask)
    row_k = _cache_row_offsets(BT, b, pos, bt_sb, page_size, n_pages, sckb, sckn, PAGED)
    row_v = _cache_row_offsets(BT, b, pos, bt_sb, page_size, n_pages, scvb, scvn, PAGED)
    tl.store(KC + row_k + hs64 * sckh + ds[None, :], k, mask=mask)
    tl.store(VC + row_v + hs64 * scvh + ds[None, :], v, mask=mask)


@triton.jit
def _kv_source(C, b64, kvh, sb, sh, sn, n_keys, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               TMA: tl.constexpr):
    """With ``TMA`` (contiguous caches) a descriptor of sequence ``b64``'s ``n_keys`` rows of head ``kvh`` in cache
    ``C`` (rows past them arrive as zeros), else ``C`` itself."""
    if TMA:
        return row_source(C + b64 * sb + kvh.to(tl.int64) * sh, n_keys, sn, HEAD_D, BLOCK_N, BLOCK_D, True)
    else:
        return C


@triton.jit
def _tile(src, rows, kvh, sch, ds, ld, blk, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """A key block's K or V tile: by descriptor ``src`` with ``TMA``, else from the cache ``src`` at row offsets
    ``rows`` of its head ``kvh`` (rows outside ``ld`` as zeros)."""
    if TMA:
        return src.load([blk * BLOCK_N, 0])
    else:
        return tl.load(src + rows[:, None] + kvh.to(tl.int64) * sch + ds[None, :], mask=ld, other=0.0)


@triton.jit
def _decode_split(Q, KC, VC, SEQLENS, BT, WS, pl_off, sqb, sqn, sqh, sckb, sckn, sckh, scvb, scvn, scvh,
                  bt_sb, page_size, n_pages, capacity, n_q, n_extra, n_q_heads, n_kv_heads, group, n_splits, scale,
                  left, right, KD, VD, kd_sb, kd_sh, vd_sb, vd_sh, SLOPES, sl_sb, sl_sh, softcap,
                  OUT, sob, son, soh, lse_off,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_BLOCKS: tl.constexpr, FP8_CACHE: tl.constexpr, SOFTCAP: tl.constexpr,
                  ALIBI: tl.constexpr, DIRECT: tl.constexpr = False, PAGE: tl.constexpr = 0,
                  TMA: tl.constexpr = False):
    split = tl.program_id(0)
    b = tl.program_id(1) // n_kv_heads
    kvh = tl.program_id(1) % n_kv_heads
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head of the group) pairs
    row_ok = rows < n_q * group
    t = rows // group
    h = kvh * group + rows % group
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < HEAD_D
    n_keys = tl.minimum(tl.maximum(tl.load(SEQLENS + b) + n_extra, 0), capacity)  # never read past the cache
    pos = n_keys - n_q + t  # the key position of each row's token (bottom-right aligned)

    n_blocks = tl.cdiv(n_keys, BLOCK_N)
    per = tl.cdiv(n_blocks, n_splits)
    lo = split * per
    hi = tl.minimum(lo + per, n_blocks)
    if HAS_LEFT:  # no row sees before the first token's band
        lo = tl.maximum(lo, (tl.maximum(n_keys - n_q - left, 0)) // BLOCK_N)

    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * sqb + t[:, None].to(tl.int64) * sqn + h[:, None] * sqh + ds[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = scale * LOG2E
    qk_scale, v_descale = _cache_descales(qk_scale, KD, VD, b, kvh, kd_sb, kd_sh, vd_sb, vd_sh, FP8_CACHE)
    if FP8_CACHE and q.dtype == tl.bfloat16:
        q, qk_scale = _fp8_query(q, qk_scale)
    if SOFTCAP or ALIBI:  # in base-2 units: the cap and the slopes (SLOPES (B, Hq) float32) times log2(e)
        cap2 = softcap * LOG2E
        slope2 = 0.0
        if ALIBI:  # each row's own query head
            slope2 = (tl.load(SLOPES + b * sl_sb + h * sl_sh, mask=row_ok, other=0.0) * LOG2E)[:, None]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_src = _kv_source(KC, b64, kvh, sckb, sckh, sckn, n_keys, HEAD_D, BLOCK_N, BLOCK_D, TMA)
    v_src = _kv_source(VC, b64, kvh, scvb, scvh, scvn, n_keys, HEAD_D, BLOCK_N, BLOCK_D, TMA)
    for blk in range(lo, hi):
        cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_keys
        cc = tl.minimum(cols, n_keys - 1)  # never address past the sequence (its pages may be unmapped)
        ld = col_ok[:, None] & d_ok[None, :]
        if TMA:
            row_k = 0  # (unused)
            row_v = 0
        elif PAGE_BLOCKS:  # the block lies in one page: one block-table read, contiguous rows
            page = tl.load(BT + b * bt_sb + (blk * BLOCK_N) // page_size)
            page = tl.minimum(tl.maximum(page, 0), n_pages - 1).to(tl.int64)
            in_page = ((cc % PAGE) if PAGE else (cc % page_size)).to(tl.int64)
            row_k = page * sckb + in_page * sckn
            row_v = page * scvb + in_page * scvn
        else:
            row_k = _cache_row_offsets(BT, b, cc, bt_sb, page_size, n_pages, sckb, sckn, PAGED, PAGE)
            row_v = _cache_row_offsets(BT, b, cc, bt_sb, page_size, n_pages, scvb, scvn, PAGED, PAGE)
        k = _tile(k_src, row_k, kvh, sckh, ds, ld, blk, BLOCK_N, TMA).to(q.dtype)
        v = _tile(v_src, row_v, kvh, scvh, ds, ld, blk, BLOCK_N, TMA).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if SOFTCAP or ALIBI:
            s, _ = modified_scores(s, pos, cols, 0, cap2, slope2, SOFTCAP, ALIBI, False)
        ok = col_ok[None, :] & row_ok[:, None]
        if HAS_RIGHT:
            ok = ok & (cols[None, :] <= (pos + right)[:, None])
        if HAS_LEFT:
            ok = ok & (cols[None, :] >= (pos - left)[:, None])
        m_i, l_i, acc = _softmax_step(tl.where(ok, s, float("-inf")), v, m_i, l_i, acc)
    out, lse = _finish(acc, m_i, l_i)
    out = out * v_descale
    if DIRECT:  # one split and no sinks: the merge would copy these; the output and lse (B, Hq, Nq) written here
        o_ptrs = OUT + b64 * sob + t[:, None].to(tl.int64) * son + h[:, None] * soh + ds[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(WS + lse_off + (b64 * n_q_heads + h) * n_q + t, lse, mask=row_ok)
    else:
        # the workspace holds PO (splits, B, Nq, Hq, D) and, from pl_off on, PL (splits, B, Hq, Nq), float32
        PO = WS
        PL = WS + pl_off
        base = (split * tl.num_programs(1) // n_kv_heads + b).to(tl.int64)  # (split, b) flattened
        o_ptrs = PO + ((base * n_q + t[:, None]) * n_q_heads + h[:, None]) * HEAD_D + ds[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PL + (base * n_q_heads + h) * n_q + t, lse, mask=row_ok)


@triton.jit
def _decode_merge(WS, OUT, SINKS, pl_off, lse_off, sob, son, soh, n_q, n_q_heads, n_splits, split_stride_l,
                  split_stride_o, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  CHUNK_S: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """Merge of the splits by log-sum-exp: one program per (sequence x token, query head) writes ``OUT[b, t, h]``
    (in OUT's dtype, through its strides) and ``LSE[b, h, t]`` (float32, contiguous ``(B, Hq, Nq)``, in the
    workspace from ``lse_off`` on). PO and PL are :func:`_decode_split`'s partials; the split strides are
    ``B*Hq*Nq`` and ``B*Hq*Nq*D``; ``BLOCK_S`` covers all splits, read ``CHUNK_S`` at a time. ``HAS_SINKS``: the
    attention sink ``SINKS[h]`` (a logit, any float dtype) is one more entry of the denominator, with no value
    (:func:`longattn.call.add_sinks`' result, in the same kernel)."""
    PO = WS
    PL = WS + pl_off
    LSE = WS + lse_off
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // n_q
    t = bt % n_q
    at = (b * n_q_heads + h) * n_q + t
    ss = tl.arange(0, BLOCK_S)
    lses = tl.load(PL + ss.to(tl.int64) * split_stride_l + at, mask=ss < n_splits, other=float("-inf"))
    m = tl.max(lses, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        m = tl.maximum(m, sink, propagate_nan=tl.PropagateNan.ALL)  # (a NaN sink: NaN, as on every route)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    den = tl.sum(tl.math.exp2((lses - m_sub) * LOG2E), 0)  # splits that saw no key weigh 0
    if HAS_SINKS:
        den += tl.where(sink == m_sub, 1.0, tl.math.exp2((sink - m_sub) * LOG2E))  # (a sink of +inf: 1, not NaN)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < HEAD_D
    cs = tl.arange(0, CHUNK_S)
    po = PO + ((b * n_q + t) * n_q_heads + h).to(tl.int64) * HEAD_D + ds[None, :]
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, CHUNK_S):
        s_ok = s0 + cs < n_splits
        w = tl.math.exp2((tl.load(PL + (s0 + cs).to(tl.int64) * split_stride_l + at, mask=s_ok,
                                  other=float("-inf")) - m_sub) * LOG2E)
        o = tl.load(po + (s0 + cs).to(tl.int64)[:, None] * split_stride_o, mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    # den == 0: no key and no sink (output 0, lse -inf); a NaN den (a NaN sink) stays NaN in both
    out = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(OUT + b.to(tl.int64) * sob + t * son + h * soh + ds, out.to(OUT.dtype.element_ty), mask=d_ok)
    tl.store(LSE + at, tl.where(den == 0.0, float("-inf"), m_sub + tl.math.log2(den) * LN2))


@triton.jit
def _dilated_decode_split(Q, KC, VC, SEQLENS, BT, BR, WS, pl_off, sqb, sqn, sqh, sckb, sckn, sckh, scvb, scvn, scvh,
                          bt_sb, page_size, n_pages, capacity, n_q, n_extra, n_q_heads, group, n_splits, row_tiles,
                          scale, KD, VD, kd_sb, kd_sh, vd_sb, vd_sh, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                          FP8_CACHE: tl.constexpr):
    """LongNet decode: one program per (key split, batch x query head, branch x row tile); its rows are new tokens
    of one query head. Branch ``br`` (``BR[br] = (w, r, first head, end head, offset or -1 for h % r)``) lets the
    query at position ``p`` see the keys ``s + o, s + o + r, ... <= p`` of its segment ``[s, s + w)`` when ``p``
    itself is one of them; only those rows are read. A tile's tokens may straddle segments: each is walked, the
    rows of other segments masked. Partials go to slot ``br * n_splits + split`` of the workspace, merged with
    the splits' by :func:`_decode_merge` (the branches merge by log-sum-exp exactly as splits do)."""
    split = tl.program_id(0)
    b = tl.program_id(1) // n_q_heads
    h = tl.program_id(1) % n_q_heads
    br = tl.program_id(2) // row_tiles
    tile = tl.program_id(2) % row_tiles
    w = tl.load(BR + br * 5)
    r = tl.load(BR + br * 5 + 1)
    active = (h >= tl.load(BR + br * 5 + 2)) & (h < tl.load(BR + br * 5 + 3))
    fixed = tl.load(BR + br * 5 + 4)
    o = tl.where(fixed >= 0, fixed, h % r)
    kvh = h // group
    t = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < HEAD_D
    n_keys = tl.minimum(tl.maximum(tl.load(SEQLENS + b) + n_extra, 0), capacity)
    p = n_keys - n_q + t  # each token's position in the sequence
    pc = tl.maximum(p, 0)
    seg_t = pc // w
    in_seg = pc - seg_t * w
    sel = (t < n_q) & (p >= 0) & (in_seg >= o) & ((in_seg - o) % r == 0) & active

    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * sqb + t[:, None].to(tl.int64) * sqn + h * sqh + ds[None, :],
                mask=(t < n_q)[:, None] & d_ok[None, :], other=0.0)
    qk_scale = scale * LOG2E
    qk_scale, v_descale = _cache_descales(qk_scale, KD, VD, b, kvh, kd_sb, kd_sh, vd_sb, vd_sh, FP8_CACHE)
    if FP8_CACHE and q.dtype == tl.bfloat16:
        q, qk_scale = _fp8_query(q, qk_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    p_lo = tl.maximum(n_keys - n_q + tile * BLOCK_M, 0)
    p_hi = n_keys - n_q + tl.minimum(tile * BLOCK_M + BLOCK_M, n_q) - 1
    seg_lo = p_lo // w
    seg_hi = tl.where(active & (p_hi >= 0), p_hi // w, seg_lo - 1)
    for seg in range(seg_lo, seg_hi + 1):
        s0 = seg * w + o  # the segment's first selected position
        top = tl.minimum(p_hi, seg * w + w - 1)
        count = tl.where(top >= s0, (top - s0) // r + 1, 0)
        n_blocks = tl.cdiv(count, BLOCK_N)
        per = tl.cdiv(n_blocks, n_splits)
        lo = split * per
        hi = tl.minimum(lo + per, n_blocks)
        for blk in range(lo, hi):
            u = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = s0 + u * r
            col_ok = u < count
            cc = tl.minimum(cols, n_keys - 1)
            ld = col_ok[:, None] & d_ok[None, :]
            k = tl.load(KC + _cache_row_offsets(BT, b, cc, bt_sb, page_size, n_pages, sckb, sckn, PAGED)[:, None]
                        + kvh.to(tl.int64) * sckh + ds[None, :], mask=ld, other=0.0).to(q.dtype)
            v = tl.load(VC + _cache_row_offsets(BT, b, cc, bt_sb, page_size, n_pages, scvb, scvn, PAGED)[:, None]
                        + kvh.to(tl.int64) * scvh + ds[None, :], mask=ld, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            ok = col_ok[None, :] & (sel & (seg_t == seg))[:, None] & (cols[None, :] <= p[:, None])
            m_i, l_i, acc = _softmax_step(tl.where(ok, s, float("-inf")), v, m_i, l_i, acc)
    out, lse = _finish(acc, m_i, l_i)
    out = out * v_descale
    slot = (br * n_splits + split).to(tl.int64)
    base = slot * (tl.num_programs(1) // n_q_heads) + b  # (slot, b) flattened
    row_ok = t < n_q
    tl.store(WS + ((base * n_q + t[:, None]) * n_q_heads + h) * HEAD_D + ds[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(WS + pl_off + (base * n_q_heads + h) * n_q + t, lse, mask=row_ok)
