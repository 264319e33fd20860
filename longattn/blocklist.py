"""Block lists: the kernels' form of a block mask.

For every query block, the ascending indices of the key blocks it visits (``kv_idx``, padded with 0 past
``kv_num``), and, for the backward, for every key block the query blocks that visit it (``q_idx``/``q_num``).
These mirror FlexAttention's BlockMask ``kv_indices``/``kv_num_blocks`` and their transposes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockLists:
    """Compressed block mask. Leading dims ``(Bm, Hm)`` are 1 where the mask broadcasts."""

    kv_num: Tensor  # int32 (Bm, Hm, n_qblocks)
    kv_idx: Tensor  # int32 (Bm, Hm, n_qblocks, max_kv)
    q_num: Tensor  # int32 (Bm, Hm, n_kblocks)
    q_idx: Tensor  # int32 (Bm, Hm, n_kblocks, max_q)

    @property
    def shape(self):
        return (self.kv_num.shape[0], self.kv_num.shape[1], self.kv_num.shape[2], self.q_num.shape[2])

    def to(self, device) -> "BlockLists":
        return BlockLists(*(t.to(device) for t in (self.kv_num, self.kv_idx, self.q_num, self.q_idx)))


def _rows_to_lists(mask: Tensor):
    """For each row of a bool ``(..., R, C)`` mask: count of True and their column indices, ascending."""
    mask = mask.bool()
    num = mask.sum(-1, dtype=torch.int32)
    width = max(int(num.max().item()) if num.numel() else 0, 1)
    # True entries sort first (key 0), each group in ascending column order (stable sort).
    keys = (~mask).to(torch.uint8)
    order = torch.sort(keys, dim=-1, stable=True).indices[..., :width].to(torch.int32)
    valid = torch.arange(width, device=mask.device) < num[..., None]
    idx = torch.where(valid, order, torch.zeros_like(order))
    return num.contiguous(), idx.contiguous()


def block_lists_from_mask(block_mask: Tensor) -> BlockLists:
    """Convert a bool block mask ``(Bm, Hm, n_qblocks, n_kblocks)`` into :class:`BlockLists`."""
    if block_mask.dim() != 4:
        raise ValueError(f"block_mask must have 4 dims (B, H, q_blocks, k_blocks), got shape {tuple(block_mask.shape)}")
    kv_num, kv_idx = _rows_to_lists(block_mask)
    q_num, q_idx = _rows_to_lists(block_mask.transpose(-1, -2))
    return BlockLists(kv_num, kv_idx, q_num, q_idx)


def refine_block_mask(block_mask: Tensor, block_size, tile_size) -> Tensor:
    """Re-express a block mask of ``block_size=(bq, bk)`` on tiles ``(tq, tk)`` that divide the blocks.

    Each block of the mask covers ``bq // tq`` query tiles and ``bk // tk`` key tiles, so the refined mask is the
    original with rows and columns repeated; its last tiles may lie past the sequence end (the kernels mask them).
    """
    (bq, bk), (tq, tk) = block_size, tile_size
    if bq % tq or bk % tk:
        raise ValueError(f"tile size {tile_size} must divide the mask's block size {block_size}")
    return block_mask.repeat_interleave(bq // tq, dim=-2).repeat_interleave(bk // tk, dim=-1)
