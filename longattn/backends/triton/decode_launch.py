"""Launchers of the decode kernels (:mod:`longattn.backends.triton.decode_kernels`): cache append, split-KV attention
and the log-sum-exp merge of the splits. Every size depends on shapes only (never on the values of ``cache_seqlens``),
so a decode step can be captured in a CUDA graph."""
from __future__ import annotations

import contextlib
import math
from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch
import triton.language as tl
from torch import Tensor

from longattn.backends import routing
from longattn.backends.device import facts as device_facts
from longattn.backends.plan import Kept
from longattn.backends.triton import decode_kernels as _decode
from longattn.backends.triton import support
from longattn.backends.cached_launch import CachedLaunch
from longattn.backends.kernel_args import ensure_allocator
from longattn.backends.triton.launch import BandArgs, block_d, on_device
from longattn.call import AttentionCall, Band, Branch

BLOCK_N = 64
MAX_SPLITS = 256


class DecodeTiles(NamedTuple):
    """How the split kernel runs a kind of cache: its tiles (``BLOCK_N`` keys per K and V tile, ``num_warps``,
    ``num_stages``) and the split rule (:func:`choose_splits`): ``waves`` programs per SM the splits aim at, and at
    least ``min_blocks`` key blocks per split; or, where ``program_blocks`` is set (programs that take a whole SM),
    the split count of the earliest predicted end, a program costing its key blocks plus ``program_blocks`` and the
    merge ``merge_blocks``; or, where ``load`` is set (narrow programs, several an SM), the fewest splits that give
    ``load`` programs an SM.

    ``tma``: contiguous caches' K and V tiles by tensor descriptors (Hopper's TMA: one copy a tile, no per-row
    addresses or ``cp.async`` in the loop) where the caches' alignment allows, else by pointer; paged caches always by
    pointer. ``tools/tune_decode.py --set FIELD=VALUE`` A/Bs a field in every row."""

    block_n: int
    num_warps: int
    num_stages: int
    waves: int = 4
    min_blocks: int = 4
    program_blocks: float = 0.0
    merge_blocks: float = 0.0
    load: float = 0.0
    tma: bool = False


# The split kernel's tiles per kind of cache (docs/kernel_notes.md has the measurements behind each row).
# "plain": 64-key tiles, four stages up to D = 128 (two beyond, where four do not fit the shared memory), splits up
#   to four waves. "sm90": 16-bit contiguous caches, D <= 128, flash decode on sm_90: 128-key tiles of 8 warps, 3
#   stages, about one wave of programs (H200, CUDA graphs: 1.02-1.25x faster than "plain" on 11 of 12 shapes, 0.98x on
#   the twelfth; paged caches with these 3 stages 0.66-0.94x: "sm90_paged"). Forced tiles (the routing's
#   tiles["decode"]) keep their kind's split rule. "fp8", "fp8_paged": float8 caches (half the bytes per tile) run
#   narrower programs, more of them per SM, since the per-tile instructions no longer hide under the loads:
#   contiguous ones with 32-key tiles, paged ones with 64-key tiles and more in flight (the block-table read before
#   each tile adds latency). "fp8_dilated": dilated decode on float8 caches keeps the 4-warp programs (six stages
#   when paged), as measured before the narrower ones.
# "sm90_paged": 16-bit paged caches on sm_90, "sm90"'s tiles and split rule with 5 stages. Where a tile's rows come
#   from a block-table read inside the loop, Triton (3.6 and 3.9) keeps (num_stages - 1) // 2 K and V buffers, not
#   num_stages - 1: "sm90"'s 3 stages leave paged caches one buffer (a tile's loads wait for the previous tile's
#   softmax; "plain" has one too and hides it behind several programs an SM), 5 give the two buffers contiguous
#   caches have with 3 (tests/test_decode_compile.py checks them, compiled for sm_90). H200, CUDA graphs: 1.02-1.17x
#   "plain"'s speed at page 16, 0.98-1.26x at page 256; at page 64, 0.76-0.93x, so pages holding whole "plain"
#   tiles but not whole 128-key ones keep "plain" (decode_kind).
# Both sm90 rows split by predicted makespan (one program an SM: its time is its key blocks plus a fixed cost of
#   about three, the merge about one more; fitted to 18 shapes, B = 6-44, caches 2k-32k, H200: it picks counts within
#   7% of the fastest of six on every shape, and the one-wave rule's counts where those had measured best; where
#   (sequence, KV head) programs leave the last wave part empty it splits them: 1.02-1.38x the one-wave rule's
#   count on 10 of the 18).
# "sm90_many", "sm90_most": "sm90"'s calls whose (sequence, KV head) programs outnumber the SMs, over caches of
#   fewer than 4096 keys (MANY_PROGRAMS). Whole-SM programs leave a wave part empty there (144 programs: a second wave
#   of 12) or pay their fixed cost on few key blocks. Up to three programs an SM, 64-key tiles of 4 warps and 3
#   stages (two K/V buffers, 64 KB: three programs an SM fit), one split; beyond, 32-key tiles of 2 warps split until
#   about two programs an SM (load 1.9). H200, CUDA graphs, one new query a sequence, GQA 32/8 and 64/8, caches
#   1k-3k: the 64-key row within 1.03x of the fastest tile/split variant on all 35 shapes of 136-384 programs (B =
#   17-48), 0.97-1.26x the 32-key row's plan there (1.00 or more on 31); the 32-key row within 1.10x of the fastest
#   of 11 variants at B = 64 (caches 1k-4k), 0.96-0.99x "sm90" at 4k caches with 40-64 sequences (so 4k caches keep
#   "sm90"). docs/kernel_notes.md.
# "sm90_many_tma": "sm90_many" with K and V by tensor descriptors, for calls of more than 1 and at most 1.2 programs
#   an SM (17-19 sequences x 8 KV heads on 132 SMs), where one program's issue rate sets the time (286 against 424
#   instructions a tile): H200, CUDA graphs, 1.05-1.08x "sm90_many" at 17-18 sequences x 2k-3k, 1.01x at 20; 0.95-0.98x
#   at 24-64 sequences and on the 128-key row (several programs an SM share their bandwidth there).
# "sm90_paged_many", "sm90_paged_most": "sm90_paged"'s calls of that kind: 64-key tiles of 4 warps and 6 stages (two
#   K/V buffers in a paged loop: about three programs an SM) while the programs fit in three an SM, 32-key tiles of
#   2 warps beyond; split as "sm90_most". H200, pages of 16 and 256 rows, B = 18-64, caches 1k-3k: within 1.03x
#   of the fastest of 16 variants on all 20 shapes, where "sm90_paged" took 1.04-1.38x; A/B on 9 shapes (2 new):
#   1.04-1.39x the "sm90_paged" plan (docs/kernel_notes.md).
DECODE_TILES: Dict[str, DecodeTiles] = {
    "plain": DecodeTiles(64, 4, 4),
    "plain_wide_d": DecodeTiles(64, 4, 2),
    "sm90": DecodeTiles(128, 8, 3, waves=1, min_blocks=1, program_blocks=3, merge_blocks=1),
    "sm90_paged": DecodeTiles(128, 8, 5, waves=1, min_blocks=1, program_blocks=3, merge_blocks=1),
    "sm90_many": DecodeTiles(64, 4, 3, min_blocks=1, load=1.0),
    "sm90_many_tma": DecodeTiles(64, 4, 3, min_blocks=1, load=1.0, tma=True),
    "sm90_most": DecodeTiles(32, 2, 4, min_blocks=1, load=1.9),
    "sm90_paged_many": DecodeTiles(64, 4, 6, min_blocks=1, load=1.9),
    "sm90_paged_most": DecodeTiles(32, 2, 6, min_blocks=1, load=1.9),
    "fp8": DecodeTiles(32, 2, 4),
    "fp8_paged": DecodeTiles(64, 2, 6),
    "fp8_dilated": DecodeTiles(64, 4, 4),
    "fp8_dilated_paged": DecodeTiles(64, 4, 6),
}


def decode_kind(fp8: bool, paged: bool, dilated: bool, padded_d: int, element_size: int, arch: str,
                page_size: int = 0) -> str:
    """The :data:`DECODE_TILES` row of a cache: float8 caches up to D = 128 by layout, 16-bit flash-decode caches up
    to D = 128 on an sm_90 GPU (``arch`` ``"sm90"``; only measured there) by their own rows (``"sm90"`` contiguous,
    ``"sm90_paged"`` paged), everything else ``"plain"`` (``"plain_wide_d"`` beyond D = 128). A paged cache whose
    pages (``page_size`` rows) hold whole tiles of ``"plain"`` but not of ``"sm90_paged"`` (page 64) keeps
    ``"plain"``: one block-table read a tile beats per-row reads of wider tiles."""
    if fp8 and padded_d <= 128:
        return "fp8" + ("_dilated" if dilated else "") + ("_paged" if paged else "")
    if padded_d > 128:
        return "plain_wide_d"
    if arch == "sm90" and element_size == 2 and not dilated:
        if not paged:
            return "sm90"
        whole = [kind for kind in ("sm90_paged", "plain") if page_size % DECODE_TILES[kind].block_n == 0]
        return whole[0] if whole else "sm90_paged"
    return "plain"


class ManyPrograms(NamedTuple):
    """Where a kind of cache takes another row for calls of more (sequence, KV head) programs than ``per_sm`` times
    the SMs: ``kind``, for caches of fewer than ``capacity`` keys a sequence and at most ``queries`` new queries a
    sequence."""
    kind: str
    per_sm: float
    capacity: int
    queries: int


# kind -> its rows for calls of many programs, by growing ``per_sm`` (each row from its ``per_sm`` to the next's).
# 64-key programs (three an SM fit) up to three programs an SM, 32-key ones beyond. Speculative steps: contiguous
# caches' 64-key row measured the fastest variant with 2 and 4 new queries a sequence (12 shapes of 144-384 programs,
# 1.08-1.32x "sm90"), and with 8 at 144-256 programs but 0.94x "sm90" at 384; beyond three programs an SM, 4 new
# queries a sequence measured 0.91-1.09x "sm90" on the 32-key row: such steps keep "sm90" there.
MANY_PROGRAMS: Dict[str, Tuple[ManyPrograms, ...]] = {
    "sm90": (ManyPrograms("sm90_many_tma", 1, 4096, 4), ManyPrograms("sm90_many", 1.2, 4096, 4),
             ManyPrograms("sm90_most", 3, 4096, 1)),
    "sm90_paged": (ManyPrograms("sm90_paged_many", 1, 4096, 1), ManyPrograms("sm90_paged_most", 3, 4096, 1)),
}


def many_programs_kind(kind: str, programs: int, capacity: int, queries: int, device: torch.device) -> str:
    """The :data:`MANY_PROGRAMS` row of ``kind`` for ``programs`` (sequence, KV head) programs: the last row whose
    ``per_sm`` times the device's SMs they exceed, where the call is within its bounds (a cache of fewer keys than
    its ``capacity``: the cache's rows a sequence; no more new queries a sequence than its ``queries``); else
    ``kind`` (also where that row's bounds exclude the call: an earlier row is not measured there)."""
    rows = MANY_PROGRAMS.get(kind, ())
    sms = _sm_count(device) if rows else 0
    for many in reversed(rows):
        if programs > many.per_sm * sms:
            return many.kind if capacity < many.capacity and queries <= many.queries else kind
    return kind


@contextlib.contextmanager
def tiles_set(**fields):
    """Every :data:`DECODE_TILES` row with ``fields`` replaced (``tiles_set(tma=True)``: a variant's A/B in
    tools/tune_decode.py's ``--set``, tests), the plans cleared on entry and exit."""
    saved = dict(DECODE_TILES)
    DECODE_TILES.update({kind: row._replace(**fields) for kind, row in saved.items()})
    PLANS.clear()
    try:
        yield
    finally:
        DECODE_TILES.update(saved)
        PLANS.clear()


def decode_tiles(kind: str) -> DecodeTiles:
    """The split kernel's tiles for a :func:`decode_kind`, unless the routing forces others (its
    ``tiles["decode"]``, a :class:`~longattn.backends.triton.tiles.Tiles` whose ``block_m`` is unused: tuning
    tools, tests); forced tiles keep the kind's split rule."""
    rule = DECODE_TILES[kind]
    routed = routing.current()
    forced = routed.get(routed.tiles, "decode")
    if forced is not None:
        return rule._replace(block_n=forced.block_n, num_warps=forced.num_warps, num_stages=forced.num_stages)
    return rule


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(batch: int, kv_heads: int, capacity: int, device: torch.device,
                  tiles: DecodeTiles = DECODE_TILES["plain"]) -> int:
    """Key splits per (sequence, KV head), so that the programs fill about ``tiles.waves`` waves of the SMs: one
    split once the (sequence, KV head) programs alone make half that many waves; else as many as fit the waves
    (``tiles.waves`` programs per SM; with "plain"'s four, rounding up to a fifth, partial wave cost paged caches
    23%, docs/kernel_notes.md), each split at least ``tiles.min_blocks`` key blocks. Tiles with ``program_blocks``
    take the count of the earliest predicted end instead (:func:`_earliest_end`), tiles with a ``load`` the fewest
    that give that many programs an SM (at most one split per key block)."""
    programs = max(1, batch * kv_heads)
    sms = _sm_count(device)
    if tiles.program_blocks:
        return _earliest_end(programs, max(1, -(-capacity // tiles.block_n)), sms, tiles)
    if tiles.load:
        return max(1, min(math.ceil(tiles.load * sms / programs), -(-capacity // tiles.block_n), MAX_SPLITS))
    if 2 * programs >= tiles.waves * sms:
        return 1
    most = max(1, -(-capacity // (tiles.min_blocks * tiles.block_n)))
    return max(1, min(tiles.waves * sms // programs, most, MAX_SPLITS))


def _earliest_end(programs: int, blocks: int, sms: int, tiles: DecodeTiles) -> int:
    """The split count whose predicted end is earliest (the fewest splits among equal ends) for ``programs``
    (sequence, KV head) programs over ``blocks`` key blocks, programs that take a whole SM: ``s`` splits run in
    ``ceil(programs * s / sms)`` waves, each as long as a split's ``ceil(blocks / s)`` key blocks plus
    ``tiles.program_blocks``, and more than one split adds the merge's ``tiles.merge_blocks``. Where the programs
    leave a wave part empty (160 programs on 132 SMs take two waves), more, shorter splits fill it."""
    def end(s: int) -> float:
        waves = -(-programs * s // sms)
        return waves * (-(-blocks // s) + tiles.program_blocks) + (tiles.merge_blocks if s > 1 else 0.0)
    return min(range(1, min(blocks, MAX_SPLITS) + 1), key=lambda s: (end(s), s))


def _page_constant(paged: bool, page_size: int) -> int:
    """The split kernel's ``PAGE``: a paged cache's page size where it is a power of two, compiled in (each row's
    page and row within it by a shift and a mask instead of a division: 2712 -> 2192 instructions at page 16 on
    sm_90; H200: 1.17-1.21x at page 16, 1.05-1.06x at page 256), else 0 (read at run time). The plan is kept per
    cache shape, page size included."""
    return page_size if paged and page_size & (page_size - 1) == 0 else 0


def _kv_tma_ok(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether contiguous caches ``(B, M, Hk, D)`` load by tensor descriptor (``DecodeTiles.tma``): a Triton with
    device-side descriptors, 16-byte aligned bases and batch, row and head strides (descriptors of a (sequence, KV
    head)'s rows start at ``b * stride(0) + h * stride(2)``). Installs Triton's scratch allocator."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    for c in (k_cache, v_cache):
        size = c.element_size()
        if c.stride(-1) != 1 or c.data_ptr() % 16 or any((c.stride(i) * size) % 16 for i in range(3)):
            return False
    ensure_allocator()
    return True


def _unit_d(x: Tensor) -> Tensor:
    """The kernels read rows of the head dim with unit stride."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_cache_strides(k_cache: Tensor, v_cache: Tensor) -> None:
    """The caches are written and read in place, so they must have unit stride along the head dim
    (:func:`longattn.backends.triton.support.cache_layout_reason`, which the dispatch reads first)."""
    why = support.cache_layout_reason(k_cache, v_cache)
    if why is not None:
        raise ValueError(f"the Triton decode kernels cannot take {why}")


class PlanCache:
    """The Triton backend's decode launch plans (:class:`DecodePlan`), kept by call signature
    (:attr:`longattn.call.KVCache.signature`: everything the kernels specialise on) and the routing in force (its
    ``tiles["decode"]`` forces the split kernel's tiles), so that every step of a
    generation reuses one plan: a step then costs two allocations and two or three direct launches on the host.
    A call without a signature gets a plan of its own, not kept. At most ``size`` plans; the oldest go first."""

    def __init__(self, size: int = 256):
        self._plans = Kept(size)

    def plan(self, q: Tensor, call: AttentionCall) -> "DecodePlan":
        """The plan of ``call`` (a KV-cache call on ``q``), made on its signature's first call."""
        key = call.cache.signature
        if key is None:
            return _plan_of(q, call)
        return self._plans.get((key, routing.current()), lambda: _plan_of(q, call))

    def clear(self) -> None:
        self._plans.clear()

    def plans(self) -> list:
        """The plans kept (for tests and inspection)."""
        return self._plans.values()

    def __len__(self) -> int:
        return len(self._plans)


PLANS = PlanCache()


def _plan_of(q: Tensor, call: AttentionCall) -> "DecodePlan":
    c = call.cache
    check_cache_strides(c.k_cache, c.v_cache)
    pattern = call.branches or call.band
    new = None if c.k_new is None else (c.k_new, c.v_new)
    return DecodePlan(q, c.k_cache, c.v_cache, new, c.out, c.n_new, c.block_table is not None, c.page_size,
                      c.capacity, pattern, call.scale, c.num_splits, c.descales, call.softcap, call.alibi, call.sinks)


def decode(q: Tensor, call: AttentionCall, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The ``decode`` pass: the KV-cache call ``call`` on ``q`` through its launch plan (:data:`PLANS`):
    ``(out, lse (B, Hq, Nq) or None)``."""
    c = call.cache
    return PLANS.plan(q, call).run(q, c.k_cache, c.v_cache, c.k_new, c.v_new, c.seqlens, c.block_table, c.out,
                                   return_lse, c.descales, call.alibi,
                                   None if call.sinks is None else call.sinks.contiguous())


def _descale_strides(x: Tensor) -> Tuple[int, int]:
    """(batch, KV head) strides of a descale factor ``(1,)`` (both 0) or ``(B, Hk)``."""
    return (0, 0) if x.dim() == 1 else (x.stride(0), x.stride(1))


def _round4(n: int) -> int:
    return -(-n // 4) * 4  # keeps every part of the workspace 16-byte aligned


class DecodePlan:
    """A decode call as far as shapes decide it: grids, compile-time arguments, the integer arguments (sizes and
    strides), the split count and the workspace layout, with a :class:`CachedLaunch` per kernel. The caller keys
    plans by everything the kernels specialise on (shapes, strides, dtypes, alignment, flags), so one plan serves
    every decode step of a generation: a step costs two allocations and two or three direct launches on the host.
    A contiguous cache's length and strides are read at every run (the caller keys those by specialisation class
    only, so that a cache growing by a row per step keeps its plan).

    ``pattern`` is a :class:`Band` (flash decode: :func:`_decode_split`, the query heads of a group sharing each
    K/V tile) or LongNet's branches (:func:`_dilated_decode_split`, one query head per program, each branch's
    partials in ``splits`` slots of their own). The workspace (float32) holds the partial outputs
    ``(slots, B, Nq, Hq, D)``, their log-sum-exps ``(slots, B, Hq, Nq)`` and the merged log-sum-exp
    ``(B, Hq, Nq)``.

    Flash decode takes soft-capping (``softcap`` > 0, its value kept by the plan) and ALiBi (``slopes``: float32
    ``(B, Hq)`` slopes, any strides; the plan keeps their strides and reads the tensor given to each run, as it
    reads ``seqlens``). Attention sinks (``sinks``, ``(Hq,)``, flash decode) enter at the merge, as the plan's
    flag; each run reads the tensor given to it."""

    def __init__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, new: Optional[Tuple[Tensor, Tensor]],
                 out: Optional[Tensor], n_extra: int, paged: bool, page_size: int, capacity: int,
                 pattern: Union[Band, Tuple[Branch, ...]], scale: float, num_splits: int = 0,
                 descales: Optional[Tuple[Tensor, Tensor]] = None, softcap: float = 0.0,
                 slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None):
        B, n_q, hq, d = q.shape
        hk = k_cache.shape[2]
        group = hq // hk
        dilated = not isinstance(pattern, Band)
        if dilated and (softcap or slopes is not None or sinks is not None):
            raise ValueError("dilated decode takes no soft-capping, ALiBi or sinks")
        bd = block_d(d)
        facts = routing.current().device or device_facts(q.device)
        kind = decode_kind(descales is not None, paged, dilated, bd, k_cache.element_size(),
                           f"sm{facts.capability[0]}{facts.capability[1]}" if facts.cuda else "cpu",
                           page_size if paged else 0)
        tiles = decode_tiles(many_programs_kind(kind, B * hk, capacity, n_q, q.device))
        block_n, warps, stages = self.tiles = tiles[:3]
        tma = tiles.tma and not paged and _kv_tma_ok(k_cache, v_cache)
        if dilated:  # one program per query head and branch, over the branch's selected keys
            longest = max(-(-min(br.segment, capacity) // br.dilation) for br in pattern)
            splits = num_splits or choose_splits(B * len(pattern), hq, longest, q.device, tiles)
        else:
            longest = capacity
            splits = num_splits or choose_splits(B, hk, capacity, q.device, tiles)
        # num_splits 0 chooses from the shapes and the GPU; more splits than key blocks would only be empty
        self.splits = splits = max(1, min(splits, -(-longest // block_n), MAX_SPLITS))
        slots = splits * (len(pattern) if dilated else 1)
        self.q_copy = q.stride(-1) != 1
        self.out_direct = out is not None and out.stride(-1) == 1
        q_strides = (q.contiguous() if self.q_copy else q).stride()[:3]
        out_strides = out.stride()[:3] if self.out_direct else (n_q * hq * d, hq * d, d)
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device
        n_po, n_pl = slots * B * n_q * hq * d, _round4(slots * B * hq * n_q)
        self.lse_off, self.n_lse = n_po + n_pl, B * hq * n_q
        self.ws_size = self.lse_off + self.n_lse
        n_pages, cache_strides = k_cache.shape[0], (*k_cache.stride()[:3], *v_cache.stride()[:3])
        page_size = page_size if paged else 1
        self.append = None
        if new is not None:
            self.append = CachedLaunch(_decode._cache_append, (B, n_q), HEAD_D=d, BLOCK_D=bd,
                                       BLOCK_H=max(1, 1 << (hk - 1).bit_length()), PAGED=paged)
            k_strides, v_strides = (_unit_d(x).stride()[:3] for x in new)
            self._append_parts = ((*k_strides, *v_strides), (n_q, hk))
        opts = dict(HEAD_D=d, BLOCK_D=bd, BLOCK_N=block_n, PAGED=paged, FP8_CACHE=descales is not None,
                    num_warps=warps, num_stages=stages)
        # float8 caches: the factors' (batch, KV head) strides, 0 along a dimension a per-tensor factor lacks
        self.descale_strides = tuple(s for x in descales for s in _descale_strides(x)) if descales else (0,) * 4
        self.branches = None
        self.direct = False
        if dilated:
            block_m = min(64, max(16, 1 << (n_q - 1).bit_length()))
            tiles = -(-n_q // block_m)
            self.branches = torch.tensor([[br.segment, br.dilation, br.head_start, br.head_start + br.n_heads,
                                           -1 if br.offset is None else br.offset] for br in pattern],
                                         dtype=torch.int32, device=q.device)
            self.split = CachedLaunch(_decode._dilated_decode_split, (splits, B * hq, len(pattern) * tiles),
                                      BLOCK_M=block_m, **opts)
            split_tail: tuple = (n_q, n_extra, hq, group, splits, tiles, scale)
        else:
            rows = group * n_q
            block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
            b_args = BandArgs.of(pattern)
            # one split and no sinks: the split kernel writes the output and lse itself, no merge kernel runs
            self.direct = splits == 1 and sinks is None
            self.split = CachedLaunch(_decode._decode_split, (splits, B * hk, -(-rows // block_m)), BLOCK_M=block_m,
                                      HAS_LEFT=b_args.has_left, HAS_RIGHT=b_args.has_right,
                                      PAGE_BLOCKS=paged and page_size % block_n == 0, SOFTCAP=softcap > 0,
                                      ALIBI=slopes is not None, DIRECT=self.direct,
                                      PAGE=_page_constant(paged, page_size), **opts,
                                      **({"TMA": True} if tma else {}))
            split_tail = (n_q, n_extra, hq, hk, group, splits, scale, b_args.left, b_args.right)
            # after the descale factors: ALiBi's slope strides (the slopes pointer is each run's) and the cap
            self.mod_ints = (*(slopes.stride() if slopes is not None else (0, 0)), float(softcap))
        self.merge = CachedLaunch(_decode._decode_merge, (B * n_q, hq), HEAD_D=d, BLOCK_D=bd,
                                  BLOCK_S=max(2, 1 << (slots - 1).bit_length()), CHUNK_S=min(16, 4096 // bd),
                                  HAS_SINKS=sinks is not None, num_warps=4)
        self.merge_ints = (n_po, self.lse_off, *out_strides, n_q, hq, slots, B * hq * n_q, B * hq * n_q * d)
        self.direct_ints = (*out_strides, self.lse_off)
        self.paged, self._pages = paged, (page_size, n_pages)
        self._split_parts = ((n_po, *q_strides), split_tail)
        self._bind(cache_strides, capacity)

    @property
    def tma(self) -> bool:
        """Whether the split kernel loads K and V by tensor descriptors (``DecodeTiles.tma``)."""
        return bool(self.split.kwargs.get("TMA", False))

    def _bind(self, cache_strides: tuple, capacity: int) -> None:
        """The integer arguments of the append and split kernels for a cache of these strides and capacity: each is
        (its own leading ints, 6 cache strides, page size, pages, capacity, its own trailing ints). Called again at
        a run whose contiguous cache differs only in those values (the caller keys plans so that their
        specialisation classes agree)."""
        cache = (*cache_strides, *self._pages, capacity)
        head, tail = self._split_parts
        self.split_ints = (*head, *cache, *tail)
        if self.append is not None:
            head, tail = self._append_parts
            self.append_ints = (*head, *cache, *tail)
        self._cache_ints = (cache_strides, capacity)

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            seqlens: Tensor, block_table: Optional[Tensor], out: Optional[Tensor],
            return_lse: bool, descales: Optional[Tuple[Tensor, Tensor]] = None,
            slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """Append ``k``, ``v`` (when the plan has new tokens), attend, merge: ``(out, lse (B, Hq, Nq) or None)``.
        ``descales``: the float8 caches' ``(k_descale, v_descale)``, ``slopes`` the ALiBi slopes and ``sinks`` the
        attention sinks, shaped as when the plan was made."""
        if not self.paged:
            cache_ints = ((*k_cache.stride()[:3], *v_cache.stride()[:3]), k_cache.shape[1])
            if cache_ints != self._cache_ints:
                self._bind(*cache_ints)
                if self.split.kwargs.get("TMA") and not _kv_tma_ok(k_cache, v_cache):  # (strides no descriptor takes)
                    self.split = CachedLaunch(self.split.fn, self.split.grid, **{**self.split.kwargs, "TMA": False})
        bt = seqlens if block_table is None else block_table
        bt_sb = 0 if block_table is None else block_table.stride(0)
        if self.q_copy:
            q = q.contiguous()
        ws = torch.empty(self.ws_size, device=self.device, dtype=torch.float32)
        target = out if self.out_direct else torch.empty(self.shape, device=self.device, dtype=self.dtype)
        ints = self.split_ints
        with on_device(q):
            if self.append is not None:
                a = self.append_ints
                self.append(_unit_d(k), _unit_d(v), k_cache, v_cache, seqlens, bt, *a[:12], bt_sb, *a[12:])
            factors = descales if descales is not None else (seqlens, seqlens)  # unread without float8 caches
            if self.branches is None:
                self.split(q, k_cache, v_cache, seqlens, bt, ws, ints[0], *ints[1:10], bt_sb, *ints[10:], *factors,
                           *self.descale_strides, seqlens if slopes is None else slopes, *self.mod_ints,
                           target if self.direct else ws, *self.direct_ints)
            else:
                self.split(q, k_cache, v_cache, seqlens, bt, self.branches, ws, ints[0], *ints[1:10], bt_sb,
                           *ints[10:], *factors, *self.descale_strides)
            if not self.direct:
                self.merge(ws, target, ws if sinks is None else sinks, *self.merge_ints)
        if out is not None and target is not out:
            out.copy_(target)
            target = out
        lse = ws[self.lse_off:].view(self.shape[0], self.shape[2], self.shape[1]) if return_lse else None
        return target, lse
