"""Content-adaptive block selection: per query block, the key blocks whose mean-pooled keys score highest."""
from __future__ import annotations

import math
from numbers import Real
from typing import Tuple, Union

import torch
from torch import Tensor

from longattn import _validation as V
from longattn.patterns._grid import Grid, is_int


def block_means(x: Tensor, block: int) -> Tensor:
    """Mean of each block of ``block`` rows of ``x`` ``(B, L, H, D)``: ``(B, H, ceil(L / block), D)``.

    The last block averages only its real rows. float16/bfloat16 inputs are summed in float32 and give float32.
    """
    b, length, h, d = x.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    full = length // block
    if length == 0:  # no rows, no blocks
        return x.new_zeros((b, h, 0, d), dtype=acc)
    parts = []
    if full:
        parts.append(x[:, : full * block].reshape(b, full, block, h, d).sum(2, dtype=acc) / block)
    if length > full * block:
        tail = x[:, full * block:]
        parts.append(tail.sum(1, keepdim=True, dtype=acc) / tail.shape[1])
    return torch.cat(parts, 1).transpose(1, 2) if len(parts) > 1 else parts[0].transpose(1, 2)


def _ceil(x: float) -> int:
    """``ceil(x)`` of a product of a decimal fraction and a count, where float error alone may lift an integer past
    itself (``0.07 * 100 == 7.000000000000001``): within a relative 1e-9 of an integer, that integer."""
    nearest = round(x)
    return int(nearest) if abs(x - nearest) <= 1e-9 * max(1.0, abs(x)) else math.ceil(x)


def _keep_count(keep: Union[int, float], k_blocks: int) -> int:
    if is_int(keep):
        if keep < 0:
            raise ValueError(f"adaptive: keep must be an int >= 0 or a float in (0, 1], got {keep}")
        return min(int(keep), k_blocks)
    if isinstance(keep, Real) and not isinstance(keep, bool):
        if not 0.0 < float(keep) <= 1.0:
            raise ValueError(f"adaptive: keep as a fraction must be in (0, 1], got {keep}")
        return min(_ceil(float(keep) * k_blocks), k_blocks)
    raise TypeError(f"adaptive: keep must be an int >= 0 or a float in (0, 1], got {keep!r}")


@torch.no_grad()
def adaptive(q: Tensor, k: Tensor, keep: Union[int, float], block_size: Union[int, Tuple[int, int]] = 128,
             causal: bool = False) -> Tensor:
    """Select, per query block and head, the key blocks whose mean key best matches the block's mean query.

    Args:
        q: ``(B, N, Hq, D)`` queries; k: ``(B, M, Hk, D)`` keys, ``Hq % Hk == 0`` (query head ``h`` scores against
            key head ``h // (Hq // Hk)``).
        keep: how many key blocks to select per query block besides its diagonal: an int ``>= 0``, or a float in
            ``(0, 1]``, the fraction ``ceil(keep * k_blocks)`` of all key blocks (``0.07 * 100`` counts as 7, not 8).
        block_size: ``block_q = block_k``, or a pair ``(block_q, block_k)``.
        causal: only key blocks the bottom-right causal mask does not hide entirely are candidates.

    Each block of queries and of keys is mean-pooled (the ragged last block over its real rows); the score of
    (query block ``a``, key block ``b``) is ``pooled_q[a] . pooled_k[b]``. Query block ``a`` always keeps its
    diagonal key blocks (those holding the aligned positions ``i + M - N`` of its queries, as the causal mask
    aligns them: one block when ``N == M`` and ``block_q == block_k``) and adds the ``keep`` highest-scoring other
    candidates (fewer when fewer exist). Ties are broken by ``torch.topk``. The selection is not differentiated.

    Returns:
        bool block mask ``(B, Hq, ceil(N / block_q), ceil(M / block_k))`` on ``q``'s device. Cost: two mean-pools
        (one pass over ``q`` and ``k``) and a ``(q_blocks x D) @ (D x k_blocks)`` product per head, plus a top-k.
    """
    V.check_attention_inputs(q, k, k, fn="adaptive")
    causal = V.check_flag(causal, "causal", "adaptive")
    bq, bk = V.check_block_size(block_size, fn="adaptive")
    batch, n, hq, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    grid = Grid(n, m, bq, bk, hq, q.device)
    count = _keep_count(keep, grid.k_blocks)

    pooled_q = block_means(q, bq)  # (B, Hq, nq, D)
    pooled_k = block_means(k, bk)  # (B, Hk, nk, D)
    group = hq // hk
    scores = pooled_q.reshape(batch, hk, group * grid.q_blocks, d) @ pooled_k.transpose(-1, -2)
    scores = scores.view(batch, hq, grid.q_blocks, grid.k_blocks)

    lo, hi = grid.diagonal()
    b = grid.key_blocks()
    diagonal = (b >= lo) & (b <= hi)
    candidates = ~diagonal & grid.causal() if causal else ~diagonal
    selected = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
    if count:
        scores = scores.masked_fill(~candidates, -math.inf)
        top = scores.topk(count, dim=-1).indices
        selected.scatter_(-1, top, True)
        selected &= candidates
    return selected | diagonal
