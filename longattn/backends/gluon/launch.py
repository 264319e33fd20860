"""Launchers of the Gluon Hopper kernels: the sm90 forward (:func:`forward`), the fused backward
(:func:`fused_backward`) and the 128 x 128 backward of dense calls at D=64 (:func:`wide_backward`), and what the
kernels take (head dims, dtypes, tiles).

Which calls they run is decided before, by the planner (:mod:`longattn.backends.triton.planner`, from the routing
settings of :mod:`longattn.backends.routing`); a launcher runs what it is given. Where a kernel fails at run time
(a Gluon it does not compile with, a GPU without the resources its tiles need) the launcher records why and raises
:class:`Unavailable`: the planner then rejects that kernel, and the caller runs the call's new plan.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import NoReturn, Optional, Tuple

import torch
from torch import Tensor
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from longattn.backends.device import device_index
from longattn.backends.gluon.packed import query_blocks_before
from longattn.backends.gluon.shapes import (DETERMINISTIC_BWD_HEAD_DIMS, DTYPES, FUSED_BWD_TILES,  # noqa: F401
                                            FUSED_BWD_GRAD_DTYPES, FUSED_BWD_HEAD_DIMS, WIDE_BWD_BLOCK_M,
                                            WIDE_BWD_HEAD_DIMS)
from longattn.backends.gluon.tma import aligned as _aligned, box_strides as _box_strides
from longattn.backends.gluon.workspace import make_workspace
from longattn.backends.kernel_args import alibi_kind, ensure_allocator
from longattn.backends.cached_launch import launch
from longattn.call import AttentionCall, Band



@dataclass(frozen=True)
class GluonTiles:
    sub_m: int  # query rows per consumer warpgroup
    block_n: int  # keys per K/V tile
    stages: int  # K/V tiles in flight
    consumer_regs: int  # registers per thread of a consumer (the loader keeps the rest: 24, or 32 beside three)
    consumers: int = 2  # consumer warpgroups (2, or 3 with at most 160 registers each); a tile has sub_m rows each
    fast_tanh: bool = True  # soft-capping by tanh.approx (fwd._tanh); False: an exponential and a division
    row_parts: bool = True  # row sums kept as per-thread shares, added once a tile (fwd._row_parts)
    loader_warps: int = 4  # the loader's warps: 4, or 1 beside two consumers (the first then the default partition)
    fold_mask: bool = False  # masked key blocks scaled and shifted by one FMA a score, as unmasked ones (fwd._softmax)
    # Each key block waits for the previous block's P V before issuing its Q K^T (fwd._step), so that P's registers
    # are free before the scores take theirs: 256-key float8 blocks at D=128 then fit 240 registers without spills.
    pv_wait_before_qk: bool = False
    # Float8 only: one exponential in fma_exp2 of the unmasked key blocks by a polynomial on the FMA pipes, the rest on
    # the special-function unit (fwd._exp2_fma); 0: all on that unit. The float8 softmax is bound by that unit (16
    # exponentials a clock and SM against 8192 float8 FLOP: 512 a score at D=128, 256 at D=64).
    fma_exp2: int = 0
    # Packed batches only (fwd.flash_fwd's PACKED_SCHED): 0 persistent, each tile set up (claim, bisection, V
    # descriptor) after the previous one's K/V loads; 1 persistent, V through one ragged descriptor and the next tile
    # claimed and found once this one's first key block is loading; 2 one program per tile (FlashAttention's varlen
    # grid), V as in 1. D=128 takes 1 (docs/kernel_notes.md: 1.04-1.26x 0 on an H200); D=256 was not timed with it.
    packed_schedule: int = 0
    # Dense 16-bit calls with the output in q's dtype only (fwd.flash_fwd's O_TMA; the others keep the plain stores):
    # each consumer writes its output rows into its part of the tile's Q buffer and stores them by one TMA store
    # (FlashAttention-4's sm90 epilogue) instead of narrow stores from the wgmma accumulator's layout. Routed at
    # D=64 and 128 (docs/kernel_notes.md has its A/B); D=256, with one Q buffer, was not timed with it.
    tma_store: bool = False

    def __post_init__(self):
        for name in ("fold_mask", "pv_wait_before_qk", "tma_store"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GluonTiles: {name} must be a bool, got {getattr(self, name)!r}")
        if type(self.fma_exp2) is not int or self.fma_exp2 not in (0, 2, 4, 8, 16):
            raise ValueError(f"GluonTiles: fma_exp2 must be 0, 2, 4, 8 or 16, got {self.fma_exp2!r}")
        if type(self.packed_schedule) is not int or self.packed_schedule not in (0, 1, 2):
            raise ValueError(f"GluonTiles: packed_schedule must be 0, 1 or 2, got {self.packed_schedule!r}")
        if self.loader_warps not in (1, 4) or (self.loader_warps == 1 and self.consumers != 2):
            raise ValueError(f"GluonTiles: loader_warps must be 4, or 1 with two consumers, got {self.loader_warps} "
                             f"with {self.consumers}")


# D=256: 64-key K/V stages and one Q buffer (fwd.py), 197 KB of shared memory.
TILES = {64: GluonTiles(64, 128, 2, 160, 3, fold_mask=True, tma_store=True),
         128: GluonTiles(64, 128, 2, 240, loader_warps=1, fold_mask=True, packed_schedule=1, tma_store=True),
         256: GluonTiles(64, 64, 2, 240)}
# 16-bit calls with a band (causal or a window) over one sequence whose middle query sees fewer than ``max_keys``
# keys: head dim -> (max_keys, tiles). D=64: two consumers of 64 rows (128-row tiles) instead of three, whose 192-row
# tiles do more masked work on the band's edge than such short spans amortise: causal 1.25x at 2k, 1.04x at 4k, but
# 0.94x at 8k (H200, same process; the routing's min_keys sends D=64 calls with fewer than 1024 keys a query to the
# Triton forward, as fast at 1k causal).
SHORT_BAND_TILES = {64: (4096, GluonTiles(64, 128, 2, 240, fold_mask=True, tma_store=True))}


def band_tiles(head_dim: int, band_keys: int = 0) -> GluonTiles:
    """The 16-bit forward's tiles at ``head_dim``: :data:`SHORT_BAND_TILES` for a call with a band over one
    sequence whose middle query sees ``band_keys`` keys (0: no such call), fewer than its ``max_keys``; else
    :data:`TILES`."""
    short = SHORT_BAND_TILES.get(head_dim)
    if short is not None and 0 < band_keys < short[0]:
        return short[1]
    return TILES[head_dim]


# Float8: the tiles' buffers take the swizzle of their rows' bytes (fwd.box_layout); D=256 with 128-key stages and
# two Q buffers (197 KB of shared memory): a key block's rescale of O (128 FMUL a thread at D=256) and its other
# fixed costs cover twice the keys of 64-key stages (515 instructions a 128-key block against 2 x 367), and each
# consumer's products are twice as long beside the other's softmax. D=64 with one exponential in 8 on the FMA pipes
# (1.04-1.06x causal, H200, same process). The candidates: docs/kernel_notes.md.
FP8_TILES = {64: GluonTiles(64, 128, 2, 240, loader_warps=1, fma_exp2=8),
             128: GluonTiles(64, 128, 2, 240, loader_warps=1), 256: GluonTiles(64, 128, 2, 240)}
# Float8 calls whose band masks no key (neither causal nor a window) over one sequence: 256-key stages (160 KB at
# D=128), which fit the consumers' registers only with the previous P V waited for before Q K^T
# (pv_wait_before_qk; without it 684 bytes spill inside the key-block loop) and with the four-warp loader (with one
# warp, Triton 3.9 reloads spilled values in the masked loops): 379-386 instructions per 128 keys against 440-444 at
# D=128. H200, same process: 1.03-1.06x at D=128, 1.07-1.08x at D=64; causal calls lost 12-16% at 4k (the diagonal's
# masked keys double), so banded and packed calls keep FP8_TILES (fp8_tiles). D=64: three consumers of 64 rows on
# 128-key blocks instead (FlashAttention-3's 192-row float8 tiles; 1.11-1.15x the 256-key blocks, same process).
FP8_UNMASKED_TILES = {64: GluonTiles(64, 128, 2, 160, 3),
                      128: GluonTiles(64, 256, 2, 240, pv_wait_before_qk=True)}


# Float8 causal calls over one sequence of at least ``min_rows`` rows a program walks (a right edge, no left one, not
# packed): D=64 on three consumers with one exponential in 8 on the FMA pipes, 1.06x FP8_TILES' at 8k, 1.07x at 12k,
# 1.14x at 16k (H200, same process), but 0.87x at 4k, where the 192-row tiles' diagonal costs more than they gain
# (the bf16 tiles' crossover lies between 4k and 8k rows too). head dim -> (min_rows, tiles).
FP8_LONG_CAUSAL_TILES = {64: (8192, GluonTiles(64, 128, 2, 160, 3, fma_exp2=8))}


def fp8_tiles(head_dim: int, masked: bool, causal_rows: int = 0) -> GluonTiles:
    """The float8 forward's tiles at ``head_dim``: :data:`FP8_UNMASKED_TILES` where the call's band masks no key of
    a single sequence (``masked`` False); :data:`FP8_LONG_CAUSAL_TILES` for a causal band over one sequence of
    ``causal_rows`` rows a program walks (0: not such a call) from its ``min_rows``; else :data:`FP8_TILES`."""
    if not masked and head_dim in FP8_UNMASKED_TILES:
        return FP8_UNMASKED_TILES[head_dim]
    long_causal = FP8_LONG_CAUSAL_TILES.get(head_dim)
    if masked and long_causal is not None and causal_rows >= long_causal[0]:
        return long_causal[1]
    return FP8_TILES[head_dim]


# The head dims the forward takes: those it has tiles for (one list each; the planner and the tests read these).
HEAD_DIMS = tuple(sorted(TILES))
# The kernel takes float8 inputs at these head dims; the routing's fp8_head_dims says which of them are routed to it.
FP8_KERNEL_HEAD_DIMS = tuple(sorted(FP8_TILES))
# The kernel's float8 path the launcher runs (fwd.py's FP8 == 2): V sequence-major with the keys of each group of 16
# permuted (the Triton backend's fp8_layout.seq_major(v, permuted=True)), so that P reaches the P V product without
# an exchange between lanes.
FP8_MODE = 2

# The fused backward takes dense, banded, packed and block-sparse calls of FUSED_BWD_HEAD_DIMS (its tiles in
# shapes.py; the routing's fused_bwd_* settings say where it measured faster).
_kernel = None  # the module with the kernel, once imported and checked
_fused_failed: dict = {}  # head dim -> why the fused backward stopped taking it (it ran out of resources there)
_fused_kernel = None
_wide_failed: dict = {}  # head dim -> why the 128 x 128 backward stopped taking it (it ran out of resources there)
_fp8_failed: dict = {}  # head dim -> why the forward's float8 path stopped taking it (it did not compile there)
_host_failed: dict = {}  # "fused" / "wide" -> why that backward's host-descriptor form stopped being planned
_unavailable: Optional[str] = None  # why Gluon cannot run here, once found


def _give_up(reason: str) -> None:
    global _kernel, _unavailable
    _kernel, _unavailable = None, reason
    warnings.warn(f"longattn: the Gluon Hopper kernels are unavailable ({reason}); the Triton kernels run instead",
                  stacklevel=4)


def _fp8_give_up(head_dim: int, why: str) -> str:
    """Record (and say once) that the forward's float8 path does not compile at ``head_dim``: the planner then sends
    float8 calls of that head dim to the Triton forward, the other calls still to this kernel. Returns the recorded
    reason."""
    _fp8_failed[head_dim] = f"the float8 path of the Gluon forward at head dim {head_dim}: {why}"
    warnings.warn(f"longattn: {_fp8_failed[head_dim]}; float8 calls of that head dim run the Triton forward",
                  stacklevel=4)
    return _fp8_failed[head_dim]


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


# The ragged V descriptor of packed schedules 1 and 2 (fwd._ragged_desc) reads a sequence as the last rows below its
# row bound (fwd.RAGGED_ROWS, 2**30), from an outer coordinate (the sequence's end) bounded at 0x7FFF0000, with an
# outer stride of 2**34 elements less the row stride: it reaches sequences of at most 2**30 keys ending below that
# bound, rows less than 2**34 elements apart. Packed K/V of more rows (over 256 GiB at D=128 unless rows overlap) or
# rows further apart run schedule 0, whose descriptor per tile is bounded by the sequence alone.
_RAGGED_ROWS = 1 << 30
_RAGGED_ROW_STRIDE = 1 << 34


def _ragged_reaches(v: Tensor) -> bool:
    """Whether the ragged descriptor of packed schedules 1 and 2 reads every sequence of the packed ``v``
    ``(1, total, Hk, D)`` (see :data:`_RAGGED_ROWS`)."""
    return v.shape[1] <= _RAGGED_ROWS and _box_strides(v)[1] < _RAGGED_ROW_STRIDE


# Masked key blocks fold the scale into the FMA that shifts each score (GluonTiles.fold_mask) only from this scale
# on: ``scale * log2 e`` is then a normal float32 with a margin, never flushed to 0, so that a masked score (-inf)
# times it stays -inf, never NaN.
_FOLD_MIN_SCALE = 2.0 ** -125


def query_block_table(packed, tiles: GluonTiles) -> Tensor:
    """The table :func:`forward` reads for a packed batch ``packed = (cu_q, cu_k)`` with ``tiles``: int32
    ``(sequences + 1,)``, the query blocks of the sequences before each (computed on the GPU, no host sync)."""
    return query_blocks_before(packed[0], tiles.consumers * tiles.sub_m)


class Unavailable(RuntimeError):
    """A Gluon kernel failed at run time (it does not compile with this Triton, or this GPU lacks the resources its
    tiles need); the reason is recorded, so that the planner rejects the kernel from now on."""


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, view, band, scale: float, *,
            packed=None, descale: Optional[Tensor] = None, softcap: float = 0.0, slopes: Optional[Tensor] = None,
            alibi_offset: int = 0, tiles: GluonTiles, counter: Optional[Tensor] = None,
            query_blocks: Optional[Tensor] = None) -> None:
    """The Gluon sm90 forward for one launch the planner gave it (one dense view, or a packed batch of whole
    sequences) with ``tiles``; the arguments as :func:`longattn.backends.triton.launch.forward`'s, but with
    ``descale`` (float8 inputs, one dense view) ``v`` is ``(B, M', Hk, D)``, sequence-major with the keys of each
    group of 16 permuted and ``M'`` the keys rounded up to 16, the padding zero (:data:`FP8_MODE`). Raises
    :class:`Unavailable` (Gluon then off) where the kernel does not compile. ``counter``: a zeroed int32 ``(1,)``
    tensor for the persistent programs' tile count (one is made where none is given); ``query_blocks``: a packed
    batch's :func:`query_block_table` for these tiles (made where none is given)."""
    B, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    fp8 = descale is not None
    t = tiles
    v_strides = _seq_major_strides(v) if fp8 else (*_box_strides(v), 1)
    ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    block_m = t.consumers * t.sub_m
    schedule = 0
    if packed is None:
        n_seqs, cu_q, cu_k, cum = B, lse, lse, lse  # the sequence tables are not read
        n_tiles = -(-N // block_m) * B * Hq
    else:
        (cu_q, cu_k), n_seqs = packed, packed[0].shape[0] - 1
        cum = query_blocks if query_blocks is not None else query_blocks_before(cu_q, block_m)
        n_tiles = (N // block_m + n_seqs) * Hq  # at least the tiles there are (their count stays on the GPU)
        schedule = 0 if fp8 or not _ragged_reaches(v) else t.packed_schedule
    # Persistent: one program per SM at most; packed_schedule 2: one per tile (those past the last return at once).
    grid = (max(1, n_tiles if schedule == 2 else min(n_tiles, _sm_count(device_index(q.device)))),)
    if counter is None:  # tiles claimed after the first one per program
        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    try:
        launch(
            kernel_module().flash_fwd, grid,
            q, k, v, o, lse, counter, descale if fp8 else lse, cu_q, cu_k, cum, lse if slopes is None else slopes,
            *_box_strides(q), *_box_strides(k), *v_strides, N, M, B, n_seqs, Hq, Hq // Hk, scale, band.left,
            band.right, float(softcap), int(alibi_offset), HEAD_D=D, SUB_M=t.sub_m, BLOCK_N=t.block_n,
            STAGES=t.stages, HAS_LEFT=band.has_left, HAS_RIGHT=band.has_right, CONSUMER_REGS=t.consumer_regs,
            FP8=FP8_MODE if fp8 else 0, VARLEN=packed is not None, SOFTCAP=(2 if t.fast_tanh else 1) if softcap else 0,
            ALIBI=alibi_kind(slopes, band, alibi_offset), N_CONS=t.consumers, ROW_PARTS=t.row_parts,
            LOADER_WARPS=t.loader_warps, FOLD_MASK=t.fold_mask and scale >= _FOLD_MIN_SCALE,
            PV_WAIT=t.pv_wait_before_qk, EXP2_FMA=t.fma_exp2 if fp8 else 0, PACKED_SCHED=schedule,
            O_TMA=t.tma_store and packed is None and not fp8 and o.dtype == q.dtype and _aligned(o), num_warps=4,
        )
    except CompilationError as e:  # a Gluon this code does not know: say so once, then the Triton kernels
        why = f"the kernel does not compile with this Triton: {str(e).splitlines()[-1][:200]}"
        if fp8:  # (its float8 path alone uses some of Gluon's features: the other calls keep the kernel)
            raise Unavailable(_fp8_give_up(D, why)) from e
        _give_up(why)
        raise Unavailable(_unavailable) from e


def _host_form_failed(kernel: str, name: str, e: Exception) -> NoReturn:
    """Record that ``kernel``'s form with host-made TMA descriptors did not compile or fit this GPU
    (:data:`_host_failed`: the planner no longer names the option, and the call's new plan runs the form with
    device-made ones) and raise :class:`Unavailable`."""
    what = "does not fit this GPU" if isinstance(e, OutOfResources) else "does not compile"
    why = f"{name} with host-made descriptors {what}: {type(e).__name__}: {(str(e).splitlines() or [''])[-1][:200]}"
    _host_failed[kernel] = why
    warnings.warn(f"longattn: {why}; its descriptors are made on the device instead", stacklevel=5)
    raise Unavailable(why) from e


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


def fused_workspace(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, grad_dtype: Optional[torch.dtype] = None):
    """Fresh buffers for :func:`fused_backward` of a call, and a packed batch's tables
    (:class:`~longattn.backends.gluon.workspace.Workspace`)."""
    s = call.seqlens
    band = Band.of(False, _fused_window(call)).for_kernels()  # (the band as the fused backward takes it)
    return make_workspace(q, k, v, grad_dtype or q.dtype, call.deterministic,
                          None if s is None else (s.cu_q, s.cu_k), band.left, band.right)


def _fused_window(call: AttentionCall) -> Tuple[int, int]:
    """The call's band as the fused backward's ``window`` argument (-1: unbounded; causal is its right side 0)."""
    band = call.band
    return -1 if band.left is None else band.left, -1 if band.right is None else band.right


def fused_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall,
                   dlse: Optional[Tensor] = None, grad_dtype: Optional[torch.dtype] = None, workspace=None,
                   slopes: Optional[Tensor] = None, host_descriptors: bool = False):
    """``(dq, dk, dv)`` of a call the planner gave the fused Gluon backward (``workspace``: the buffers its
    launches write, :func:`fused_workspace`'s, or None: made there; ``slopes``: the call's ALiBi slopes as float32
    contiguous ``(B, Hq)``, or None: made there; ``host_descriptors``: the plan's option, TMA descriptors made on
    the host). Raises :class:`Unavailable` where the kernel does not compile (Gluon then off; its host-descriptor
    form alone where that was asked for, :func:`_host_form_failed`) or runs out of resources (the head dim then no
    longer routed to it, :data:`_fused_failed`)."""
    window = _fused_window(call)
    s = call.seqlens
    try:
        return (_fused_kernel or fused_module()).fused_backward(
            do, q, k, v, o, lse, call.scale, False, dlse=dlse, grad_dtype=grad_dtype, window=window,
            softcap=float(call.softcap),
            slopes=None if call.alibi is None else slopes if slopes is not None else call.alibi.float().contiguous(),
            alibi_offset=int(call.alibi_offset), cu_seqlens=None if s is None else (s.cu_q, s.cu_k),
            lists=None if call.blocks is None else (call.blocks.lists.q_num, call.blocks.lists.q_idx),
            list_block=None if call.blocks is None else call.blocks.block_size, deterministic=call.deterministic,
            workspace=workspace, host_descriptors=host_descriptors)
    except (CompilationError, PTXASError) as e:
        if host_descriptors:
            _host_form_failed("fused", "the fused backward", e)
        _give_up(f"the fused backward does not compile with this Triton: {str(e).splitlines()[-1][:200]}")
        raise Unavailable(_unavailable) from e
    except OutOfResources as e:  # this GPU has less shared memory or registers than the kernel's tiles need
        if host_descriptors:  # (its device form may still fit)
            _host_form_failed("fused", "the fused backward", e)
        why = f"the fused backward ran out of resources at head dim {q.shape[-1]}: {str(e)[:200]}"
        _fused_failed[q.shape[-1]] = why
        warnings.warn(f"longattn: {why}; the two Triton backward passes run instead", stacklevel=4)
        raise Unavailable(why) from e


def wide_workspace(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, grad_dtype: Optional[torch.dtype] = None):
    """Fresh buffers for :func:`wide_backward` of a call (:class:`~longattn.backends.gluon.workspace.Workspace`:
    dK, dV, the row statistics in the 128 x 128 backward's blocks, dQ's float32 sum); ``call`` is not read (the
    signature is :func:`fused_workspace`'s)."""
    return make_workspace(q, k, v, grad_dtype or q.dtype, False, block_m=WIDE_BWD_BLOCK_M)


def wide_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall,
                  grad_dtype: Optional[torch.dtype] = None, workspace=None, host_descriptors: bool = False):
    """``(dq, dk, dv)``, contiguous in the inputs' dtype, of a dense call (no band but causal's) the planner gave
    the 128 x 128 backward (:mod:`longattn.backends.gluon.bwd_wide_tile`; ``workspace``: the buffers its launches
    write, :func:`wide_workspace`'s, or None: made there; ``host_descriptors``: the plan's option). Where the
    kernel does not import, compile or fit this GPU, the reason is recorded (:data:`_wide_failed`: the head dim is
    no longer routed to it, the fused backward takes its calls; where only its host-descriptor form fails to
    compile, that form is no longer planned, :func:`_host_form_failed`) and :class:`Unavailable` raised."""
    d = q.shape[-1]
    try:
        from longattn.backends.gluon import bwd_wide_tile
        if workspace is not None:
            dq = torch.empty(q.shape, dtype=grad_dtype or q.dtype, device=q.device)
            return bwd_wide_tile.backward(q, k, v, o, do, lse, dq, workspace.dk, workspace.dv, call.scale,
                                          call.band.right == 0, stats=workspace.stats, dq32=workspace.dq,
                                          host_descriptors=host_descriptors)
        dq, dk, dv = (torch.empty(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v))
        return bwd_wide_tile.backward(q, k, v, o, do, lse, dq, dk, dv, call.scale, call.band.right == 0,
                                      host_descriptors=host_descriptors)
    except (ImportError, CompilationError, OutOfResources, PTXASError) as e:
        if host_descriptors and not isinstance(e, ImportError):  # (its device form may still compile and fit)
            _host_form_failed("wide", "the 128 x 128 backward", e)
        why = f"the 128 x 128 backward failed at head dim {d}: {type(e).__name__}: {str(e).splitlines()[-1][:200]}"
        _wide_failed[d] = why
        warnings.warn(f"longattn: {why}; the fused backward runs instead", stacklevel=4)
        raise Unavailable(why) from e
