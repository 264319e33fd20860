"""The jit helpers the forward and backward kernels share: a program's place in its strided view, the key or
query blocks it walks (a range, or a block list), the pair masks, tile loads, and the log-sum-exp merge.

Every kernel works on a *strided sequence view*. The sequence of ``SEQ`` positions is cut into segments of ``SEG``
positions (the last may be shorter); inside segment ``s``, head ``h`` sees the positions
``s * SEG + o, s * SEG + o + R, ...`` below ``min((s + 1) * SEG, SEQ)``, where ``R`` is the dilation and ``o`` the
offset. Row ``i`` of the view is position ``s * SEG + o + i * R``. Dense attention is the view with one segment,
``R = 1`` and ``o = 0``; a LongNet branch is the same view with its segment length and dilation. Masks (causal,
window) are expressed on row indices of the views, bottom-right aligned: query row ``i`` sits at key row
``i + n_k - n_q``.
"""
import triton
import triton.language as tl

from longattn.backends import kernel_args

LOG2E = tl.constexpr(kernel_args.LOG2E)  # scores are scaled into base 2 once, for exp2
LN2 = tl.constexpr(kernel_args.LN2)
P_SHIFT = tl.constexpr(kernel_args.P_SHIFT)
# Block-list loops unroll a listed block's tiles while their rows x head dim stay within this many elements: the
# buffers of unrolled loads grow with it (beyond 128 x 128 they outgrow an H100's shared memory).
UNROLL_ELEMS = tl.constexpr(128 * 128)


@triton.jit
def sequence_bounds(CU_Q, CU_K, b, seq_q, seq_k, VARLEN: tl.constexpr):
    """First rows and lengths ``(q0, k0, len_q, len_k)`` of sequence ``b``. With ``VARLEN`` the batch is packed
    (tensors of one batch row) and sequence ``b`` is rows ``CU[b]:CU[b + 1]`` (int32 cumulative lengths); else
    every sequence has ``seq_q`` queries and ``seq_k`` keys and ``q0 = k0 = 0`` (unused: the batch stride places
    it)."""
    if VARLEN:
        q0 = tl.load(CU_Q + b)
        k0 = tl.load(CU_K + b)
        len_q = tl.load(CU_Q + b + 1) - q0
        len_k = tl.load(CU_K + b + 1) - k0
    else:
        q0 = 0
        k0 = 0
        len_q = seq_q
        len_k = seq_k
    return q0, k0, len_q, len_k


@triton.jit
def query_program(seq_q, seq_k, seg_q, seg_k, n_seg, dilation, offset, head_start, CU_Q, CU_K,
                  PER_HEAD_OFFSET: tl.constexpr, VARLEN: tl.constexpr):
    """A query-block program (grid: query blocks, batch x segments, heads): its query block, counted from the end
    (under a causal mask the last blocks have the most work, so the tail of the grid is short), batch (sequence,
    with ``VARLEN``), segment, query head, view offset, the rows of its query and key views, and the first rows of
    its sequence in the packed batch (see :func:`sequence_bounds`)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_z = tl.program_id(1)
    h = head_start + tl.program_id(2)
    b = pid_z // n_seg
    seg = pid_z % n_seg
    if PER_HEAD_OFFSET:
        off = h % dilation
    else:
        off = offset
    q0, k0, len_q, len_k = sequence_bounds(CU_Q, CU_K, b, seq_q, seq_k, VARLEN)
    n_q = view_rows(len_q, seg_q, seg, off, dilation)
    n_k = view_rows(len_k, seg_k, seg, off, dilation)
    return pid_m, b, seg, h, off, n_q, n_k, q0, k0


@triton.jit
def dense_strides(seq, n_heads, HEAD_D: tl.constexpr):
    """Batch, sequence and head strides of a contiguous ``(B, seq, n_heads, HEAD_D)`` tensor (the outputs and
    gradients the backend allocates, and dO)."""
    return seq * n_heads * HEAD_D, n_heads * HEAD_D, HEAD_D


@triton.jit
def stat_row0(b64, h, seq, n_heads):
    """Offset of row 0 of head ``h`` in a contiguous ``(B, n_heads, seq)`` float32 row statistic (log-sum-exp,
    delta); ``b64`` is the batch index as int64."""
    return (b64 * n_heads + h) * seq


@triton.jit
def list_row(NUM, IDX, b, h, row, list_sb, list_sh, list_w):
    """Block list ``row`` of (batch, head): a pointer to its block indices and its counts of partial and full blocks.

    ``NUM (Bm, Hm, rows, 2)`` and ``IDX (Bm, Hm, rows, list_w)`` are contiguous; ``list_sb`` / ``list_sh`` are the
    row strides of their leading dims (0 where the mask broadcasts)."""
    num_ptr = NUM + b * (2 * list_sb) + h * (2 * list_sh) + row * 2
    idx_ptr = IDX + b * (list_sb * list_w) + h * (list_sh * list_w) + row * list_w
    return idx_ptr, tl.load(num_ptr), tl.load(num_ptr + 1)


@triton.jit
def listed_start(idx_ptr, t, SUB: tl.constexpr, LIST_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """First row of tile ``t`` of a block list, whose blocks of ``LIST_BLOCK`` rows are cut into ``SUB`` tiles of
    ``BLOCK`` rows."""
    # (``t % SUB`` fails in the interpreter when ``SUB`` arrives as a constexpr object: no ``int % constexpr``)
    return tl.load(idx_ptr + t // SUB) * LIST_BLOCK + (t - t // SUB * SUB) * BLOCK


@triton.jit
def merge_partial(o_old, lse_old, out, lse):
    """Merge a partial result into the one already in memory: weights are the softmax of the two log-sum-exps
    (as :func:`longattn.call.merge_partial`); rows where both are ``-inf`` give 0 / ``-inf``."""
    top = tl.maximum(lse_old, lse)
    top_sub = tl.where(top == float("-inf"), 0.0, top)
    w_old = tl.exp(lse_old - top_sub)
    w_new = tl.exp(lse - top_sub)
    denom = w_old + w_new
    any_seen = denom != 0.0  # a NaN (a NaN or +inf lse) stays NaN
    safe = tl.where(any_seen, denom, 1.0)
    merged = o_old * (w_old / safe)[:, None] + out * (w_new / safe)[:, None]
    return merged, tl.where(any_seen, top_sub + tl.log(safe), float("-inf"))


@triton.jit
def view_rows(seq, seg_len, seg, offset, dilation):
    """Number of rows of the view in segment ``seg`` (positions ``seg*seg_len + offset + i*dilation``)."""
    start = seg * seg_len + offset
    end = tl.minimum(seg * seg_len + seg_len, seq)
    return tl.maximum(end - start + dilation - 1, 0) // dilation


@triton.jit
def visible_key_blocks(m0, n_k, shift, left, right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key-block range seen by query rows ``[m0, m0 + BLOCK_M)``, split into edges that need masking.

    Query row ``i`` sees key rows ``j`` with ``i + shift - left <= j <= i + shift + right`` (a side without a bound
    when its flag is off) and ``j < n_k``. Returns block indices ``lo <= full_lo <= full_hi <= hi``: blocks in
    ``[full_lo, full_hi)`` are visible to every row of the query block and lie inside ``n_k``, so they need no mask.
    """
    lo_key = 0
    hi_key = n_k
    full_lo_key = 0
    full_hi_key = n_k
    if HAS_LEFT:
        lo_key = tl.maximum(m0 + shift - left, 0)
        full_lo_key = tl.maximum(m0 + BLOCK_M - 1 + shift - left, 0)
    if HAS_RIGHT:
        hi_key = tl.minimum(tl.maximum(m0 + BLOCK_M + shift + right, 0), n_k)
        full_hi_key = tl.minimum(tl.maximum(m0 + shift + right + 1, 0), n_k)
    lo = lo_key // BLOCK_N
    hi = tl.maximum((hi_key + BLOCK_N - 1) // BLOCK_N, lo)
    full_lo = tl.minimum(tl.maximum((full_lo_key + BLOCK_N - 1) // BLOCK_N, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi_key // BLOCK_N, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def visible_query_blocks(n0, n_q, shift, left, right,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query-block range that sees key rows ``[n0, n0 + BLOCK_N)`` (the transpose of :func:`visible_key_blocks`).

    Key row ``j`` is seen by query rows ``i`` with ``j - shift - right <= i <= j - shift + left``. Blocks in
    ``[full_lo, full_hi)`` see every key of the block (sequence ends need no mask in the backward: padded rows
    load as zeros and contribute nothing).
    """
    lo_row = 0
    hi_row = n_q
    full_lo_row = 0
    if HAS_RIGHT:
        lo_row = tl.maximum(n0 - shift - right, 0)
        full_lo_row = tl.maximum(n0 + BLOCK_N - 1 - shift - right, 0)
    if HAS_LEFT:
        hi_row = tl.minimum(tl.maximum(n0 + BLOCK_N - shift + left, 0), n_q)
    lo = lo_row // BLOCK_M
    hi = tl.maximum((hi_row + BLOCK_M - 1) // BLOCK_M, lo)
    full_hi = hi
    if HAS_LEFT:
        full_hi = tl.minimum(tl.maximum(n0 - shift + left + 1, 0) // BLOCK_M, hi)
    full_lo = tl.minimum(tl.maximum((full_lo_row + BLOCK_M - 1) // BLOCK_M, lo), hi)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def pair_mask(rows, cols, n_k, shift, left, right,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CHECK_END: tl.constexpr):
    """Elementwise visibility of key rows ``cols`` to query rows ``rows`` (see :func:`visible_key_blocks`), as a
    ``(rows, cols)`` tile. The bounds are formed per query row, so each element costs one or two compares."""
    if HAS_RIGHT:
        hi = rows + shift + right
        if CHECK_END:
            hi = tl.minimum(hi, n_k - 1)
        ok = cols[None, :] <= hi[:, None]
    elif CHECK_END:
        ok = cols[None, :] < n_k + 0 * rows[:, None]
    else:
        rel = cols[None, :] - rows[:, None]
        ok = rel == rel  # all True in the broadcast shape, folded at compile time (dense tiles pay nothing)
    if HAS_LEFT:
        ok = ok & (cols[None, :] >= (rows + shift - left)[:, None])
    return ok


@triton.jit
def pair_mask_t(rows, cols, shift, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """:func:`pair_mask` transposed, as a ``(cols, rows)`` tile (keys by queries), without the sequence-end check:
    built in that shape directly rather than transposing a mask tile. Query ``i`` sees key ``j`` when
    ``j - shift - right <= i <= j - shift + left``."""
    rel = rows[None, :] - cols[:, None]
    ok = rel == rel  # all True in the broadcast shape, folded at compile time (dense tiles pay nothing)
    if HAS_RIGHT:
        ok = ok & (rows[None, :] >= (cols - shift - right)[:, None])
    if HAS_LEFT:
        ok = ok & (rows[None, :] <= (cols - shift + left)[:, None])
    return ok


@triton.jit
def row_source(base, n_rows, row_stride, HEAD_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               TMA: tl.constexpr):
    """Where a kernel loads ``BLOCK_R``-row tiles of a view from: with ``TMA`` a tensor descriptor of the view's
    ``n_rows x HEAD_D`` rows (Hopper's tensor-memory accelerator: asynchronous copies, no address tiles in registers,
    rows past the end and columns past the head dim arrive as zeros), else the base pointer itself. The launcher
    checks the alignment descriptors need (16-byte base and row stride, unit stride along the head dim)."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[tl.maximum(n_rows, 1), HEAD_D], strides=[row_stride, 1],
                                         block_shape=[BLOCK_R, BLOCK_D])
    else:
        return base


@triton.jit
def load_row_tiles(a_src, b_src, a_offs, b_offs, start, idx, a_stride, b_stride, n_rows, d_ok,
                   EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """Rows ``idx`` (= ``start + arange``) of two views that share their rows (Q and dO, or K and V), from the
    sources :func:`row_source` gave: descriptors with ``TMA``, else pointers with the tiles' offsets ``a_offs`` /
    ``b_offs``. Rows past ``n_rows`` and columns past the head dim read as zeros either way."""
    if TMA:
        a = a_src.load([start, 0])
        b = b_src.load([start, 0])
    else:
        ld_mask = (idx < n_rows)[:, None]
        if not EVEN_D:
            ld_mask = ld_mask & d_ok[None, :]
        s64 = tl.cast(start, tl.int64)
        a = tl.load(a_src + s64 * a_stride + a_offs, mask=ld_mask, other=0.0)
        b = tl.load(b_src + s64 * b_stride + b_offs, mask=ld_mask, other=0.0)
    return a, b


@triton.jit
def modified_scores(x, rows, cols, shift, softcap, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                    TRANSPOSED: tl.constexpr):
    """Soft-capping and ALiBi of a tile of scaled scores ``x``, in that order: ``softcap * tanh(x / softcap)``,
    then ``- slope * |i + shift - j|`` for query row ``i`` and key row ``j``, in whatever units ``x``, ``softcap``
    and ``slope`` share (the kernels pass all three times log2(e): base 2, ready for exp2) (a
    ``(rows, cols)`` tile, or ``(cols, rows)`` with ``TRANSPOSED``). Returns the modified tile and
    ``tanh(x / softcap)`` (the backward's chain rule needs ``1 - tanh**2``; 0 without ``SOFTCAP``).

    ``tanh(y) = 1 - 2 / (exp(2y) + 1)`` with one exponential and one full-range reciprocal (``div.full``: 2 ulp),
    within a few float32 ulps of ``tanh`` away from 0, saturating to +-1 without overflow (docs/kernel_notes.md: it
    cut soft-capping from 1.8-2.4x the plain kernel to 1.6-1.9x). Near 0 that form is 1e-7 *absolute* (``1 - 2 /
    (e + 1)`` cancels), the capped score ``softcap * 1e-7`` off: within a float32 ulp of the cap's size for the caps
    models use (30, 50), but wrong for a large cap (1e-2 off the reference at 1e5). Caps above 64 (in the tile's
    units: the kernels' caps times log2(e) above ``64 * LOG2E``; one uniform branch a tile) take tanh's odd series to
    ``y**7`` below ``|y| = 1/8`` (the ``y**9`` term under 2e-10)."""
    t = x * 0.0
    if SOFTCAP:
        e = tl.math.exp2(x * (2.0 * LOG2E / softcap))  # exp(2 x / softcap)
        t = 1.0 - tl.fdiv(tl.full(x.shape, 2.0, tl.float32), e + 1.0, ieee_rounding=False)
        if softcap > 64.0 * LOG2E:
            y = x * (1.0 / softcap)
            y2 = y * y
            series = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
            t = tl.where(tl.abs(y) < 0.125, series, t)
        x = softcap * t
    if ALIBI:
        if TRANSPOSED:
            dist = rows[None, :] + shift - cols[:, None]
        else:
            dist = rows[:, None] + shift - cols[None, :]
        x = x - slope * tl.abs(dist).to(tl.float32)
    return x, t
