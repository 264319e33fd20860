"""Block lists: the kernels' form of a block mask.

For every query block, the ascending indices of the key blocks it visits (``kv_idx``), and, for the backward, for
every key block the query blocks that visit it (``q_idx``/``q_num``), as FlexAttention's BlockMask keeps
``kv_indices``/``kv_num_blocks`` and their transposes. Each row lists first the *partial* blocks, which the causal
band or the sequence end cuts (the kernels mask them), then the *full* ones (no mask); ``kv_num[..., 0]`` and
``kv_num[..., 1]`` count them. Blocks that the causal band hides entirely are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockLists:
    """Compressed block mask. Leading dims ``(Bm, Hm)`` are 1 where the mask broadcasts."""

    kv_num: Tensor  # int32 (Bm, Hm, n_qblocks, 2): partial and full key blocks of each query block
    kv_idx: Tensor  # int32 (Bm, Hm, n_qblocks, width): their indices, partial ones first, ascending within each
    q_num: Tensor  # int32 (Bm, Hm, n_kblocks, 2)
    q_idx: Tensor  # int32 (Bm, Hm, n_kblocks, width)

    def to(self, device) -> "BlockLists":
        return BlockLists(*(t.to(device) for t in (self.kv_num, self.kv_idx, self.q_num, self.q_idx)))

    @property
    def visited_blocks(self) -> int:
        """Number of (query block, key block) pairs the kernels visit, over the mask's leading dims."""
        return int(self.kv_num.sum().item())


def _rows_to_lists(kind: Tensor):
    """Rows of ``kind`` (0 partial, 1 full, 2 absent) to counts ``(..., 2)`` and indices, partial first."""
    num = torch.stack([(kind == 0).sum(-1, dtype=torch.int32), (kind == 1).sum(-1, dtype=torch.int32)], -1)
    total = num.sum(-1)
    # Rows keep the full width: trimming to the longest row would need its length on the host (a device sync);
    # the kernels read only the first ``total`` entries of a row.
    order = torch.sort(kind.to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    valid = torch.arange(kind.shape[-1], device=kind.device) < total[..., None]
    idx = torch.where(valid, order, torch.zeros_like(order))
    return num.contiguous(), idx.contiguous()


def block_kinds(block_mask: Tensor, block_size: Optional[Tuple[int, int]] = None,
                seq_lens: Optional[Tuple[int, int]] = None, causal: bool = False) -> Tensor:
    """Classify each block pair: 0 partial (needs a mask), 1 full, 2 not visited.

    Without ``block_size`` and ``seq_lens`` every allowed block counts as partial, which is always correct.
    """
    mask = block_mask.bool()
    if block_size is None or seq_lens is None:
        return torch.where(mask, 0, 2).to(torch.uint8)
    (bq, bk), (n, m) = block_size, seq_lens
    nq, nk = mask.shape[-2:]
    a = torch.arange(nq, device=mask.device)[:, None]
    b = torch.arange(nk, device=mask.device)[None, :]
    full = (b + 1) * bk <= m
    visible = torch.ones_like(full)
    if causal:
        shift = m - n
        full = full & ((b + 1) * bk - 1 <= a * bq + shift)  # last key of the block seen by the first query
        visible = b * bk <= (a + 1) * bq - 1 + shift  # first key seen by the last query
    kind = full.to(torch.uint8).expand(mask.shape)  # 1 full, 0 partial
    return torch.where(mask & visible, kind, 2).to(torch.uint8)


def block_lists_from_mask(block_mask: Tensor, block_size: Optional[Tuple[int, int]] = None,
                          seq_lens: Optional[Tuple[int, int]] = None, causal: bool = False) -> BlockLists:
    """Convert a bool block mask ``(Bm, Hm, n_qblocks, n_kblocks)`` into :class:`BlockLists`.

    ``block_size=(block_q, block_k)``, ``seq_lens=(N, M)`` and ``causal`` let the lists tell full blocks from the
    ones the kernels must mask, and drop blocks the causal band hides.
    """
    if block_mask.dim() != 4:
        raise ValueError(f"block_mask must have 4 dims (B, H, q_blocks, k_blocks), got shape {tuple(block_mask.shape)}")
    kind = block_kinds(block_mask, block_size, seq_lens, causal)
    kv_num, kv_idx = _rows_to_lists(kind)
    q_num, q_idx = _rows_to_lists(kind.transpose(-1, -2))
    return BlockLists(kv_num, kv_idx, q_num, q_idx)
