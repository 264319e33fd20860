"""The routing settings: the measured thresholds and switches that decide which kernel runs a pass, as one frozen
value (:class:`Routing`), and :func:`routing`, the one way to change them for a block of code.

The planner (:mod:`longattn.backends.triton.planner`) reads :func:`current` when it makes a plan, and the plan
cache keys plans by the routing in force, so a change inside ``with routing(...)`` takes effect at once and ends
with the block (per thread and task: a context variable). Nothing reads these settings from module globals.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, fields, replace
from typing import Iterator, Mapping, Optional, Tuple

from longattn.backends.device import Device

Pairs = Tuple[Tuple[object, object], ...]  # a mapping as sorted pairs, so that a Routing hashes
TILED_PASSES = ("fwd", "fwd_fp8", "dkdv", "dq", "decode")  # the passes whose tiles ``tiles`` may force


def _pairs(value) -> Pairs:
    return tuple(sorted(value.items())) if isinstance(value, Mapping) else tuple(value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _pairs_of(name: str, value) -> Pairs:
    """A mapping setting as sorted pairs; ``TypeError`` naming the setting where it is no mapping (or pairs)."""
    try:
        pairs = _pairs(value)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise TypeError
    except TypeError:
        raise TypeError(f"routing: {name} must be a mapping (a dict), got {value!r}") from None
    return pairs


def _ints_of(name: str, value) -> Tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        out = None
    if out is None or not all(_is_int(x) and x > 0 for x in out):
        raise TypeError(f"routing: {name} must be a sequence of positive ints (head dims), got {value!r}")
    return out


def _check_values(r: "Routing") -> None:
    """``TypeError`` / ``ValueError`` naming the setting of ``r`` that holds what it cannot mean (``gluon="no"``
    would otherwise count as true)."""
    for name in ("gluon", "tma"):
        if getattr(r, name) is not None and not isinstance(getattr(r, name), bool):
            raise TypeError(f"routing: {name} must be True, False or None, got {getattr(r, name)!r}")
    cap = r.gluon_max_softcap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0:
        raise ValueError(f"routing: gluon_max_softcap must be a number >= 0, got {cap!r}")
    for name in ("modified_scores", "replay", "wide_bwd_host_descriptors"):
        if not isinstance(getattr(r, name), bool):
            raise TypeError(f"routing: {name} must be True or False, got {getattr(r, name)!r}")
    for name, least in (("packed_min_mean_rows", 0), ("fp8_min_keys", 0), ("fused_bwd_min_band", 0),
                        ("wide_bwd_min_rows", 0), ("torch_score_budget", 1)):
        value = getattr(r, name)
        if not _is_int(value) or value < least:
            raise ValueError(f"routing: {name} must be an int >= {least}, got {value!r}")
    if r.packed_schedule is not None and (not _is_int(r.packed_schedule) or r.packed_schedule not in (0, 1, 2)):
        raise ValueError(f"routing: packed_schedule must be None, 0, 1 or 2, got {r.packed_schedule!r}")
    for name in ("min_keys", "fused_bwd_min_rows"):
        for d, n in getattr(r, name):
            if not (_is_int(d) and d > 0 and _is_int(n) and n >= 0):
                raise ValueError(f"routing: {name} maps head dims (ints > 0) to counts (ints >= 0), got {d!r}: {n!r}")
    for pass_, t in r.tiles:
        if not isinstance(pass_, str) or not all(hasattr(t, a) for a in ("block_n", "num_warps", "num_stages")):
            raise TypeError(f"routing: tiles maps pass names to Tiles (longattn.backends.triton.tiles.Tiles), got "
                            f"{pass_!r}: {t!r}")
        if pass_ not in TILED_PASSES:  # (a misspelt pass would force nothing, silently)
            raise ValueError(f"routing: tiles maps the passes {list(TILED_PASSES)} to Tiles, got pass {pass_!r}")
        sizes = [("block_n", t.block_n), ("num_warps", t.num_warps)] + (
            [("block_m", t.block_m)] if pass_ != "decode" and hasattr(t, "block_m") else [])
        for what, x in sizes:
            if not (_is_int(x) and x > 0 and x & (x - 1) == 0):
                raise ValueError(f"routing: tiles[{pass_!r}].{what} must be a power of two, got {x!r}")
            if pass_ != "decode" and what != "num_warps" and x < 16:  # (the tensor-core products' least side)
                raise ValueError(f"routing: tiles[{pass_!r}].{what} must be at least 16, got {x!r}")
        if not (_is_int(t.num_stages) and t.num_stages > 0):
            raise ValueError(f"routing: tiles[{pass_!r}].num_stages must be an int >= 1, got {t.num_stages!r}")
    if r.device is not None and not isinstance(r.device, Device):
        raise TypeError(f"routing: device must be a longattn.backends.device.Device or None, got {r.device!r}")
    if not set(r.fused_bwd_host_descriptor_head_dims) <= {64, 128}:  # (others would silently do nothing)
        raise ValueError(f"routing: fused_bwd_host_descriptor_head_dims takes head dims 64 and 128 (the fused "
                         f"kernel's host-descriptor form), got {r.fused_bwd_host_descriptor_head_dims!r}")


@dataclass(frozen=True)
class Routing:
    """Which kernels may take a call, and the measured thresholds past which they do (docs/kernel_notes.md has
    each measurement). Mappings are given as dicts and kept as sorted pairs (:meth:`get`).

    - ``gluon``: the Gluon Hopper kernels on (True), off (False), or as ``LONGATTN_GLUON`` says (None: on unless
      it is ``0``; read when a plan is made).
    - ``min_keys``: head dim -> keys a query must see for the Gluon forward to take a dense call; packed batches
      of these head dims run the Triton forward. D=64: the Gluon forward (with the output stored by TMA, and
      128-row tiles for short bands: ``gluon.launch.SHORT_BAND_TILES``) is 1.07-1.14x the Triton forward at 1k-2k
      keys a query, as fast with 512 (1k causal).
    - ``packed_min_mean_rows``: packed batches whose sequences average fewer query rows run the Triton forward
      where the Gluon forward would run them on packed schedule 0 (its serial set-up per tile does not amortise:
      H100, 64k tokens, 0.65-0.97x at 16-256 rows a sequence, 1.06-1.20x from 512); schedule 1 has no such limit.
    - ``packed_schedule``: how the Gluon forward schedules the tiles of the packed batches it takes
      (``gluon.launch.GluonTiles.packed_schedule``); None (the default): the tiles' own (1 at D=128, 0 at D=256).
      0 persistent, each tile set up after the last one's loads; 1 persistent, V through one ragged descriptor and
      the next tile found while this one loads (H200, 64k tokens, D=128: 1.04-1.26x schedule 0, 1.10-1.64x the
      Triton forward, documents of up to 128 to 8192 tokens); 2 one program per tile (FlashAttention's varlen
      grid; not measured).
    - ``modified_scores``: soft-capping or ALiBi in the Gluon forward (calls with both run the Triton forward:
      1.02-1.10x slower there, 7-14% faster with one).
    - ``fp8_head_dims``: float8 head dims routed to the Gluon forward (the kernel takes D=64, 128 and 256,
      ``gluon.launch.FP8_KERNEL_HEAD_DIMS``; on an H200 it measured 1.05-1.15x the Triton FP8 forward at D=64,
      1.09-1.13x at D=128 and 1.08-1.17x at D=256, with the same errors).
    - ``gluon_max_softcap``: soft-capping with a larger cap runs the Triton kernels, forward and backward. The
      Gluon forward's ``tanh.approx`` is off by up to ``cap * 7.9e-6`` in a capped score and the fused backward's
      ``1 - 2 / (exp(2y) + 1)`` by ``cap * 1e-7`` near 0: both grow with the cap (4e-4 and 5e-6 at 50, 8e-2 and
      1e-3 at 1e4), where the Triton kernels take tanh's series near 0 above a cap of 64 (float32's rounding).
    - ``fp8_min_keys``: float8 calls with fewer keys (the length of ``k``) whose values come sequence-major
      (``v.stride(1) == 1``) run the Triton FP8 forward, which reads them as they are where the Gluon one copies
      them into its own layout. On an H200 at 1k keys the Triton forward so measured 0.96-1.43x the Gluon one
      (ahead on five of six rows, D = 64/128/256, causal or not); given values in the usual layout both copy them,
      and the Gluon forward measured 0.97-1.11x the Triton one (ahead on five of six), so such calls run it at any
      length.
    - ``fused_bwd_min_band``: bands narrower than this many keys run the two Triton backward passes at the head
      dims ``fused_bwd_min_band_head_dims`` (window 127: 5-6% slower fused, 511 even, 1023 3-6% faster).
    - ``fused_bwd_min_rows``: head dim -> query rows a key must be seen by, on average, for the fused backward to
      take a dense call without a window (D=128: between the measured rows on an H200, bf16, 16k tokens, both
      backwards' launches replayed: the fused one 1.15x the two passes at 1k causal, 512.5 rows a key, 0.79x at 512
      causal, 256.5; D=64: the fused 64 x 128 kernel measured 1.10x the two passes at 1024 rows a key and a tie,
      1.01x, at 1k causal, 512.5, on an H200; docs/benchmarks.md). The D=64 calls the 128 x 128 backward takes
      have their own threshold, ``wide_bwd_min_rows``.
    - ``wide_bwd_head_dims``: head dims whose calls the fused backward would take go to the 128 x 128 backward
      instead (``gluon/bwd_wide_tile.py``: dense calls, no band but causal's, no score modification, sinks or
      log-sum-exp gradient, gradients in the inputs' dtype); D=64: 1.07-1.19x faster than the fused backward on
      an H200 (docs/kernel_notes.md). ``()`` turns it off.
    - ``wide_bwd_min_rows``: query rows a key must be seen by, on average, for the 128 x 128 backward to take a call (in
      place of ``fused_bwd_min_rows`` where that is higher; H200, bf16, 16k tokens, forward+backward with host-made
      descriptors: 1.28x the two Triton passes at 512 rows a key non-causal, 1.03x at 1k causal, 512.5; below 512 mixed,
      0.92-1.07x, host-bound).
    - ``wide_bwd_host_descriptors``: the 128 x 128 backward takes its TMA descriptors made on the host, as kernel
      parameters, rather than made by every program on the device before its first load (H200, D=64, bf16, 16k
      tokens: 1.03-1.15x causal at 1k-4k keys, 1.01-1.05x at 8k-16k; non-causal 0.97x at 1k to 1.03x at 16k).
    - ``fused_bwd_host_descriptor_head_dims``: head dims whose fused backward does the same on calls without a
      packed batch or block lists (the kernel takes D = 64 and 128; H200, 16k tokens: D=128 1.00-1.15x, most at
      1k-4k causal; D=64 1.00-1.12x causal but 0.92-0.99x non-causal at 2k-16k, so not routed).
    - ``deterministic_bwd_head_dims``: head dims whose deterministic calls (``deterministic=True``, PyTorch's
      deterministic mode) the fused backward takes, its dQ added in a fixed order (turn counters per query block,
      ``gluon/bwd_fused.py``): dense calls it takes otherwise, no packed batch or block lists. Other head dims, and
      ``()``, run the two Triton backward passes, which sum in a fixed order.
    - ``tiles``: pass name -> :class:`~longattn.backends.triton.tiles.Tiles` forced for the Triton passes
      (tests, tuning tools); ``"decode"``: the decode split kernel's ``block_n``, ``num_warps`` and ``num_stages``.
    - ``tma``: the Triton kernels' descriptor loads forced on or off (None: ``LONGATTN_TMA`` and the rule of
      :func:`~longattn.backends.triton.tiles.tma_wanted`).
    - ``device``: made-up :class:`~longattn.backends.device.Device` facts to plan with (None: the tensors' own), for
      :func:`longattn.explain`: a call that runs under them launches the kernels they plan, and a GPU kernel planned
      for CPU tensors is a ``ValueError``.
    - ``replay``: a call signature's later calls replay the launches recorded on its first one
      (:mod:`longattn.backends.replay`; the Triton backend's forwards and backwards); False: every call builds its
      launches anew (an A/B of the host's cost, or a suspected replay bug).
    - ``torch_score_budget``: attention scores per chunk of the PyTorch backend (``backends/torch/chunked.py``):
      2^25, 128 MiB in float32 for each of the few chunk temporaries; tests make it tiny to cut every row apart.
    """

    gluon: Optional[bool] = None
    min_keys: Pairs = ((64, 1024),)
    packed_min_mean_rows: int = 512
    packed_schedule: Optional[int] = None
    modified_scores: bool = True
    fp8_head_dims: Tuple[int, ...] = (64, 128, 256)
    gluon_max_softcap: float = 64.0
    fp8_min_keys: int = 2048
    fused_bwd_min_band: int = 1024
    fused_bwd_min_band_head_dims: Tuple[int, ...] = (64, 128)
    fused_bwd_min_rows: Pairs = ((64, 1024), (128, 512))
    wide_bwd_head_dims: Tuple[int, ...] = (64,)
    wide_bwd_min_rows: int = 512
    wide_bwd_host_descriptors: bool = True
    fused_bwd_host_descriptor_head_dims: Tuple[int, ...] = (128,)
    deterministic_bwd_head_dims: Tuple[int, ...] = ()
    tiles: Pairs = ()
    tma: Optional[bool] = None
    device: Optional[Device] = None
    replay: bool = True
    torch_score_budget: int = 1 << 25

    def __post_init__(self):
        for name in ("min_keys", "fused_bwd_min_rows", "tiles"):
            object.__setattr__(self, name, _pairs_of(name, getattr(self, name)))
        for name in ("fp8_head_dims", "fused_bwd_min_band_head_dims", "wide_bwd_head_dims",
                     "deterministic_bwd_head_dims", "fused_bwd_host_descriptor_head_dims"):
            object.__setattr__(self, name, _ints_of(name, getattr(self, name)))
        _check_values(self)
        # Hashed once: every plan lookup hashes the routing in force (the fields' hash, as dataclass would give).
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def get(pairs: Pairs, key, default=None):
        """The value of ``key`` in one of the mapping settings (``min_keys``, ``fused_bwd_min_rows``, ``tiles``)."""
        return next((v for k, v in pairs if k == key), default)

    def gluon_on(self) -> bool:
        """Whether the Gluon kernels may run (``gluon``, else ``LONGATTN_GLUON``)."""
        if self.gluon is not None:
            return self.gluon
        return os.environ.get("LONGATTN_GLUON", "1") != "0"


DEFAULT = Routing()
_CURRENT: contextvars.ContextVar[Routing] = contextvars.ContextVar("longattn_routing", default=DEFAULT)
NAMES = tuple(f.name for f in fields(Routing))


def current() -> Routing:
    """The routing in force."""
    return _CURRENT.get()


@contextlib.contextmanager
def use(settings: Optional[Routing]) -> Iterator[Routing]:
    """``settings`` in force inside a ``with`` block (as they are): how a backward, which autograd may run on another
    thread (CUDA tensors get a device thread, where no context variable of the caller is set), plans under the
    routing its forward ran with."""
    if settings is None:  # (none was recorded: a forward traced by torch.compile)
        yield _CURRENT.get()
        return
    token = _CURRENT.set(settings)
    try:
        yield settings
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def routing(**overrides) -> Iterator[Routing]:
    """Change routing settings (the fields of :class:`Routing`) inside a ``with`` block, on top of the ones in force:
    ``with longattn.routing(gluon=False): ...`` runs the Triton kernels where the Gluon ones would have;
    ``with longattn.routing(device=Device(capability=(9, 0), gluon=True)): longattn.explain(..., backend="triton")``
    plans the Triton backend's passes as on an sm_90 GPU (on CPU tensors: under the Triton interpreter,
    ``TRITON_INTERPRET=1``). A setting given replaces the one in force as a whole, a mapping too (``min_keys``,
    ``fused_bwd_min_rows``, ``tiles``: an inner ``routing(min_keys={128: 0})`` drops the outer block's entry for
    64; give every entry to keep: ``with longattn.routing() as r:`` yields the routing in force, whose mappings
    are sorted pairs, so ``routing(min_keys={**dict(r.min_keys), 128: 0})`` adds one).
    The settings are per thread (a context variable). A call's backward plans under the routing its forward ran
    with, eagerly; under ``torch.compile`` the compiled backward runs in autograd's thread and plans under the
    defaults there (a block around ``loss.backward()`` does not reach that thread either): where a compiled
    backward must avoid the Gluon kernels, ``LONGATTN_GLUON=0`` in the environment holds in every thread. No setting
    changes a result beyond float rounding (every route is exact).
    Yields the routing in force inside the block."""
    unknown = sorted(set(overrides) - set(NAMES))
    if unknown:
        raise TypeError(f"routing: unknown setting(s) {unknown}; the settings are {list(NAMES)}")
    token = _CURRENT.set(replace(_CURRENT.get(), **overrides))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
