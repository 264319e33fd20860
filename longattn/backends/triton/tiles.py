"""Tile sizes, warps and pipeline stages of the Triton passes: one table, as data.

:data:`TABLE` maps ``(arch, pass, head-dim bound, path, rows)`` to :class:`Tiles`; the first head-dim bound at or
above the head dim applies. ``arch`` is ``"sm90"`` (Hopper and newer) or ``"sm80"`` (Ampere, Ada); ``path`` is
``"dense"``, ``"banded"`` (a causal or window band), ``"list"`` or ``"list+band"`` (block lists, without or with a
causal band); ``rows`` is ``"short"`` (views of at most :data:`SHORT_ROWS` rows per sequence or segment),
``"segment"`` (up to :data:`SEGMENT_ROWS`) or ``"long"``, and block-list calls are keyed by path alone. ``"*"``
matches any path or rows: :func:`tiles_for` looks up the exact key, then ``rows="*"``, then ``path="*", rows="*"``.
Why each entry is what it is: ``docs/kernel_notes.md``. In the Triton interpreter (CPU tests) small tiles keep the
tests fast and make short sequences span several blocks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Dict, Iterator, Optional, Tuple

import torch
import triton.language as tl

from longattn._validation import MAX_HEAD_DIM
from longattn.backends.device import Device, capability, env, facts as device_facts, interpret_mode
from longattn.backends.routing import current, routing


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


SHORT_ROWS = 1024  # views up to this many rows load without TMA (see tma_wanted) and have their own entries
SEGMENT_ROWS = 2048  # LongNet's branches: a segment of w positions at rate r is w / r rows, 2048 for the standard set
HEAD_DIM_BOUNDS = (64, 128, MAX_HEAD_DIM)

T = Tiles
TABLE: Dict[Tuple[str, str, int, str, str], Tiles] = {
    ("sm90", "fwd", 64, "*", "*"): T(128, 64, 8, 3),
    ("sm90", "fwd", 64, "banded", "short"): T(64, 64, 4, 3),
    ("sm90", "fwd", 128, "*", "*"): T(128, 128, 8, 3),
    ("sm90", "fwd", 128, "banded", "short"): T(64, 64, 4, 3),
    ("sm90", "fwd", 256, "*", "*"): T(128, 64, 8, 2),
    ("sm90", "fwd_fp8", 256, "*", "*"): T(64, 64, 4, 3),  # float8 inputs; other fwd_fp8 keys fall back to fwd's
    ("sm90", "dkdv", 64, "*", "*"): T(32, 128, 4, 3),
    ("sm90", "dkdv", 64, "banded", "short"): T(32, 64, 4, 3),
    ("sm90", "dkdv", 64, "dense", "segment"): T(128, 64, 4, 2),
    ("sm90", "dkdv", 128, "*", "*"): T(64, 64, 4, 2),
    ("sm90", "dkdv", 128, "dense", "short"): T(64, 128, 8, 3),
    ("sm90", "dkdv", 128, "banded", "short"): T(32, 64, 4, 3),
    ("sm90", "dkdv", 256, "*", "*"): T(32, 64, 8, 2),
    ("sm90", "dq", 64, "*", "*"): T(128, 64, 4, 3),
    ("sm90", "dq", 64, "dense", "short"): T(128, 64, 8, 3),
    ("sm90", "dq", 64, "banded", "short"): T(64, 64, 4, 3),
    ("sm90", "dq", 128, "*", "*"): T(128, 64, 8, 3),
    ("sm90", "dq", 128, "list", "*"): T(128, 128, 8, 2),
    ("sm90", "dq", 256, "*", "*"): T(64, 32, 8, 2),
    ("sm80", "fwd", 64, "*", "*"): T(128, 64, 4, 3),
    ("sm80", "fwd", 128, "*", "*"): T(128, 64, 8, 2),
    ("sm80", "fwd", 256, "*", "*"): T(64, 32, 4, 2),
    ("sm80", "dkdv", 64, "*", "*"): T(64, 64, 4, 2),
    ("sm80", "dkdv", 128, "*", "*"): T(64, 64, 8, 2),
    ("sm80", "dkdv", 256, "*", "*"): T(32, 32, 4, 1),
    ("sm80", "dq", 64, "*", "*"): T(64, 64, 4, 2),
    ("sm80", "dq", 128, "*", "*"): T(64, 64, 8, 2),
    ("sm80", "dq", 256, "*", "*"): T(32, 32, 4, 1),
}
INTERPRETER = T(16, 16, 4, 1)
del T

@contextlib.contextmanager
def override_tiles(**passes: Tiles) -> Iterator[None]:
    """Force tile settings per pass (``fwd=``, ``dkdv=``, ``dq=``): for tests and tuning tools (the routing's
    ``tiles``, :func:`longattn.backends.routing.routing`)."""
    with routing(tiles={**dict(current().tiles), **passes}):
        yield


def arch_of(device: torch.device) -> str:
    major, _ = capability(device)
    return "sm90" if major >= 9 else "sm80"


def path_of(banded: bool, listed: bool) -> str:
    if listed:
        return "list+band" if banded else "list"
    return "banded" if banded else "dense"


def rows_of(rows: Optional[int], listed: bool) -> str:
    """The rows key: block-list calls are keyed by path alone; an unknown length counts as long."""
    if listed:
        return "*"
    if rows is None or rows > SEGMENT_ROWS:
        return "long"
    return "short" if rows <= SHORT_ROWS else "segment"


def tiles_for(pass_name: str, head_dim: int, device: torch.device, banded: bool = False,
              listed: bool = False, rows: Optional[int] = None, facts: Optional[Device] = None) -> Tiles:
    """The tiles of ``pass_name`` (``"fwd"``, ``"dkdv"`` or ``"dq"``; ``"fwd_fp8"``, the forward of float8 inputs,
    takes ``"fwd"``'s where it has no entry of its own) for ``head_dim`` on ``device``.

    ``banded``: the call has a causal or window band. ``listed``: it walks block lists. ``rows``: the longest
    sequence (or segment) the kernel walks, if known. ``facts``: the device facts to choose for (default: the
    routing's made-up ones, else ``device``'s). The routing's ``tiles`` come first.
    """
    routed = current()
    forced = routed.get(routed.tiles, pass_name)
    if forced is not None:
        return forced
    facts = facts or routed.device or device_facts(device)
    if not facts.cuda or facts.interpret:
        return INTERPRETER
    bound = next((b for b in HEAD_DIM_BOUNDS if head_dim <= b), None)
    if bound is None:
        raise ValueError(f"head_dim {head_dim} is larger than the kernels support ({MAX_HEAD_DIM})")
    arch, path, rows_key = facts.arch, path_of(banded, listed), rows_of(rows, listed)
    for name in ((pass_name, "fwd") if pass_name == "fwd_fp8" else (pass_name,)):
        for key in ((arch, name, bound, path, rows_key), (arch, name, bound, path, "*"),
                    (arch, name, bound, "*", "*")):
            if key in TABLE:
                return TABLE[key]
    raise KeyError(f"no tile entry for {(arch, pass_name, bound)}")  # pragma: no cover - the table is complete


@contextlib.contextmanager
def override_tma(enabled: bool) -> Iterator[None]:
    """Force the TMA (tensor descriptor) loads on or off: for tests (the interpreter emulates them) and A/B timing
    (the routing's ``tma``, :func:`longattn.backends.routing.routing`)."""
    with routing(tma=enabled):
        yield


def tma_wanted(device: torch.device, rows: int) -> bool:
    """Whether the kernels load their streamed tiles through tensor descriptors (Hopper's TMA) on ``device``, for a
    view of ``rows`` rows per sequence or segment, alignment permitting: on sm90 and newer with a Triton that has
    device-side descriptors, for views longer than :data:`SHORT_ROWS`. ``LONGATTN_TMA=0`` turns them off,
    ``LONGATTN_TMA=1`` on at every length."""
    forced = current().tma
    if forced is not None:
        return forced
    if device.type != "cuda" or interpret_mode() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    forced_env = env("LONGATTN_TMA", "")
    if forced_env == "0":
        return False
    major, _ = capability(device)
    return major >= 9 and (forced_env == "1" or rows > SHORT_ROWS)


def fit_tiles(tiles: Tiles, block_q: int, block_k: int) -> Tiles:
    """Shrink tiles so they divide a block mask's ``(block_q, block_k)`` (both powers of two)."""
    return replace(tiles, block_m=min(tiles.block_m, block_q), block_n=min(tiles.block_n, block_k))
