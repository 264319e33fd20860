"""Launcher of the Gluon Hopper forward, and the rule for when it runs instead of the Triton forward.

:func:`forward` has the signature of :func:`longattn.backends.triton.launch.forward` and is registered for the
``"fwd"`` pass of the ``"triton"`` backend at compute capability 9.0: it runs the Gluon kernel for the calls it
covers (:func:`why_not` is None) and hands every other call to the Triton forward unchanged.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from longattn.backends.device import capability, device_index
from longattn.backends.gluon.packed import query_blocks_before
from longattn.backends.gluon.tma import aligned as _aligned, box_strides as _box_strides
from longattn.call import AttentionCall
from longattn.backends.triton import launch as triton_launch
from longattn.backends.triton.launch import BandArgs, Packed, SeqView, seq_major_aligned

HEAD_DIMS = (64, 128, 256)
# Head dims the Gluon forward takes only where a query sees at least this many keys (dense calls; packed batches
# of this head dim run the Triton forward): D=64's three consumers of 64 rows beat the Triton forward and cuDNN
# from 4k keys a query (non-causal from 4k, causal from 8k) and lose on shorter spans, where a 192-row tile's fixed work
# (its first key block without overlap, two masked diagonal blocks) weighs (docs/kernel_notes.md).
MIN_KEYS = {64: 4096}
DTYPES = (torch.float16, torch.bfloat16)
# The kernel takes float8 inputs at D=128 (rows of 128 bytes: the 128-byte swizzle of its tiles), but measured
# 0.92-0.98x the Triton FP8 forward (docs/kernel_notes.md), so no float8 launch is routed to it.
FP8_KERNEL_HEAD_DIMS = (128,)
FP8_HEAD_DIMS: tuple = ()  # the float8 head dims routed to the kernel (a subset of FP8_KERNEL_HEAD_DIMS)
# Packed batches whose sequences average fewer query rows than this run the Triton forward: the persistent kernel
# spends a few microseconds of serial set-up per tile, which short sequences' tiles do not amortise (H100, 64k
# tokens: 0.65-0.97x the Triton forward at 16-256 rows a sequence, 1.06-1.20x from 512; docs/kernel_notes.md).
PACKED_MIN_MEAN_ROWS = 512
# Soft-capping or ALiBi in the Gluon forward (False: such calls run the Triton forward). Calls with both run the
# Triton forward: the Gluon kernel measured 1.02-1.10x slower there (H200, D=128, 16k), and 7-14% faster with one
# (docs/kernel_notes.md).
MODIFIED_SCORES = True


@dataclass(frozen=True)
class GluonTiles:
    sub_m: int  # query rows per consumer warpgroup
    block_n: int  # keys per K/V tile
    stages: int  # K/V tiles in flight
    consumer_regs: int  # registers per thread of a consumer (the loader keeps the rest: 24, or 32 beside three)
    consumers: int = 2  # consumer warpgroups (2, or 3 with at most 160 registers each); a tile has sub_m rows each


# D=256: 64-key K/V stages and one Q buffer (fwd.py), 197 KB of shared memory.
TILES = {64: GluonTiles(64, 128, 2, 160, 3), 128: GluonTiles(64, 128, 2, 240), 256: GluonTiles(64, 64, 2, 240)}
FP8_TILES = {128: GluonTiles(64, 128, 3, 240)}

# The fused backward (bwd_fused.py: dQ, dK and dV in one kernel; bwd_fused_wide.py at D=256) replaces both Triton
# backward passes for dense, banded, packed and block-sparse calls of these head dims, where it measured faster
# (docs/kernel_notes.md).
FUSED_BWD_HEAD_DIMS = (64, 128, 256)
FUSED_BWD_GRAD_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)
# Bands narrower than this many keys (left + right + 1) run the two Triton passes at these head dims: with a few
# query blocks per key block the fused program's fixed work does not pay (window 127: 5-6% slower, 511: even,
# 1023: 3-6% faster; docs/kernel_notes.md). Not at D=256, where the two passes measured 0.39-0.58x cuDNN against
# the fused kernel's 0.82-0.91x on every call, short ones too.
FUSED_BWD_MIN_BAND = 1024
FUSED_BWD_MIN_BAND_HEAD_DIMS = (64, 128)
# Dense calls of these head dims where a key is seen by fewer query rows on average (so a program of the fused
# kernel, which owns a key block and walks the query blocks that see it, walks few) run the two Triton passes.
# H100, bf16, batch x N = 16k, backward against cuDNN, fused / two passes (rows a key: N/2 causal, N otherwise):
# D=64 causal 0.79 / 1.12 (512), 0.82 / 1.04 (1k), 0.86 / 0.88 (2k), 0.92 / 0.88 (4k), non-causal 1k 0.83 /
# 0.88, 2k 0.90 / 0.90; D=128 non-causal 512 0.91 / 0.94, 1k 0.90 / 0.79, causal 1k 0.82 / 0.86, 2k 0.87 / 0.86
# (docs/kernel_notes.md). The thresholds sit between the measured rows. Sliding windows keep FUSED_BWD_MIN_BAND's
# rule (measured on windows), packed batches and block lists the fused kernel (not measured short).
FUSED_BWD_MIN_ROWS = {64: 1536, 128: 768}

_kernel = None  # the module with the kernel, once imported and checked
_fused_failed: dict = {}  # head dim -> why the fused backward stopped taking it (it ran out of resources there)
_fused_kernel = None
_unavailable: Optional[str] = None  # why Gluon cannot run here, once found


def enabled() -> bool:
    """``LONGATTN_GLUON=0`` turns the Gluon kernels off (read on every call)."""
    return os.environ.get("LONGATTN_GLUON", "1") != "0"


def _give_up(reason: str) -> None:
    global _kernel, _unavailable
    _kernel, _unavailable = None, reason
    warnings.warn(f"longattn: the Gluon Hopper kernels are unavailable ({reason}); the Triton kernels run instead",
                  stacklevel=4)


def kernel_module():
    """The Gluon kernel module, imported on first use; None (with one warning) when this Triton's Gluon lacks
    what it needs. The Gluon API moves between Triton releases, so the check is by name, not version."""
    global _kernel
    if _kernel is not None or _unavailable is not None:
        return _kernel
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        missing = [name for owner, names in ((gl, ("warp_specialize", "NVMMADistributedLayout", "DotOperandLayout",
                                                   "NVMMASharedLayout", "SwizzledSharedLayout", "BlockedLayout",
                                                   "allocate_shared_memory", "atomic_add")),
                                             (hopper, ("warpgroup_mma", "warpgroup_mma_wait", "mbarrier", "tma")),
                                             (hopper.tma, ("make_tensor_descriptor",)))
                   for name in names if not hasattr(owner, name)]
        if not (hasattr(hopper.tma, "async_load") or hasattr(hopper.tma, "async_copy_global_to_shared")):
            missing.append("tma.async_load")
        if missing:
            raise ImportError(f"triton.experimental.gluon lacks {', '.join(missing)}")
        from longattn.backends.gluon import fwd
    except Exception as e:  # any failure: the Triton kernels run instead
        _give_up(f"{type(e).__name__}: {e}")
        return None
    _kernel = fwd
    return fwd


def _seq_major_strides(v: Tensor) -> tuple:
    """Batch, row, head and head-dim strides of sequence-major ``v`` for the kernel (stand-ins as in
    :func:`_box_strides`)."""
    stand_in = v.stride(3) if v.shape[3] > 1 else 16
    return (v.stride(0) if v.shape[0] > 1 else stand_in, 1, v.stride(2) if v.shape[2] > 1 else stand_in, stand_in)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _on_hopper(t: Tensor) -> bool:
    return t.is_cuda and capability(t.device)[0] == 9


def _visible(i: int, n: int, m: int, left: Optional[int], right: Optional[int]) -> int:
    """How many of ``m`` keys query ``i`` of ``n`` sees: keys ``p - left .. p + right`` around its diagonal key
    ``p = i + m - n`` (bottom-right aligned; None: that side unbounded)."""
    p = i + m - n
    hi = min(m - 1, p + right) if right is not None else m - 1
    lo = max(0, p - left) if left is not None else 0
    return max(hi - lo + 1, 0)


def _keys_seen(n: int, m: int, left: Optional[int] = None, right: Optional[int] = None) -> int:
    """About how many keys the middle query of ``n`` sees among ``m`` (the band as :func:`_visible`'s)."""
    return _visible(n // 2, n, m, left, right)


@functools.lru_cache(maxsize=256)  # a training loop asks for the same shapes every step
def _rows_per_key(n: int, m: int, left: Optional[int] = None, right: Optional[int] = None) -> float:
    """About how many of ``n`` queries see a key, on average over the ``m`` keys (the band as :func:`_visible`'s):
    the keys seen by 257 evenly spaced queries, averaged, times ``n / m``."""
    if n == 0 or m == 0:
        return 0.0
    rows = [round(j * (n - 1) / 256) for j in range(257)]
    return sum(_visible(i, n, m, left, right) for i in rows) / len(rows) * n / m


def _band_sides(band: Optional[BandArgs]):
    """``(left, right)`` of the kernels' band arguments (None: unbounded)."""
    if band is None:
        return None, None
    return (band.left if band.has_left else None), (band.right if band.has_right else None)


def why_not(q: Tensor, k: Tensor, v: Tensor, view: SeqView, *, merge: bool, lists, packed: Packed,
            descale: Optional[Tensor] = None, band: Optional[BandArgs] = None) -> Optional[str]:
    """Why the Gluon forward does not take this launch (None when it does). It covers one dense view (dense,
    causal, window, grouped-query heads) on an sm_90 GPU of float16/bfloat16 inputs with a head dim in
    :data:`HEAD_DIMS`, or float8 ones (``descale`` given, values sequence-major) with a head dim in
    :data:`FP8_HEAD_DIMS`, whose tensors meet TMA's alignment, where a query sees enough keys under ``band`` at the
    head dims of :data:`MIN_KEYS`; packed batches (``packed``) of whole sequences too (not at those head dims),
    except float8 ones and those of short sequences (:data:`PACKED_MIN_MEAN_ROWS`)."""
    if not enabled():
        return "LONGATTN_GLUON=0"
    if not _on_hopper(q):
        return "not a Hopper (sm_90) GPU"
    if descale is not None:
        if q.shape[-1] not in FP8_HEAD_DIMS:
            return f"float8 head dim {q.shape[-1]}"
        if not seq_major_aligned(v):
            return "float8 values not sequence-major and aligned for TMA"
        v = k  # the remaining checks (alignment of q and k) as for the other dtypes
    elif q.dtype not in DTYPES:
        return f"dtype {q.dtype}"
    elif q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]}"
    elif q.shape[-1] in MIN_KEYS:
        if packed is not None:
            return f"a packed batch at head dim {q.shape[-1]}"
        if _keys_seen(q.shape[1], k.shape[1], *_band_sides(band)) < MIN_KEYS[q.shape[-1]]:
            return f"fewer than {MIN_KEYS[q.shape[-1]]} keys a query at head dim {q.shape[-1]}"
    if merge or lists is not None:
        return "merged or block-list launch"
    if packed is not None:
        if descale is not None:
            return "a packed batch of float8 inputs"
        if q.shape[1] < PACKED_MIN_MEAN_ROWS * (packed[0].shape[0] - 1):
            return f"packed sequences of fewer than {PACKED_MIN_MEAN_ROWS} query rows on average"
        # One view of whole sequences (a segment at least as long as the longest one is a whole sequence).
        if view.n_seg != 1 or not view.covers(q.shape[2]) or view.offset or view.per_head_offset:
            return "a segmented or dilated view"
    elif view.n_seg != 1 or not view.covers(q.shape[2]) or view.seg_q != q.shape[1] or view.seg_k != k.shape[1]:
        return "a segmented or dilated view"
    if q.shape[0] > triton_launch.MAX_GRID_YZ or q.shape[2] > triton_launch.MAX_GRID_YZ:
        return "batch or heads beyond the grid's limit"
    if not all(_aligned(t) for t in (q, k, v)):
        return "inputs not aligned for TMA"
    if kernel_module() is None:
        return "Gluon unavailable"
    return None


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, view: SeqView, band: BandArgs, scale: float, *,
            merge: bool = False, lists=None, list_block=None, packed: Packed = None,
            descale: Optional[Tensor] = None, softcap: float = 0.0, slopes: Optional[Tensor] = None,
            alibi_offset: int = 0) -> None:
    """The ``"fwd"`` pass on sm_90: the Gluon kernel where :func:`why_not` allows it, else the Triton forward
    (``descale``: float8 inputs, as there; ``softcap``, ``slopes`` (ALiBi, float32 ``(sequences, Hq)``) and
    ``alibi_offset`` as there: the Gluon kernel takes soft-capping or ALiBi, not both at once, not with float8
    inputs and not at the head dims of :data:`MIN_KEYS`, :data:`MODIFIED_SCORES`)."""
    modified = bool(softcap) or slopes is not None
    both = bool(softcap) and slopes is not None
    if (modified and (descale is not None or both or not MODIFIED_SCORES or q.shape[-1] in MIN_KEYS)) or why_not(
            q, k, v, view, merge=merge, lists=lists, packed=packed, descale=descale, band=band) is not None:
        triton_launch.forward(q, k, v, o, lse, view, band, scale, merge=merge, lists=lists, list_block=list_block,
                              packed=packed, descale=descale, softcap=softcap, slopes=slopes,
                              alibi_offset=alibi_offset)
        return
    B, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    fp8 = descale is not None
    t = FP8_TILES[D] if fp8 else TILES[D]
    v_strides = _seq_major_strides(v) if fp8 else (*_box_strides(v), 1)
    triton_launch._ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    block_m = t.consumers * t.sub_m
    if packed is None:
        n_seqs, cu_q, cu_k, cum = B, lse, lse, lse  # the sequence tables are not read
        tiles = -(-N // block_m) * B * Hq
    else:
        (cu_q, cu_k), n_seqs = packed, packed[0].shape[0] - 1
        cum = query_blocks_before(cu_q, block_m)
        tiles = (N // block_m + n_seqs) * Hq  # at least the tiles there are (their count stays on the GPU)
    grid = (max(1, min(tiles, _sm_count(device_index(q.device)))),)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)  # tiles claimed after the first one per program
    try:
        kernel_module().flash_fwd[grid](
            q, k, v, o, lse, counter, descale if fp8 else lse, cu_q, cu_k, cum, lse if slopes is None else slopes,
            *_box_strides(q), *_box_strides(k), *v_strides, N, M, B, n_seqs, Hq, Hq // Hk, scale, band.left,
            band.right, float(softcap), int(alibi_offset), HEAD_D=D, SUB_M=t.sub_m, BLOCK_N=t.block_n,
            STAGES=t.stages, HAS_LEFT=band.has_left, HAS_RIGHT=band.has_right, CONSUMER_REGS=t.consumer_regs,
            FP8=fp8, VARLEN=packed is not None, SOFTCAP=bool(softcap),
            ALIBI=triton_launch.alibi_kind(slopes, band, alibi_offset), N_CONS=t.consumers, num_warps=4,
        )
    except CompilationError as e:  # a Gluon this code does not know: say so once, then the Triton kernels
        _give_up(f"the kernel does not compile with this Triton: {str(e).splitlines()[-1][:200]}")
        triton_launch.forward(q, k, v, o, lse, view, band, scale, packed=packed, descale=descale, softcap=softcap,
                              slopes=slopes, alibi_offset=alibi_offset)


def fused_module():
    """The fused backward's module (:mod:`longattn.backends.gluon.bwd_fused`), imported on first use; None (with
    one warning, turning the Gluon kernels off) where it does not import."""
    global _fused_kernel
    if _fused_kernel is None and kernel_module() is not None:
        try:
            from longattn.backends.gluon import bwd_fused
        except Exception as e:
            _give_up(f"the fused backward does not import: {type(e).__name__}: {e}")
            return None
        _fused_kernel = bwd_fused
    return _fused_kernel if _unavailable is None else None


def why_not_fused_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, call: AttentionCall,
                           grad_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the fused Gluon backward does not take this call (None when it does): a dense call, a packed batch or
    block lists the kernel's tiles fit (:func:`longattn.backends.gluon.bwd_fused.why_not_lists`) (no branches,
    cache or float8 scales; soft-capping, ALiBi, any band of at least
    :data:`FUSED_BWD_MIN_BAND` keys) on an sm_90 GPU, float16/bfloat16 inputs of a head dim in
    :data:`FUSED_BWD_HEAD_DIMS`, gradients in the inputs' dtype or float32, TMA-aligned q, k, v and dO, and sizes
    the kernel's 32-bit offsets and grid cover; never a deterministic call (its dQ is summed by float32 reduce-
    adds in the order the programs reach them, which varies run to run, so the two Triton passes, which sum in a
    fixed order, run it)."""
    if call.deterministic:
        return "deterministic=True (the fused backward's dQ reduce-adds sum in no fixed order)"
    if not enabled():
        return "LONGATTN_GLUON=0"
    if not _on_hopper(q):
        return "not a Hopper (sm_90) GPU"
    if call.branches or call.cache is not None:
        return "not a dense, block-sparse or packed call"
    if call.descale is not None:
        return "float8 inputs"
    band = call.band
    if (q.shape[-1] in FUSED_BWD_MIN_BAND_HEAD_DIMS and band.left is not None and band.right is not None
            and band.left + band.right + 1 < FUSED_BWD_MIN_BAND):
        return f"a band narrower than {FUSED_BWD_MIN_BAND} keys"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype}"
    if grad_dtype not in FUSED_BWD_GRAD_DTYPES:
        return f"gradients in {grad_dtype}"
    if q.shape[-1] not in FUSED_BWD_HEAD_DIMS:
        return f"head dim {q.shape[-1]}"
    least = FUSED_BWD_MIN_ROWS.get(q.shape[-1], 0)
    if (call.seqlens is None and call.blocks is None and band.left is None  # (windows: FUSED_BWD_MIN_BAND)
            and _rows_per_key(q.shape[1], k.shape[1], band.left, band.right) < least):
        return f"fewer than {least} query rows a key at head dim {q.shape[-1]}"
    if q.shape[-1] in _fused_failed:
        return _fused_failed[q.shape[-1]]
    if (max(q.numel(), k.numel()) >= 2 ** 31 or k.shape[2] > triton_launch.MAX_GRID_YZ
            or q.shape[0] > triton_launch.MAX_GRID_YZ):  # (key blocks, Hk, B): the last two at most 65535
        return "sizes beyond the kernel's 32-bit offsets or grid"
    if not all(_aligned(t) for t in (q, k, v, do)):
        return "inputs not aligned for TMA"
    if fused_module() is None:
        return "Gluon unavailable"
    if call.blocks is not None:
        lists = call.blocks.lists
        if lists is None or lists.q_num is None:
            return "no block lists for a backward"
        why = fused_module().why_not_lists((lists.q_num, lists.q_idx), call.blocks.block_size, q.shape[0], q.shape[2],
                                           k.shape[2], call.seqlens is not None, q.shape[3])
        if why is not None:
            return why
    return None


def fused_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall,
                   dlse: Optional[Tensor] = None, grad_dtype: Optional[torch.dtype] = None):
    """The ``"bwd"`` pass on sm_90: ``(dq, dk, dv)`` from the fused Gluon kernel where
    :func:`why_not_fused_backward` allows it, else None (the caller runs the ``"dkdv"`` and ``"dq"`` passes)."""
    if why_not_fused_backward(q, k, v, do, call, grad_dtype) is not None:
        return None
    band = call.band
    window = (-1 if band.left is None else band.left, -1 if band.right is None else band.right)
    s = call.seqlens
    try:
        return _fused_kernel.fused_backward(
            do, q, k, v, o, lse, call.scale, False, dlse=dlse, grad_dtype=grad_dtype, window=window,
            softcap=float(call.softcap), slopes=None if call.alibi is None else call.alibi.float().contiguous(),
            alibi_offset=int(call.alibi_offset), cu_seqlens=None if s is None else (s.cu_q, s.cu_k),
            lists=None if call.blocks is None else (call.blocks.lists.q_num, call.blocks.lists.q_idx),
            list_block=None if call.blocks is None else call.blocks.block_size)
    except CompilationError as e:
        _give_up(f"the fused backward does not compile with this Triton: {str(e).splitlines()[-1][:200]}")
        return None
    except OutOfResources as e:  # this GPU has less shared memory or registers than the kernel's tiles need
        why = f"the fused backward ran out of resources at head dim {q.shape[-1]}: {str(e)[:200]}"
        _fused_failed[q.shape[-1]] = why
        warnings.warn(f"longattn: {why}; the two Triton backward passes run instead", stacklevel=4)
        return None
