"""Pieces shared by the forward and backward kernels: the strided-sequence view and the visible key range.

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
