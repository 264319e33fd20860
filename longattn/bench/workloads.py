"""Benchmark workloads: the attention problems every implementation is measured on, sized to the sequence length.

A :class:`Workload` fixes the shapes (batch, N, heads, head_dim; self-attention, ``N == M``, no grouped-query heads)
and the pattern:

- ``dense``: full attention.
- ``causal``: causal attention.
- ``window``: causal sliding window of ``N // 8`` keys to the left (at least 16): ``window=(N // 8, 0)``.
- ``dilated``: LongNet dilated attention, rates ``(1, 2, 4, 8)``; segments ``(2048, 4096, 8192, 16384)`` when
  ``N >= 16384`` (the LongNet configuration), ``(N/8, N/4, N/2, N)`` below.
- ``block_sparse``: blocks of 128 (smaller for short sequences), a local band of ``max(1, blocks // 32)`` blocks on
  each side of the diagonal united with random blocks (5% of each row, seed 0), drawn with :mod:`longattn.patterns`.

:func:`computed_pairs` counts the (query, key) pairs each workload computes, which the FLOP counts use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

WORKLOADS = ("dense", "causal", "window", "dilated", "block_sparse")
LONGNET_SEGMENTS = (2048, 4096, 8192, 16384)
DILATION_RATES = (1, 2, 4, 8)


@dataclass(eq=False)
class Workload:
    """One attention problem: q, k, v of shape ``(batch, n, heads, head_dim)`` and a pattern ``kind``."""

    kind: str
    n: int
    batch: int
    heads: int
    head_dim: int
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    segments: Tuple[int, ...] = ()
    rates: Tuple[int, ...] = ()
    block_size: int = 0
    block_mask: Optional[Tensor] = None  # bool (1, 1, n_blocks, n_blocks), CPU
    cache: Dict[str, object] = field(default_factory=dict)  # per-device masks built by peers

    @property
    def label(self) -> str:
        return self.kind

    def describe(self) -> str:
        """Short human-readable parameters (for the report)."""
        if self.kind == "window":
            return f"causal, window {self.window[0]}"
        if self.kind == "dilated":
            return f"segments {list(self.segments)}, rates {list(self.rates)}"
        if self.kind == "block_sparse":
            return f"blocks of {self.block_size}, density {density(self):.1%}"
        return self.kind


def granularity(kind: str, n: int) -> int:
    """Sequence lengths of workload ``kind`` near ``n`` must be multiples of this (the dilated composition needs
    every segment to divide N)."""
    if kind == "dilated":
        return LONGNET_SEGMENTS[-1] if n >= LONGNET_SEGMENTS[-1] else 8
    return 1


def _block_size_for(n: int) -> int:
    if n >= 2048:
        return 128
    b = 16
    while b * 2 <= n // 16 and b < 128:
        b *= 2
    return b


def make_workload(kind: str, n: int, *, batch: int, heads: int, head_dim: int) -> Workload:
    """Workload ``kind`` (one of :data:`WORKLOADS`) at sequence length ``n``; see the module docstring."""
    if kind not in WORKLOADS:
        raise ValueError(f"make_workload: kind must be one of {WORKLOADS}, got {kind!r}")
    if not isinstance(n, int) or n < 16:
        raise ValueError(f"make_workload: n must be an int >= 16, got {n!r}")
    common = dict(kind=kind, n=n, batch=batch, heads=heads, head_dim=head_dim)
    if kind == "dense":
        return Workload(**common)
    if kind == "causal":
        return Workload(**common, causal=True)
    if kind == "window":
        return Workload(**common, causal=True, window=(max(16, n // 8), 0))
    if kind == "dilated":
        if n % granularity(kind, n):
            raise ValueError(f"make_workload: dilated needs n to be a multiple of {granularity(kind, n)}, got {n}")
        segments = LONGNET_SEGMENTS if n >= LONGNET_SEGMENTS[-1] else (n // 8, n // 4, n // 2, n)
        return Workload(**common, segments=tuple(segments), rates=DILATION_RATES)
    bs = _block_size_for(n)
    n_blocks = -(-n // bs)
    from longattn import patterns

    pattern = patterns.Local(max(1, n_blocks // 32)) | patterns.Random(0.05, seed=0)
    mask = pattern.mask(n, block_size=bs, heads=1, device="cpu")
    return Workload(**common, block_size=bs, block_mask=mask)


def _causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def _dilated_pairs(w: Workload) -> int:
    """Pairs summed over branches, heads and segments (a pair that two branches share counts twice: each branch
    computes it)."""
    total = 0
    n = w.n
    for seg, r in zip(w.segments, w.rates):
        seg = min(seg, n)
        full, rest = divmod(n, seg)
        lengths = [seg] * full + ([rest] if rest else [])
        for h in range(w.heads):
            o = h % r
            for length in lengths:
                selected = max(0, -(-(length - o) // r))
                total += _causal_pairs(selected) if w.causal else selected * selected
    return total


def _block_sparse_pairs(w: Workload) -> int:
    bs, n = w.block_size, w.n
    sizes = torch.full((-(-n // bs),), bs, dtype=torch.int64)
    sizes[-1] = n - bs * (sizes.numel() - 1)
    area = sizes[:, None] * sizes[None, :]
    per_head = int((w.block_mask[0, 0].to(torch.int64) * area).sum())
    return per_head * w.heads


def computed_pairs(w: Workload) -> int:
    """(query, key) pairs per batch element, summed over heads, that the workload computes.

    Dense: ``H N^2``; causal: ``H N^2 / 2`` (FlashAttention's convention); window: the exact band; dilated: every
    branch's selected pairs; block-sparse: the area of the allowed blocks.
    """
    n, h = w.n, w.heads
    if w.kind == "dense":
        return h * n * n
    if w.kind == "causal":
        return h * n * n // 2
    if w.kind == "window":
        left = w.window[0]
        # query i sees keys max(0, i - left) .. i
        head = min(n, left + 1)  # queries 0 .. left see all keys up to themselves
        band = head * (head + 1) // 2 + max(0, n - head) * (left + 1)
        return h * band
    if w.kind == "dilated":
        return _dilated_pairs(w)
    return _block_sparse_pairs(w)


def density(w: Workload) -> float:
    """Computed pairs over the dense ``H N^2``."""
    return computed_pairs(w) / float(w.heads * w.n * w.n)


def forward_flops(w: Workload) -> float:
    """FlashAttention's forward count, ``4 * B * D * pairs`` (two matmuls of 2 FLOPs per multiply-add)."""
    return 4.0 * w.batch * w.head_dim * computed_pairs(w)


def pass_flops(w: Workload, pass_: str) -> float:
    """FLOPs of ``pass_`` (``fwd``, or ``fwd_bwd`` = 3.5x forward: the backward counts 2.5x the forward)."""
    f = forward_flops(w)
    return f if pass_ == "fwd" else 3.5 * f


def make_inputs(w: Workload, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """Random q, k, v ``(B, N, H, D)`` for ``w`` (drawn on ``device``, seeded)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (w.batch, w.n, w.heads, w.head_dim)
    return tuple(torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3))
