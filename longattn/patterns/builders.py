"""Block-mask patterns: composable pattern objects and plain builder functions.

A pattern object (``Local(2) | GlobalTokens(1)``) describes where attention may go independently of the sequence
length; ``.mask(n, m, block_size=..., heads=..., device=...)`` draws it as a bool block mask
``(1, heads, ceil(n / block_q), ceil(m / block_k))`` and ``.build(...)`` wraps that in a
:class:`~longattn.patterns.BlockSparsePattern`. The functions (``local(2, n=...)``) draw one pattern directly;
:func:`union` and :func:`intersection` combine masks. All distances, windows and segments are counted in *blocks*
and measured from the diagonal as explained in :mod:`longattn.patterns._grid` (queries aligned bottom-right, as
the kernels' causal mask). See ``docs/patterns.md`` for pictures.
"""
from __future__ import annotations

from numbers import Real
import typing
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from longattn import _validation as V
from longattn.patterns._grid import Grid, check_int, make_grid
from longattn.patterns.pattern import BlockSparsePattern

BlockSize = typing.Union[int, Tuple[int, int]]
Device = Optional[typing.Union[str, torch.device]]


class Pattern:
    """Base class: a block-level attention pattern, drawn for any grid by :meth:`mask`.

    Combine with ``|`` (union: a pair allowed by either) and ``&`` (intersection: allowed by both).
    """

    def _draw(self, grid: Grid) -> Tensor:
        """``(heads or 1, q_blocks, k_blocks)`` bool on ``grid.device``."""
        raise NotImplementedError

    def mask(self, n: int, m: Optional[int] = None, *, block_size: BlockSize = 128, heads: int = 1,
             device: Device = None) -> Tensor:
        """Bool block mask ``(1, heads, ceil(n / block_q), ceil(m / block_k))`` (``m`` defaults to ``n``).

        ``heads=1`` gives a mask that broadcasts over the attention heads; ``heads=H`` gives one per head (patterns
        that depend on the head, :class:`Dilated` and :class:`Random`, then differ between heads).
        """
        grid = make_grid(n, m, block_size, heads, device, fn=f"{type(self).__name__}.mask")
        drawn = self._draw(grid)
        return drawn.expand(grid.heads, grid.q_blocks, grid.k_blocks).contiguous()[None]

    def build(self, n: int, m: Optional[int] = None, *, block_size: BlockSize = 128, heads: int = 1,
              device: Device = None) -> BlockSparsePattern:
        """:meth:`mask` wrapped in a :class:`BlockSparsePattern` that knows the block size and lengths."""
        mask = self.mask(n, m, block_size=block_size, heads=heads, device=device)
        return BlockSparsePattern(mask, block_size, seq_lens=(n, n if m is None else m))

    def builder(self, *, block_size: BlockSize = 128, heads: int = 1) -> "PatternBuilder":
        """A callable ``(n, m, device) -> BlockSparsePattern`` for :class:`longattn.nn.BlockSparseAttention`,
        which builds the pattern for each input length it meets."""
        return PatternBuilder(self, block_size, heads)

    def __or__(self, other: "Pattern") -> "Pattern":
        if not isinstance(other, Pattern):
            return NotImplemented
        return Union(self, other)

    def __and__(self, other: "Pattern") -> "Pattern":
        if not isinstance(other, Pattern):
            return NotImplemented
        return Intersection(self, other)


class PatternBuilder:
    """Builds ``pattern`` with a fixed block size and head count for any ``(n, m, device)``."""

    def __init__(self, pattern: Pattern, block_size: BlockSize, heads: int):
        grid = make_grid(1, 1, block_size, heads, None, fn=f"{type(pattern).__name__}.builder")
        self.pattern, self.block_size, self.heads = pattern, (grid.block_q, grid.block_k), grid.heads

    def __call__(self, n: int, m: Optional[int] = None, device: Device = None) -> BlockSparsePattern:
        return self.pattern.build(n, m, block_size=self.block_size, heads=self.heads, device=device)

    def __repr__(self) -> str:
        return f"{self.pattern!r}.builder(block_size={self.block_size}, heads={self.heads})"


class Dense(Pattern):
    """Every block pair (density 1)."""

    def _draw(self, grid: Grid) -> Tensor:
        return torch.ones(1, grid.q_blocks, grid.k_blocks, dtype=torch.bool, device=grid.device)

    def __repr__(self) -> str:
        return "Dense()"


class Causal(Pattern):
    """The block pairs the bottom-right causal mask does not hide entirely: query block ``a`` sees key block ``b``
    when ``b``'s first key is at or before the aligned position ``last query of a + M - N``."""

    def _draw(self, grid: Grid) -> Tensor:
        return grid.causal()[None]

    def __repr__(self) -> str:
        return "Causal()"


class Local(Pattern):
    """A band of key blocks around the diagonal: block distance ``<= window`` (in blocks, on both sides; ``window=0``
    is the diagonal alone). Make it causal with ``& Causal()``."""

    def __init__(self, window: int):
        self.window = check_int(window, "window", "Local", 0)

    def _draw(self, grid: Grid) -> Tensor:
        return (grid.distance() <= min(self.window, grid.max_distance()))[None]  # (no int64 overflow)

    def __repr__(self) -> str:
        return f"Local({self.window})"


class GlobalTokens(Pattern):
    """The first ``n_global`` query blocks attend to every key block, and every query block attends to the first
    ``n_global`` key blocks (BigBird/Longformer global tokens, ``n_global`` counted in blocks)."""

    def __init__(self, n_global: int):
        self.n_global = check_int(n_global, "n_global", "GlobalTokens", 0)

    def _draw(self, grid: Grid) -> Tensor:
        n_global = min(self.n_global, max(grid.q_blocks, grid.k_blocks))  # past the grid: all of it (no overflow)
        return ((grid.query_blocks() < n_global) | (grid.key_blocks() < n_global))[None]

    def __repr__(self) -> str:
        return f"GlobalTokens({self.n_global})"


class Dilated(Pattern):
    """LongNet's dilated pattern at block level, the union of one branch per ``(w, r)`` of ``segment_lengths`` and
    ``dilation_rates`` (both in blocks).

    Branch ``(w, r)`` cuts the key blocks into segments of ``w`` blocks (the last may be shorter). A query block
    belongs to the segment of its diagonal's last block ``hi(a)``; in the segment starting at block ``s``, head
    ``h`` selects the blocks at ``s + o, s + o + r, ...`` with offset ``o = h % r`` (``o = 0`` for a mask drawn with
    ``heads=1``), and the selected query blocks attend to the selected key blocks of their segment. A query block
    that no branch selects attends to nothing (its outputs are 0); include a branch with ``r = 1`` to cover all.
    """

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int]):
        self.segment_lengths, self.dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates,
                                                                         fn="Dilated")

    def _draw(self, grid: Grid) -> Tensor:
        pos = grid.diagonal()[1]  # (q_blocks, 1): the key block each query block sits at
        b = grid.key_blocks()
        offset = torch.arange(grid.heads, device=grid.device)[:, None, None]
        out = torch.zeros(grid.heads, grid.q_blocks, grid.k_blocks, dtype=torch.bool, device=grid.device)
        for w, r in zip(self.segment_lengths, self.dilation_rates):
            # a segment past the key blocks is all of them, a rate past the segment and the heads leaves each head
            # its own offset: cut to those, the same mask and no integer past int64
            w = min(w, max(grid.k_blocks, 1))
            r = min(r, max(w, grid.heads))
            start = torch.div(b, w, rounding_mode="floor") * w  # first block of each key block's segment
            same = torch.div(pos, w, rounding_mode="floor") == b // w
            picked_q = torch.remainder(pos - start, r) == offset % r
            picked_k = torch.remainder(b - start, r) == offset % r
            out |= same & picked_q & picked_k
        return out

    def __repr__(self) -> str:
        return f"Dilated({list(self.segment_lengths)}, {list(self.dilation_rates)})"


class Hierarchical(Pattern):
    """Dense near the diagonal, sparser further away: level ``l`` (``0 <= l < levels``) allows the key blocks at
    block distance ``d <= base * 2**l`` with ``d`` a multiple of ``2**l``. Level 0 is ``Local(base)``; each further
    level reaches twice as far with half the blocks."""

    def __init__(self, levels: int, base: int = 2):
        self.levels = check_int(levels, "levels", "Hierarchical", 1)
        self.base = check_int(base, "base", "Hierarchical", 1)

    def _draw(self, grid: Grid) -> Tensor:
        d = grid.distance()
        out = torch.zeros_like(d, dtype=torch.bool)
        # a level whose stride passes every distance adds only d = 0, which level 0 has: O(log blocks) levels
        reach = grid.max_distance()
        for level in range(min(self.levels, reach.bit_length() + 1)):
            stride = 2 ** level
            out |= (d <= min(self.base * stride, reach)) & (d % stride == 0)
        return out[None]

    def __repr__(self) -> str:
        return f"Hierarchical({self.levels}, base={self.base})"


class Random(Pattern):
    """BigBird-style random blocks: each query block (and head) gets ``round(density * k_blocks)`` key blocks (at
    least one when ``density > 0``) drawn uniformly without replacement.

    The draw uses a CPU ``torch.Generator`` seeded with ``seed`` and is then moved, so a mask is the same on every
    device. With ``heads=H`` the heads draw independently; head 0 equals the ``heads=1`` mask.
    """

    def __init__(self, density: float, seed: int = 0):
        if isinstance(density, bool) or not isinstance(density, Real):
            raise TypeError(f"Random: density must be a number in [0, 1], got {density!r}")
        if not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"Random: density must be in [0, 1], got {density}")
        self.density = float(density)
        self.seed = check_int(seed, "seed", "Random", 0)
        if self.seed >= 2 ** 64:
            raise ValueError(f"Random: seed must be an int in [0, 2**64) (a torch.Generator seed), got {seed}")

    def blocks_per_row(self, k_blocks: int) -> int:
        count = round(self.density * k_blocks)
        return max(count, 1) if self.density > 0 else 0

    def _draw(self, grid: Grid) -> Tensor:
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        keys = torch.rand(grid.heads, grid.q_blocks, grid.k_blocks, generator=gen)
        chosen = keys.argsort(dim=-1, stable=True)[..., : self.blocks_per_row(grid.k_blocks)]
        out = torch.zeros(keys.shape, dtype=torch.bool).scatter_(-1, chosen, True)
        return out.to(grid.device)

    def __repr__(self) -> str:
        return f"Random({self.density}, seed={self.seed})"


class _Combination(Pattern):
    def __init__(self, *parts: Pattern):
        name = type(self).__name__
        if not parts:
            raise ValueError(f"{name}: needs at least one pattern")
        for p in parts:
            if not isinstance(p, Pattern):
                raise TypeError(f"{name}: parts must be Pattern objects, got {type(p).__name__}")
        self.parts = parts

    def __repr__(self) -> str:
        return "(" + f" {self._symbol} ".join(repr(p) for p in self.parts) + ")"


class Union(_Combination):
    """Block pairs allowed by any of the patterns (also written ``a | b``)."""

    _symbol = "|"

    def _draw(self, grid: Grid) -> Tensor:
        out = self.parts[0]._draw(grid)
        for p in self.parts[1:]:
            out = out | p._draw(grid)
        return out


class Intersection(_Combination):
    """Block pairs allowed by all of the patterns (also written ``a & b``)."""

    _symbol = "&"

    def _draw(self, grid: Grid) -> Tensor:
        out = self.parts[0]._draw(grid)
        for p in self.parts[1:]:
            out = out & p._draw(grid)
        return out


# ---- plain functions: draw one pattern -------------------------------------------------------------------------

def dense(*, n: int, m: Optional[int] = None, block_size: BlockSize = 128, heads: int = 1,
          device: Device = None) -> Tensor:
    """All-True block mask ``(1, heads, ceil(n / block_q), ceil(m / block_k))``: see :class:`Dense`."""
    return Dense().mask(n, m, block_size=block_size, heads=heads, device=device)


def causal(*, n: int, m: Optional[int] = None, block_size: BlockSize = 128, heads: int = 1,
           device: Device = None) -> Tensor:
    """Block-level causal mask ``(1, heads, ceil(n / block_q), ceil(m / block_k))``: see :class:`Causal`."""
    return Causal().mask(n, m, block_size=block_size, heads=heads, device=device)


def local(window: int, *, n: int, m: Optional[int] = None, block_size: BlockSize = 128, heads: int = 1,
          device: Device = None) -> Tensor:
    """Band of ``window`` key blocks on each side of the diagonal: see :class:`Local`."""
    return Local(window).mask(n, m, block_size=block_size, heads=heads, device=device)


def global_tokens(n_global: int, *, n: int, m: Optional[int] = None, block_size: BlockSize = 128, heads: int = 1,
                  device: Device = None) -> Tensor:
    """First ``n_global`` blocks attend to and are attended by all: see :class:`GlobalTokens`."""
    return GlobalTokens(n_global).mask(n, m, block_size=block_size, heads=heads, device=device)


def dilated(segment_lengths: Sequence[int], dilation_rates: Sequence[int], *, n: int, m: Optional[int] = None,
            block_size: BlockSize = 128, heads: int = 1, device: Device = None) -> Tensor:
    """LongNet-like dilated pattern in blocks: see :class:`Dilated`."""
    return Dilated(segment_lengths, dilation_rates).mask(n, m, block_size=block_size, heads=heads, device=device)


def hierarchical(levels: int, base: int = 2, *, n: int, m: Optional[int] = None, block_size: BlockSize = 128,
                 heads: int = 1, device: Device = None) -> Tensor:
    """Dense near the diagonal, coarser further away: see :class:`Hierarchical`."""
    return Hierarchical(levels, base).mask(n, m, block_size=block_size, heads=heads, device=device)


def random(density: float, seed: int = 0, *, n: int, m: Optional[int] = None, block_size: BlockSize = 128,
           heads: int = 1, device: Device = None) -> Tensor:
    """Seeded random blocks, ``density`` of each row: see :class:`Random`."""
    return Random(density, seed).mask(n, m, block_size=block_size, heads=heads, device=device)


def _combine(masks: Sequence[Tensor], fn: str, op) -> Tensor:
    if not masks:
        raise ValueError(f"{fn}: needs at least one mask")
    for i, mk in enumerate(masks):
        if not isinstance(mk, Tensor) or mk.dtype != torch.bool:
            raise TypeError(f"{fn}: masks must be bool tensors, mask {i} is "
                            f"{mk.dtype if isinstance(mk, Tensor) else type(mk).__name__}")
        if mk.dim() != 4:
            raise ValueError(f"{fn}: masks must have 4 dims (B, H, q_blocks, k_blocks), mask {i} has shape "
                             f"{tuple(mk.shape)}")
        if mk.device != masks[0].device:
            raise ValueError(f"{fn}: masks must be on one device, got {masks[0].device} and {mk.device}")
        if mk.shape[-2:] != masks[0].shape[-2:]:  # (a grid of 1 block would broadcast silently)
            raise ValueError(f"{fn}: masks must have the same block grid (q_blocks, k_blocks); mask 0 has "
                             f"{tuple(masks[0].shape[-2:])}, mask {i} has {tuple(mk.shape[-2:])}")
    try:
        torch.broadcast_shapes(*(mk.shape for mk in masks))
    except RuntimeError as err:
        raise ValueError(f"{fn}: masks must have the same block grid and broadcastable (B, H); got shapes "
                         f"{[tuple(mk.shape) for mk in masks]}") from err
    out = masks[0]
    for mk in masks[1:]:
        out = op(out, mk)
    return out.clone() if len(masks) == 1 else out


def union(*masks: Tensor) -> Tensor:
    """Elementwise OR of bool block masks of one block grid; the leading ``(B, H)`` dims broadcast."""
    return _combine(masks, "union", torch.logical_or)


def intersection(*masks: Tensor) -> Tensor:
    """Elementwise AND of bool block masks of one block grid; the leading ``(B, H)`` dims broadcast."""
    return _combine(masks, "intersection", torch.logical_and)
