"""Tables of a packed batch for the Gluon kernels, computed on the GPU from ``cu_seqlens`` without a host sync."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def query_blocks_before(cu_q: Tensor, block_m: int) -> Tensor:
    """int32 ``(batch + 1,)``: entry ``b`` counts the query blocks of ``block_m`` rows of the sequences before
    ``b`` of a packed batch (the last entry: all of them), computed on the GPU without a host sync."""
    blocks = torch.div(torch.diff(cu_q) + (block_m - 1), block_m, rounding_mode="floor")
    return torch.nn.functional.pad(torch.cumsum(blocks, 0, dtype=torch.int32), (1, 0))


def work_table(cu_q: Tensor, cu_k: Tensor, q_blocks: Tensor, total_k: int, block_m: int, block_n: int,
               left: Optional[int], right: Optional[int]) -> Tensor:
    """The programs of a packed batch, int32 ``(3, n_work)``: per program its sequence (-1: nothing to do), key
    block and the first column of the sequence's statistics (``q_blocks[s] * block_m``), the programs with the most
    query rows to walk first (so the longest columns do not end last). ``n_work`` bounds the key blocks from the
    shapes alone (``total_k // block_n + sequences``), so nothing waits for the GPU."""
    n = cu_k.numel() - 1
    len_q, len_k = torch.diff(cu_q.long()), torch.diff(cu_k.long())
    before = torch.nn.functional.pad(torch.cumsum(-(-len_k // block_n), 0), (1, 0))
    w = torch.arange(total_k // block_n + n, device=cu_k.device)
    seq = torch.searchsorted(before[1:], w, right=True)
    valid = seq < n
    s = seq.clamp(max=n - 1)
    p = w - before[s]
    shift = len_k[s] - len_q[s]
    lo = (p * block_n - shift - right).clamp(min=0) if right is not None else torch.zeros_like(p)
    hi = len_q[s] if left is None else torch.minimum(len_q[s], p * block_n + block_n - shift + left)
    work = torch.where(valid, (hi - lo).clamp(min=0), -1)
    order = torch.argsort(work, descending=True, stable=True)
    table = torch.stack([torch.where(valid, s, -1), p, q_blocks.long()[s] * block_m])
    return table[:, order].to(torch.int32).contiguous()
