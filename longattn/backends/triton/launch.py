"""Launchers of the Triton passes: strided views, band and list arguments, grids.

A call (:class:`longattn.call.AttentionCall`) is a list of :class:`SeqView` branches: one for dense, causal, window
and block-sparse attention, one per (segment length, dilation) for dilated attention. Each branch is one launch of
the forward kernel, and one of each backward kernel, on the original tensors, with strides and offsets doing the
selection. The inputs q, k, v need unit stride along the head dim; the outputs and gradients the backend allocates
(and dO) are contiguous, so the kernels take three strides for each input and none for the rest.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from longattn.backends.kernel_args import alibi_kind, cdiv as _cdiv, ensure_allocator as _ensure_allocator  # noqa: F401
from longattn.backends.triton import bwd as _bwd
from longattn.backends.triton import fwd as _fwd
from longattn.backends.cached_launch import launch
from longattn.backends.triton.tiles import Tiles, fit_tiles, tiles_for, tma_wanted
from longattn.call import AttentionCall, Band, _interned

MAX_GRID_YZ = 65535  # CUDA's limit on the second and third grid dimensions
STATS_ROWS = 64  # rows per program of the row-statistics pass


@dataclass(frozen=True)
class SeqView:
    """One branch as the kernels see it: segments of ``seg_q``/``seg_k`` positions, every ``dilation``-th row from
    an offset, which is ``h % dilation`` for head ``h`` when ``per_head_offset``, else ``offset``; query heads
    ``[head_start, head_start + n_heads)``."""

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


def views(call: AttentionCall, n: int, m: int, n_heads: int) -> List[SeqView]:
    """The kernel views of ``call`` for ``n`` queries, ``m`` keys and ``n_heads`` query heads (for a packed batch,
    the longest sequence's: every sequence is cut the same way from its own first row, and a program past the end
    of its sequence returns at once)."""
    if not call.branches:
        return [SeqView(seg_q=n, seg_k=m, n_seg=1, n_heads=n_heads)]
    return [SeqView(br.segment, br.segment, -(-n // br.segment), br.n_heads, br.dilation,
                    0 if br.offset is None else br.offset, br.offset is None, br.head_start)
            for br in call.branches]


@dataclass(frozen=True)
class BandArgs:
    """The band as kernel arguments: non-negative ``left``/``right`` and whether each side is bounded."""

    left: int
    right: int
    has_left: bool
    has_right: bool

    @staticmethod
    def of(band: Band) -> "BandArgs":
        """The arguments of ``band``: immutable, one object per band (made on its first request, as
        :func:`longattn.call.flash_call`'s calls; a backward asks on every call)."""
        return _interned(_BAND_ARGS, (band.left, band.right), lambda: BandArgs._of(band.for_kernels()))

    @staticmethod
    def _of(band: Band) -> "BandArgs":
        return BandArgs(band.left or 0, band.right or 0, band.left is not None, band.right is not None)

    @property
    def banded(self) -> bool:
        return self.has_left or self.has_right


_BAND_ARGS: dict = {}  # (left, right) of a Band -> BandArgs (BandArgs.of)


_NO_SWITCH = contextlib.nullcontext()  # (reentrant: one for every call)


def on_device(t: Tensor):
    """Launch on ``t``'s GPU even when another one is current (Triton launches on the current device): a context
    that makes it current, or none where it is current already (the usual case; ``torch.cuda.device`` costs a few
    microseconds of host time on entry and exit) or ``t`` is not on a GPU."""
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(t.device)


def block_d(head_dim: int, fp8: bool = False) -> int:
    """The head dim padded to a power of two, at least 16 (the kernels' tile width along it; 32 for float8, the
    depth of one FP8 tensor-core product)."""
    return max(32 if fp8 else 16, 1 << (head_dim - 1).bit_length())


def _list_args(num: Optional[Tensor], idx: Optional[Tensor], dummy: Tensor) -> tuple:
    """``(NUM, IDX, list_sb, list_sh, list_w)``: contiguous lists and the row strides of their leading dims."""
    if num is None:
        return (dummy, dummy, 0, 0, 0)
    bm, hm, rows, _ = num.shape
    return (num, idx, hm * rows if bm > 1 else 0, rows if hm > 1 else 0, idx.shape[-1])


Packed = Optional[Tuple[Tensor, Tensor]]  # int32 cu_seqlens of the queries and keys of a packed batch


def _packed_args(q: Tensor, packed: Packed, dummy: Tensor) -> Tuple[int, Tensor, Tensor, bool]:
    """``(batch, CU_Q, CU_K, VARLEN)``: the grid's batch (sequences of a packed batch) and the kernels' arguments."""
    if packed is None:
        return q.shape[0], dummy, dummy, False
    return packed[0].shape[0] - 1, packed[0], packed[1], True


def _check_grid(view: SeqView, batch: int, n_z: int) -> None:
    if batch * view.n_seg > MAX_GRID_YZ or n_z > MAX_GRID_YZ:
        raise ValueError(
            f"batch * segments ({batch} * {view.n_seg}) and heads must each be at most {MAX_GRID_YZ} for the "
            "Triton kernels; use longer segments or backend='torch'"
        )


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


def seq_major_aligned(v: Tensor) -> bool:
    """Whether sequence-major values ``v (B, M, Hk, D)`` (``v.stride(1) == 1``, see
    :func:`longattn.backends.triton.fp8_layout.seq_major`) meet TMA's alignment: a 16-byte aligned base, and batch and
    head strides (of dims longer than one) and the head-dim stride multiples of 16 elements (float8: bytes)."""
    return v.stride(1) == 1 and v.data_ptr() % 16 == 0 and v.stride(3) % 16 == 0 and all(
        v.shape[i] == 1 or (v.stride(i) > 0 and v.stride(i) % 16 == 0) for i in (0, 2))


def _seq_major_tma_ok(v: Tensor, view: SeqView, packed: Packed) -> bool:
    """Whether sequence-innermost FP8 values load by descriptor: one segment, dilation 1 and no packed batch (their
    row offsets would misalign the descriptor's base), and TMA's alignment (:func:`seq_major_aligned`)."""
    if packed is not None or view.n_seg != 1 or view.dilation != 1 or view.offset != 0 or view.per_head_offset:
        return False
    return seq_major_aligned(v)


def _tiles(pass_name: str, q: Tensor, band: BandArgs, list_block: Optional[Tuple[int, int]], view: SeqView) -> Tiles:
    t = tiles_for(pass_name, q.shape[-1], q.device, band.banded, listed=list_block is not None, rows=view.rows)
    return t if list_block is None else fit_tiles(t, *list_block)


def _strides(*tensors: Tensor) -> tuple:
    """Batch, sequence and head strides of each tensor (the head dim has unit stride)."""
    return tuple(s for t in tensors for s in t.stride()[:3])


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, view: SeqView, band: BandArgs, scale: float, *,
            merge: bool = False, lists=None, list_block: Optional[Tuple[int, int]] = None,
            packed: Packed = None, descale: Optional[Tensor] = None, softcap: float = 0.0,
            slopes: Optional[Tensor] = None, alibi_offset: int = 0, tiles: Optional[Tiles] = None) -> None:
    """Run the forward kernel for one branch, writing (or with ``merge``, merging into) ``o`` and ``lse``.

    ``lists``: block lists at the granularity ``list_block = (block_q, block_k)`` (block-sparse attention).
    ``packed``: the cumulative sequence lengths of a packed batch (the tensors then have one batch row).
    ``descale``: float8 inputs' factors, float32 ``(3, B, Hk)`` contiguous (q's, k's, v's; B counts sequences
    of a packed batch); ``v`` then lies sequence-innermost (``v.stride(1) == 1``, see
    :func:`longattn.backends.triton.fp8_layout.seq_major`). ``softcap`` (0: off) and ``slopes`` (ALiBi, float32
    ``(B, Hq)`` contiguous; ``alibi_offset`` added to its distances, see :class:`longattn.call.AttentionCall`)
    modify the scores. ``tiles``: the plan's (:mod:`longattn.backends.triton.planner`); by default the table's.
    """
    _, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    B, cu_q, cu_k, varlen = _packed_args(q, packed, lse)
    fp8 = descale is not None
    t = tiles or _tiles("fwd_fp8" if fp8 else "fwd", q, band, list_block, view)
    list_m, list_n = list_block or (t.block_m, t.block_n)
    grid = (_cdiv(_cdiv(view.seg_q, view.dilation), t.block_m), B * view.n_seg, view.n_heads)
    _check_grid(view, B, view.n_heads)
    kv_num, kv_idx = (lists.kv_num, lists.kv_idx) if lists is not None else (None, None)
    tma = _tma_ok(view, k) if fp8 else _tma_ok(view, k, v)
    launch(
        _fwd._flash_fwd, grid,
        q, k, v, o, lse, *_strides(q, k, v), v.stride(3), *_list_args(kv_num, kv_idx, lse), cu_q, cu_k,
        descale if fp8 else lse, B * Hk, lse if slopes is None else slopes, float(softcap), int(alibi_offset),
        N, M, view.seg_q, view.seg_k, view.n_seg, view.dilation, view.offset, view.head_start, Hq, Hq // Hk, scale,
        band.left, band.right,
        HEAD_D=D, BLOCK_D=block_d(D, fp8), BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_LEFT=band.has_left,
        HAS_RIGHT=band.has_right, USE_LIST=lists is not None, PER_HEAD_OFFSET=view.per_head_offset, MERGE=merge,
        LIST_M=list_m, LIST_N=list_n, TMA=tma, VARLEN=varlen, FP8=fp8,
        V_TMA=fp8 and tma and _seq_major_tma_ok(v, view, packed), SOFTCAP=softcap > 0,
        ALIBI=alibi_kind(slopes, band, alibi_offset),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )


class RowStats(NamedTuple):
    """The backward's row statistics (:func:`row_stats`): float32 ``lse2`` (the log-sum-exp in base 2, ``+inf``
    where it is ``-inf``) and ``delta = rowsum(do * o)`` per (batch, head, row), as interleaved pairs
    ``(B, H, N, 2)`` when ``paired``, else as planes ``(2, B, H, N)``."""

    values: Tensor
    paired: bool

    @property
    def delta(self) -> Tensor:
        """``delta`` as a ``(B, H, N)`` view."""
        return self.values[..., 1] if self.paired else self.values[1]

    def kernel_args(self) -> tuple:
        """``(STATS, plane)``: the tensor and the offset of the delta plane (0 when paired)."""
        return self.values, 0 if self.paired else self.values.numel() // 2  # (the first plane's size)


def row_stats(o: Tensor, do: Tensor, lse: Tensor, paired: bool) -> RowStats:
    """The statistics the backward kernels read per query row, from the final output ``o``, its gradient ``do``
    and its log-sum-exp ``lse`` (``(B, H, N)`` contiguous); ``paired`` where the rows a kernel program reads may
    start at any row (packed batches, dilated views: see :mod:`longattn.backends.triton.bwd`)."""
    B, N, H, D = o.shape
    values = torch.empty((B, H, N, 2) if paired else (2, B, H, N), device=o.device, dtype=torch.float32)
    stats = RowStats(values, paired)
    launch(
        _bwd._flash_bwd_stats, (_cdiv(N, STATS_ROWS), B * H),
        o, do, lse, *stats.kernel_args(), *_strides(o, do), N, H, HEAD_D=D, BLOCK_D=block_d(D), BLOCK_M=STATS_ROWS,
        PAIRED=paired,
    )
    return stats


def _backward_common(q: Tensor, k: Tensor, lse: Tensor, view: SeqView, band: BandArgs, lists, accumulate: bool,
                     packed: Packed, softcap: float, slopes: Optional[Tensor], alibi_offset: int):
    _, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    B, cu_q, cu_k, varlen = _packed_args(q, packed, lse)
    constexprs = dict(HEAD_D=D, BLOCK_D=block_d(D), HAS_LEFT=band.has_left, HAS_RIGHT=band.has_right,
                      USE_LIST=lists is not None, PER_HEAD_OFFSET=view.per_head_offset, ACCUMULATE=accumulate,
                      VARLEN=varlen, SOFTCAP=softcap > 0, ALIBI=slopes is not None)
    scalars = (cu_q, cu_k, lse if slopes is None else slopes, float(softcap), int(alibi_offset), N, M, view.seg_q,
               view.seg_k, view.n_seg, view.dilation, view.offset, view.head_start)
    return B, Hq, Hq // Hk, constexprs, scalars


def _dkdv_tma(view: SeqView, q: Tensor, do: Tensor, dk: Tensor) -> bool:
    """Whether the dK/dV pass loads Q and dO through tensor descriptors: as :func:`_tma_ok`, and only for 16-bit
    gradients. With float32 gradients (the ring's partial sums) Triton 3.6 compiled a kernel whose dK differed from
    run to run on an H200 (D=64, causal, one query head a program: wrong by up to a fifth of its largest value;
    docs/kernel_notes.md, seventh session of 2026-11-29); loaded by pointer it is right. Float32 inputs (float32
    gradients too) are left out alike: unchecked there."""
    return dk.dtype in (torch.float16, torch.bfloat16) and _tma_ok(view, q, do)


def backward_dkdv(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stats: RowStats, dk: Tensor,
                  dv: Tensor, view: SeqView, band: BandArgs, scale: float, *, accumulate: bool = False, lists=None,
                  list_block: Optional[Tuple[int, int]] = None, packed: Packed = None, softcap: float = 0.0,
                  slopes: Optional[Tensor] = None, alibi_offset: int = 0, tiles: Optional[Tiles] = None) -> None:
    """Run the dK/dV kernel for one branch (adding into the gradients with ``accumulate``). ``do``, ``dk``, ``dv``,
    ``lse`` and ``stats`` (:func:`row_stats`) are contiguous; ``softcap``, ``slopes`` and ``alibi_offset`` as in
    :func:`forward`."""
    B, Hq, group, constexprs, scalars = _backward_common(q, k, lse, view, band, lists, accumulate, packed, softcap,
                                                         slopes, alibi_offset)
    t = tiles or _tiles("dkdv", q, band, list_block, view)
    list_m, list_n = list_block or (t.block_m, t.block_n)
    n_classes = min(group, view.dilation) if view.per_head_offset else 1
    kv_first = view.head_start // group
    kv_last = (view.head_start + view.n_heads - 1) // group
    n_z = (kv_last - kv_first + 1) * n_classes
    _check_grid(view, B, n_z)
    grid = (_cdiv(_cdiv(view.seg_k, view.dilation), t.block_n), B * view.n_seg, n_z)
    q_num, q_idx = (lists.q_num, lists.q_idx) if lists is not None else (None, None)
    launch(
        _bwd._flash_bwd_dkdv, grid,
        q, k, v, do, dk, dv, *stats.kernel_args(), *_strides(q, k, v), *_list_args(q_num, q_idx, lse),
        *scalars, view.n_heads, Hq, Hq // group, group, scale, band.left, band.right,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, N_CLASSES=n_classes, LIST_M=list_m, LIST_N=list_n,
        ONE_HEAD=group == 1 or (view.per_head_offset and view.dilation >= group), TMA=_dkdv_tma(view, q, do, dk),
        PAIRED=stats.paired, **constexprs, num_warps=t.num_warps, num_stages=t.num_stages,
    )


def backward_dq(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stats: RowStats, dq: Tensor, view: SeqView,
                band: BandArgs, scale: float, *, accumulate: bool = False, lists=None,
                list_block: Optional[Tuple[int, int]] = None, packed: Packed = None, softcap: float = 0.0,
                slopes: Optional[Tensor] = None, alibi_offset: int = 0, tiles: Optional[Tiles] = None) -> None:
    """Run the dQ kernel for one branch (adding into ``dq`` with ``accumulate``); ``do``, ``dq``, ``lse`` and
    ``stats`` (:func:`row_stats`) are contiguous; ``softcap``, ``slopes`` and ``alibi_offset`` as in :func:`forward`."""
    B, Hq, group, constexprs, scalars = _backward_common(q, k, lse, view, band, lists, accumulate, packed, softcap,
                                                         slopes, alibi_offset)
    t = tiles or _tiles("dq", q, band, list_block, view)
    list_m, list_n = list_block or (t.block_m, t.block_n)
    grid = (_cdiv(_cdiv(view.seg_q, view.dilation), t.block_m), B * view.n_seg, view.n_heads)
    _check_grid(view, B, view.n_heads)
    kv_num, kv_idx = (lists.kv_num, lists.kv_idx) if lists is not None else (None, None)
    launch(
        _bwd._flash_bwd_dq, grid,
        q, k, v, do, dq, *stats.kernel_args(), *_strides(q, k, v), *_list_args(kv_num, kv_idx, lse),
        *scalars, Hq, group, scale, band.left, band.right,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, LIST_M=list_m, LIST_N=list_n, TMA=_tma_ok(view, k, v),
        PAIRED=stats.paired, **constexprs, num_warps=t.num_warps, num_stages=t.num_stages,
    )
