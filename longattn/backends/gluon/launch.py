"""Launcher of the Gluon Hopper forward, and the rule for when it runs instead of the Triton forward.

:func:`forward` has the signature of :func:`longattn.backends.triton.launch.forward` and is registered for the
``"fwd"`` pass of the ``"triton"`` backend at compute capability 9.0: it runs the Gluon kernel for the calls it
covers (:func:`why_not` is None) and hands every other call to the Triton forward unchanged.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from longattn.backends.dispatch import capability
from longattn.backends.triton import launch as triton_launch
from longattn.backends.triton.launch import BandArgs, Packed, SeqView

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GluonTiles:
    sub_m: int  # query rows per consumer warpgroup (a program has two)
    block_n: int  # keys per K/V tile
    stages: int  # K/V tiles in flight
    consumer_regs: int  # registers per thread of a consumer (the loader gets 24)
    overlap: bool = True  # softmax of one block while the tensor cores run the previous block's P V
    pingpong: bool = True  # the two consumers take turns to issue their products (with overlap)


TILES = {64: GluonTiles(64, 128, 3, 240, False, False), 128: GluonTiles(64, 128, 2, 240)}

_kernel = None  # the module with the kernel, once imported and checked
_unavailable: Optional[str] = None  # why Gluon cannot run here, once found


def enabled() -> bool:
    """``LONGATTN_GLUON=0`` turns the Gluon kernels off (read on every call)."""
    return os.environ.get("LONGATTN_GLUON", "1") != "0"


def kernel_module():
    """The Gluon kernel module, imported on first use; None (with one warning) when this Triton's Gluon lacks
    what it needs. The Gluon API moves between Triton releases, so the check is by name, not version."""
    global _kernel, _unavailable
    if _kernel is not None or _unavailable is not None:
        return _kernel
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        missing = [name for owner, names in ((gl, ("warp_specialize", "NVMMADistributedLayout", "DotOperandLayout",
                                                   "NVMMASharedLayout", "allocate_shared_memory")),
                                             (hopper, ("warpgroup_mma", "warpgroup_mma_wait", "mbarrier", "tma")),
                                             (hopper.tma, ("make_tensor_descriptor",)))
                   for name in names if not hasattr(owner, name)]
        if not (hasattr(hopper.tma, "async_load") or hasattr(hopper.tma, "async_copy_global_to_shared")):
            missing.append("tma.async_load")
        if missing:
            raise ImportError(f"triton.experimental.gluon lacks {', '.join(missing)}")
        from longattn.backends.gluon import fwd
    except Exception as e:  # any failure: the Triton kernels run instead
        _unavailable = f"{type(e).__name__}: {e}"
        warnings.warn(f"longattn: the Gluon Hopper kernels are unavailable ({_unavailable}); the Triton kernels "
                      "run instead", stacklevel=3)
        return None
    _kernel = fwd
    return _kernel


def _aligned(t: Tensor) -> bool:
    """TMA's needs: unit stride along the head dim, 16-byte aligned rows and (batch, head) bases."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.stride(1) <= 0 or t.data_ptr() % 16 or (t.stride(1) * size) % 16:
        return False
    return not any(t.shape[i] > 1 and (t.stride(i) * size) % 16 for i in (0, 2))


def why_not(q: Tensor, k: Tensor, v: Tensor, view: SeqView, *, merge: bool, lists, packed: Packed) -> Optional[str]:
    """Why the Gluon forward does not take this launch (None when it does). It covers one dense view (dense,
    causal, window, grouped-query heads) of float16/bfloat16 inputs with head dim 64 or 128 on an sm_90 GPU."""
    if not enabled():
        return "LONGATTN_GLUON=0"
    if not q.is_cuda or capability(q.device)[0] != 9:
        return "not a Hopper (sm_90) GPU"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]}"
    if merge or lists is not None or packed is not None:
        return "merged, block-list or packed launch"
    if view.n_seg != 1 or not view.covers(q.shape[2]) or view.seg_q != q.shape[1] or view.seg_k != k.shape[1]:
        return "a segmented or dilated view"
    if q.shape[0] > triton_launch.MAX_GRID_YZ or q.shape[2] > triton_launch.MAX_GRID_YZ:
        return "batch or heads beyond the grid's limit"
    if not all(_aligned(t) for t in (q, k, v)):
        return "inputs not aligned for TMA"
    if kernel_module() is None:
        return "Gluon unavailable"
    return None


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, view: SeqView, band: BandArgs, scale: float, *,
            merge: bool = False, lists=None, list_block=None, packed: Packed = None) -> None:
    """The ``"fwd"`` pass on sm_90: the Gluon kernel where :func:`why_not` allows it, else the Triton forward."""
    if why_not(q, k, v, view, merge=merge, lists=lists, packed=packed) is not None:
        triton_launch.forward(q, k, v, o, lse, view, band, scale, merge=merge, lists=lists, list_block=list_block,
                              packed=packed)
        return
    B, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    t = TILES[D]
    triton_launch._ensure_allocator()  # device-side descriptors take scratch from Triton's allocator
    grid = (-(-N // (2 * t.sub_m)), B, Hq)
    kernel_module().flash_fwd[grid](
        q, k, v, o, lse, *triton_launch._strides(q, k, v), N, M, Hq, Hq // Hk, scale, band.left, band.right,
        HEAD_D=D, SUB_M=t.sub_m, BLOCK_N=t.block_n, STAGES=t.stages, HAS_LEFT=band.has_left,
        HAS_RIGHT=band.has_right, CONSUMER_REGS=t.consumer_regs, OVERLAP=t.overlap,
        PINGPONG=t.pingpong, num_warps=4,
    )
