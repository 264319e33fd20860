"""The block grid a pattern is drawn on, and the alignment of query blocks with key blocks.

Queries and keys are aligned bottom-right, as the kernels' causal mask: query ``i`` sits at key position
``i + M - N``. The *diagonal* of query block ``a`` is the range ``[lo(a), hi(a)]`` of key-block indices holding the
aligned positions of its queries; it may reach below 0 (queries aligned before the first key, when ``N > M``), where
no key block exists. The block distance of key block ``b`` from query block ``a`` is how many blocks ``b`` lies
outside that range (0 inside).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from longattn import _validation as V


def is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_int(x, name: str, fn: str, minimum: int) -> int:
    """``x`` must be an int ``>= minimum``: TypeError / ValueError naming ``name``."""
    if not is_int(x):
        raise TypeError(f"{fn}: {name} must be an int, got {x!r}")
    if x < minimum:
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}, got {x}")
    return int(x)


@dataclass(frozen=True)
class Grid:
    """``n`` queries and ``m`` keys cut into blocks of ``block_q`` and ``block_k``; ``heads`` mask heads."""

    n: int
    m: int
    block_q: int
    block_k: int
    heads: int
    device: torch.device

    @property
    def q_blocks(self) -> int:
        return -(-self.n // self.block_q)

    @property
    def k_blocks(self) -> int:
        return -(-self.m // self.block_k)

    def query_blocks(self) -> Tensor:
        """``(q_blocks, 1)`` int64 column of query-block indices."""
        return torch.arange(self.q_blocks, device=self.device)[:, None]

    def key_blocks(self) -> Tensor:
        """``(1, k_blocks)`` int64 row of key-block indices."""
        return torch.arange(self.k_blocks, device=self.device)[None, :]

    def diagonal(self) -> Tuple[Tensor, Tensor]:
        """``(lo, hi)``, each ``(q_blocks, 1)``: the key blocks holding the aligned positions of each query block's
        first and last query (floor division, so negative where they fall before the first key)."""
        a = self.query_blocks()
        shift = self.m - self.n
        first = a * self.block_q + shift
        last = torch.clamp((a + 1) * self.block_q, max=self.n) - 1 + shift
        return (torch.div(first, self.block_k, rounding_mode="floor"),
                torch.div(last, self.block_k, rounding_mode="floor"))

    def distance(self) -> Tensor:
        """``(q_blocks, k_blocks)`` block distance of each key block from each query block's diagonal."""
        lo, hi = self.diagonal()
        b = self.key_blocks()
        return torch.clamp(lo - b, min=0) + torch.clamp(b - hi, min=0)

    def max_distance(self) -> int:
        """A bound on :meth:`distance` (aligned positions lie in ``[M - N, M)``, key blocks in ``[0, k_blocks)``):
        a band or stride wider than it is the same as one of this width."""
        return self.k_blocks + self.n // self.block_k + 2

    def causal(self) -> Tensor:
        """``(q_blocks, k_blocks)``: True where the first key of the block is at or before the last query's aligned
        position (the block pairs the bottom-right causal mask does not hide entirely)."""
        return self.key_blocks() <= self.diagonal()[1]


def make_grid(n: int, m: Optional[int], block_size: Union[int, Tuple[int, int]], heads: int,
              device: Optional[Union[str, torch.device]], fn: str) -> Grid:
    """Check the grid arguments of a pattern builder (``m=None`` means ``m = n``)."""
    n = check_int(n, "n", fn, 1)
    m = n if m is None else check_int(m, "m", fn, 1)
    bq, bk = V.check_block_size(block_size, fn)
    heads = check_int(heads, "heads", fn, 1)
    try:
        device = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{fn}: device must be a torch.device or a device string, got {device!r}") from err
    return Grid(n, m, bq, bk, heads, device)
