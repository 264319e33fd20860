"""Tile sizes, warps and pipeline stages for the kernels: a small table keyed on GPU family, head dim and pass.

The Hopper entries were chosen by ``scripts/tune_kernels.py`` (since removed; in git history) on an H100 (see
docs/benchmarks.md); the Ampere entries are conservative settings that fit its 164 KB of shared memory. In the Triton interpreter (CPU tests) small
tiles keep the tests fast and make short sequences span several blocks.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch
import triton.language as tl

from longattn._dispatch import _capability, interpret_mode


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# pass -> [(head-dim bound, tiles without a causal/window band, tiles with one)]; the first bound >= head_dim applies.
# Hopper: for views longer than SHORT_ROWS, which load through tensor descriptors (TMA); picked by
# tools/tune_backward.py (whole workloads: flash 4k, dilated 128k, block-sparse 32k) on an H100 80GB HBM3, triton
# 3.6. With TMA the kernels stopped spilling registers, and the best tiles moved: dK/dV at D = 128 64x64 with 4 warps
# (causal 4k backward 1.84 ms against 2.06, dense 4k 3.39 against 3.53, block-sparse 32k 5.97 against 6.45); dQ at
# D = 64 4 warps (dilated 128k backward 16.4 ms against 17.3); banded forward 8 warps and, at D = 128, 128x128 tiles
# (causal 4k 0.715 / 0.603 ms against 0.726 / 0.613).
_HOPPER = {
    "fwd": [
        (64, Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3)),
        (128, Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 3)),
        (256, Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 2)),
    ],
    "dkdv": [
        (64, Tiles(32, 128, 4, 3), Tiles(32, 128, 4, 3)),
        (128, Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)),
        (256, Tiles(32, 64, 8, 2), Tiles(32, 64, 8, 2)),
    ],
    "dq": [
        (64, Tiles(128, 64, 4, 3), Tiles(128, 64, 4, 3)),
        (128, Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3)),
        (256, Tiles(64, 32, 8, 2), Tiles(64, 32, 8, 2)),
    ],
}
# Ampere (sm80/86/89): conservative settings within its shared memory; not tuned on hardware here.
# The block-list path (block-sparse attention, no causal band) on Hopper, where its best tiles differ from the range
# path's: its K/V loads are indirect (the block index comes from memory), which changes what pipelines well.
# From tools/tune_block_sparse.py (removed; in git history) on an H100 (N = 32k, H = 16, 10% random blocks of 128): backward D <= 128 with
# these dq tiles 6.44 ms against 6.88. (The list forward's best at D <= 64, 128x64 with 8 warps, is now the range
# path's entry too; at N = 128k the table's list settings were the fastest of the sweep.)
_HOPPER_LIST = {
    ("dq", 128): Tiles(128, 128, 8, 2),
}
# Short views (at most SHORT_ROWS rows per sequence or segment, not block lists) load without TMA (see tma_wanted);
# where their best tiles differ from the table above: (pass, head-dim bound, banded) -> tiles. With a band, few key
# blocks per program favour smaller tiles (tools/tune_backward.py on an H100, causal N = 1k, B = 16, H = 32, D = 64:
# forward 0.246 ms against 0.273, dK/dV 0.876 against 0.988, dQ 0.894 against 0.984); the other entries are the
# picks from before TMA, measured at 1k-16k without it.
SHORT_ROWS = 1024
_HOPPER_SHORT = {
    ("fwd", 64, True): Tiles(64, 64, 4, 3),
    ("fwd", 128, True): Tiles(64, 64, 4, 3),
    ("dkdv", 64, True): Tiles(32, 64, 4, 3),
    ("dkdv", 128, False): Tiles(64, 128, 8, 3),
    ("dkdv", 128, True): Tiles(32, 64, 4, 3),
    ("dq", 64, False): Tiles(128, 64, 8, 3),
    ("dq", 64, True): Tiles(64, 64, 4, 3),
}
# Views of 1025-2048 rows (LongNet's branches: a segment of w positions at rate r is w/r rows, 2048 for the standard
# (2048, 4096, 8192, 16384) x (1, 2, 4, 8)), not block lists: dK/dV at D <= 64 unbanded takes 128 query rows by 64
# keys (tools/tune_backward.py on an H100, two sweeps: dilated 128k backward 16.3 -> 15.4 ms; the same tiles were
# 2-3% slower on dense 4k and 1k, which keep the table's).
SEGMENT_ROWS = 2048
_HOPPER_SEGMENT = {
    ("dkdv", 64, False): Tiles(128, 64, 4, 2),
}
_AMPERE = {
    "fwd": [(64, Tiles(128, 64, 4, 3), Tiles(128, 64, 4, 3)), (128, Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 2)),
            (256, Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 2))],
    "dkdv": [(64, Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)), (128, Tiles(64, 64, 8, 2), Tiles(64, 64, 8, 2)),
             (256, Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1))],
    "dq": [(64, Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)), (128, Tiles(64, 64, 8, 2), Tiles(64, 64, 8, 2)),
           (256, Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1))],
}
_INTERPRETER = Tiles(16, 16, 4, 1)

_override: Optional[dict] = None


@contextlib.contextmanager
def override_tiles(**passes: Tiles) -> Iterator[None]:
    """Force tile settings per pass (``fwd=``, ``dkdv=``, ``dq=``): for tests and tuning scripts."""
    global _override
    old = _override
    _override = dict(old or {}, **passes)
    try:
        yield
    finally:
        _override = old


def tiles_for(pass_name: str, head_dim: int, device: torch.device, banded: bool = False,
              listed: bool = False, rows: Optional[int] = None) -> Tiles:
    """The tile settings of ``pass_name`` (``"fwd"``, ``"dkdv"`` or ``"dq"``) for ``head_dim`` on ``device``.

    ``banded``: the call has a causal or window band (it favours smaller key tiles). ``listed``: the call walks
    block lists (block-sparse attention). ``rows``: the longest sequence (or segment) the kernel walks, if known.
    """
    if _override and pass_name in _override:
        return _override[pass_name]
    if device.type != "cuda" or interpret_mode():
        return _INTERPRETER
    major, _ = _capability(device.index if device.index is not None else torch.cuda.current_device())
    table = _HOPPER if major >= 9 else _AMPERE
    for bound, dense, band in table[pass_name]:
        if head_dim <= bound:
            if listed and not banded and major >= 9 and (pass_name, bound) in _HOPPER_LIST:
                return _HOPPER_LIST[(pass_name, bound)]
            key = (pass_name, bound, banded)
            if not listed and rows is not None and major >= 9:
                if rows <= SHORT_ROWS and key in _HOPPER_SHORT:
                    return _HOPPER_SHORT[key]
                if SHORT_ROWS < rows <= SEGMENT_ROWS and key in _HOPPER_SEGMENT:
                    return _HOPPER_SEGMENT[key]
            return band if banded else dense
    raise ValueError(f"head_dim {head_dim} is larger than the kernels support (256)")


_tma_override: Optional[bool] = None


@contextlib.contextmanager
def override_tma(enabled: bool) -> Iterator[None]:
    """Force the TMA (tensor descriptor) loads on or off: for tests (the interpreter emulates them) and A/B timing."""
    global _tma_override
    old = _tma_override
    _tma_override = enabled
    try:
        yield
    finally:
        _tma_override = old


def tma_wanted(device: torch.device, rows: int) -> bool:
    """Whether the kernels load their streamed tiles through tensor descriptors (Hopper's TMA) on ``device``, for a
    view of ``rows`` rows per sequence or segment, alignment permitting.

    On sm90 and newer with a Triton that has device-side descriptors, for views longer than ``SHORT_ROWS``: each
    program builds its descriptors once, which did not pay off over the few blocks of a short sequence (H100, causal
    N = 1k, D = 64: forward 7% slower). ``LONGATTN_TMA=0`` turns them off, ``LONGATTN_TMA=1`` on at every length.
    """
    if _tma_override is not None:
        return _tma_override
    if device.type != "cuda" or interpret_mode() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    env = os.environ.get("LONGATTN_TMA", "")
    if env == "0":
        return False
    major, _ = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return major >= 9 and (env == "1" or rows > SHORT_ROWS)


def fit_tiles(tiles: Tiles, block_q: int, block_k: int) -> Tiles:
    """Shrink tiles so they divide a block mask's ``(block_q, block_k)`` (both powers of two)."""
    return replace(tiles, block_m=min(tiles.block_m, block_q), block_n=min(tiles.block_n, block_k))
