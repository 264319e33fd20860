"""Python launchers of the kernels: strided views, mask arguments, grids.

A call of the library is a list of :class:`SeqView` branches (one for dense, causal, window and block-sparse
attention; one per (segment length, dilation) for dilated attention). Each branch is one launch of the forward
kernel, and one of each backward kernel, on the original tensors, with strides and offsets doing the selection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import triton
from torch import Tensor

from longattn.kernels import bwd as _bwd
from longattn.kernels import fwd as _fwd
from longattn.kernels.configs import Tiles, fit_tiles, tiles_for, tma_wanted

MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class SeqView:
    """One branch: segments of ``seg_q``/``seg_k`` positions, every ``dilation``-th row from an offset.

    The offset is ``h % dilation`` for head ``h`` when ``per_head_offset``, else ``offset``. The branch covers query
    heads ``[head_start, head_start + n_heads)``.
    """

    seg_q: int
    seg_k: int
    n_seg: int
    n_heads: int
    dilation: int = 1
    offset: int = 0
    per_head_offset: bool = False
    head_start: int = 0

    @property
    def rows(self) -> int:
        """Rows of the longest sequence (query or key segment) one program walks in this view."""
        return -(-max(self.seg_q, self.seg_k) // self.dilation)

    def covers(self, n_heads: int) -> bool:
        """Whether the branch gives every row of every head (so nothing needs initialising before it)."""
        return self.dilation == 1 and self.head_start == 0 and self.n_heads == n_heads


def dense_view(n: int, m: int, n_heads: int) -> SeqView:
    return SeqView(seg_q=n, seg_k=m, n_seg=1, n_heads=n_heads)


def dilated_views(n: int, n_heads: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                  head_split: bool) -> List[SeqView]:
    """The branches of LongNet dilated attention (see :func:`longattn.dilated_attention`)."""
    views = []
    k = len(segment_lengths)
    start = 0
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        w = min(w, max(n, 1))
        n_seg = -(-n // w)
        if head_split:
            size = n_heads // k + (1 if i < n_heads % k else 0)
            if size:
                views.append(SeqView(w, w, n_seg, size, r, i % r, False, start))
            start += size
        else:
            views.append(SeqView(w, w, n_seg, n_heads, r, 0, r > 1, 0))
    return views


def mask_args(causal: bool, window: Tuple[int, int]) -> Tuple[int, int, bool, bool]:
    """(left, right, has_left, has_right) of the visibility band; causal caps ``right`` at 0."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return max(left, 0), max(right, 0), left >= 0, right >= 0


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _list_args(num: Optional[Tensor], idx: Optional[Tensor], dummy: Tensor):
    if num is None:
        return (dummy, dummy) + (0,) * 7
    sn = [0 if num.shape[i] == 1 else num.stride(i) for i in range(2)] + [num.stride(2)]
    si = [0 if idx.shape[i] == 1 else idx.stride(i) for i in range(2)] + [idx.stride(2), idx.stride(3)]
    return (num, idx, *sn, *si)


def _check_grid(view: SeqView, batch: int, n_z: int) -> None:
    if batch * view.n_seg > MAX_GRID_YZ or n_z > MAX_GRID_YZ:
        raise ValueError(
            f"batch * segments ({batch} * {view.n_seg}) and heads must each be at most {MAX_GRID_YZ} for the "
            "Triton kernels; use longer segments or backend='torch'"
        )


def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: launches run under its guard


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch from Triton's allocator. Triton keeps it in a
    context variable (unset in autograd's worker thread, for one); install one from torch's caching allocator where
    none is set, leaving a user's own in place."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # pragma: no cover - a Triton without this module: set ours
        pass
    triton.set_allocator(_torch_scratch)


def _tma_ok(view: SeqView, *tensors: Tensor) -> bool:
    """Whether ``tensors`` (the ones loaded by descriptor) meet TMA's alignment: unit stride along the head dim,
    16-byte aligned base and strides, a positive sequence stride (the view's row stride is ``dilation`` times it)."""
    if not tma_wanted(tensors[0].device, view.rows):
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.stride(1) <= 0 or t.data_ptr() % 16:
            return False
        if any(t.shape[i] > 1 and (t.stride(i) * size) % 16 for i in (0, 2)) or (t.stride(1) * size) % 16:
            return False
    _ensure_allocator()
    return True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tiles(pass_name: str, q: Tensor, banded: bool, list_block: Optional[Tuple[int, int]], view: SeqView) -> Tiles:
    t = tiles_for(pass_name, q.shape[-1], q.device, banded, listed=list_block is not None, rows=view.rows)
    return t if list_block is None else fit_tiles(t, *list_block)


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, view: SeqView, causal: bool,
            window: Tuple[int, int], scale: float, *, merge: bool = False, lists=None,
            list_block: Optional[Tuple[int, int]] = None) -> None:
    """Run the forward kernel for one branch, writing (or with ``merge``, merging into) ``o`` and ``lse``.

    ``lists``: block lists at the granularity ``list_block = (block_q, block_k)`` (block-sparse attention).
    """
    B, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    left, right, has_left, has_right = mask_args(causal, window)
    t = _tiles("fwd", q, has_left or has_right, list_block, view)
    list_m, list_n = list_block or (t.block_m, t.block_n)
    rows = _cdiv(view.seg_q, view.dilation)
    grid = (_cdiv(rows, t.block_m), B * view.n_seg, view.n_heads)
    _check_grid(view, B, view.n_heads)
    kv_num, kv_idx = (lists.kv_num, lists.kv_idx) if lists is not None else (None, None)
    _fwd._flash_fwd[grid](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        *_list_args(kv_num, kv_idx, lse),
        N, M, view.seg_q, view.seg_k, view.n_seg, view.dilation, view.offset, view.head_start, Hq // Hk, scale,
        left, right,
        HEAD_D=D, BLOCK_D=_block_d(D), BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_LEFT=has_left,
        HAS_RIGHT=has_right, USE_LIST=lists is not None, PER_HEAD_OFFSET=view.per_head_offset, MERGE=merge,
        LIST_M=list_m, LIST_N=list_n, TMA=_tma_ok(view, k, v), num_warps=t.num_warps, num_stages=t.num_stages,
    )


def row_delta(o: Tensor, do: Tensor) -> Tensor:
    """``rowsum(do * o)`` as float32 ``(B, H, N)``."""
    B, N, H, D = o.shape
    delta = torch.empty((B, H, N), device=o.device, dtype=torch.float32)
    block = 64
    _bwd._flash_bwd_delta[(_cdiv(N, block), B * H)](
        o, do, delta, *o.stride(), *do.stride(), *delta.stride(), N, H,
        HEAD_D=D, BLOCK_D=_block_d(D), BLOCK_M=block,
    )
    return delta


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, dq: Tensor, dk: Tensor,
             dv: Tensor, view: SeqView, causal: bool, window: Tuple[int, int], scale: float, *,
             accumulate: bool = False, lists=None, list_block: Optional[Tuple[int, int]] = None) -> None:
    """Run the dK/dV and dQ kernels for one branch (adding into the gradients with ``accumulate``)."""
    B, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    group = Hq // Hk
    left, right, has_left, has_right = mask_args(causal, window)
    banded = has_left or has_right
    common = dict(HEAD_D=D, BLOCK_D=_block_d(D), HAS_LEFT=has_left, HAS_RIGHT=has_right,
                  USE_LIST=lists is not None, PER_HEAD_OFFSET=view.per_head_offset, ACCUMULATE=accumulate)
    scalars = (N, M, view.seg_q, view.seg_k, view.n_seg, view.dilation, view.offset, view.head_start)

    t = _tiles("dkdv", q, banded, list_block, view)
    list_m, list_n = list_block or (t.block_m, t.block_n)
    n_classes = min(group, view.dilation) if view.per_head_offset else 1
    kv_first = view.head_start // group
    kv_last = (view.head_start + view.n_heads - 1) // group
    n_z = (kv_last - kv_first + 1) * n_classes
    _check_grid(view, B, n_z)
    grid = (_cdiv(_cdiv(view.seg_k, view.dilation), t.block_n), B * view.n_seg, n_z)
    q_num, q_idx = (lists.q_num, lists.q_idx) if lists is not None else (None, None)
    _bwd._flash_bwd_dkdv[grid](
        q, k, v, do, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
        *dv.stride(), *lse.stride(), *_list_args(q_num, q_idx, lse),
        *scalars, view.n_heads, group, scale, left, right,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, N_CLASSES=n_classes, LIST_M=list_m, LIST_N=list_n,
        ONE_HEAD=group == 1 or (view.per_head_offset and view.dilation >= group), TMA=_tma_ok(view, q, do),
        **common, num_warps=t.num_warps, num_stages=t.num_stages,
    )

    t = _tiles("dq", q, banded, list_block, view)
    list_m, list_n = list_block or (t.block_m, t.block_n)
    grid = (_cdiv(_cdiv(view.seg_q, view.dilation), t.block_m), B * view.n_seg, view.n_heads)
    kv_num, kv_idx = (lists.kv_num, lists.kv_idx) if lists is not None else (None, None)
    _bwd._flash_bwd_dq[grid](
        q, k, v, do, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        *lse.stride(), *_list_args(kv_num, kv_idx, lse),
        *scalars, group, scale, left, right,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, LIST_M=list_m, LIST_N=list_n, TMA=_tma_ok(view, k, v), **common,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
