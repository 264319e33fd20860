"""Block lists, the Triton kernels' form of a block mask, and their conversion from the mask in one launch.

For every query block, the ascending indices of the key blocks it visits (``kv_idx``), and, for the backward, for
every key block the query blocks that visit it (``q_idx``/``q_num``), as FlexAttention's BlockMask keeps
``kv_indices``/``kv_num_blocks`` and their transposes. Each row lists first the *partial* blocks, which the causal
band or the sequence end cuts (the kernels mask them), then the *full* ones (no mask); ``kv_num[..., 0]`` and
``kv_num[..., 1]`` count them. Blocks the causal band hides entirely are dropped: :func:`block_kind` is the rule,
the kernel twin of :meth:`longattn.patterns.Grid.causal`. Rows keep the full width (trimming them to the longest
would need its length on the host, a device sync); the kernels read only the first ``num`` entries of a row, and
the rest are left unwritten.

The conversion is one kernel launch for both directions and never synchronizes with the host, so a raw mask passed
on every call costs little; a :class:`longattn.patterns.BlockSparsePattern` caches the result as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.backends.triton.launch import MAX_GRID_YZ, on_device

_MAX_CHUNK = 1024  # mask entries one program reads per step


@dataclass(frozen=True)
class BlockLists:
    """Compressed block mask. Leading dims ``(Bm, Hm)`` are 1 where the mask broadcasts; all contiguous."""

    kv_num: Tensor  # int32 (Bm, Hm, n_qblocks, 2): partial and full key blocks of each query block
    kv_idx: Tensor  # int32 (Bm, Hm, n_qblocks, n_kblocks): their indices, partial ones first, ascending within each
    q_num: Optional[Tensor]  # int32 (Bm, Hm, n_kblocks, 2); None when converted for a forward only
    q_idx: Optional[Tensor]  # int32 (Bm, Hm, n_kblocks, n_qblocks)

    def to(self, device) -> "BlockLists":
        return BlockLists(*(None if t is None else t.to(device)
                            for t in (self.kv_num, self.kv_idx, self.q_num, self.q_idx)))

    @property
    def visited_blocks(self) -> int:
        """Number of (query block, key block) pairs the kernels visit, over the mask's leading dims (a host sync)."""
        return int(self.kv_num.sum().item())


@triton.jit
def block_kind(a, b, n, m, BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr):
    """Kind of the pair (query block ``a``, key block ``b``) for ``n`` queries and ``m`` keys (bottom-right aligned):
    0 partial (some of its pairs are masked), 1 full (none is), 2 hidden (the causal band hides all of it)."""
    full = (b + 1) * BK <= m
    visible = full | ~full  # all True, in the broadcast shape
    if CAUSAL:
        shift = m - n
        last_query = tl.minimum((a + 1) * BQ, n) - 1 + shift  # aligned position of the block's last query
        full = full & ((b + 1) * BK - 1 <= a * BQ + shift)  # its first query sees the block's last key
        visible = b * BK <= last_query
    return tl.where(visible, full.to(tl.int32), 2)


@triton.jit
def _one_list(src, src_stride, count, NUM, IDX, fixed, n, m, BQ: tl.constexpr, BK: tl.constexpr,
              CAUSAL: tl.constexpr, KNOWN: tl.constexpr, TRANSPOSED: tl.constexpr, CHUNK: tl.constexpr):
    """Write one list row: the ``count`` mask entries at ``src`` (stride ``src_stride``) are the key blocks of query
    block ``fixed`` (or, ``TRANSPOSED``, the query blocks of key block ``fixed``)."""
    offs = tl.arange(0, CHUNK)
    part_acc = tl.zeros([CHUNK], tl.int32)
    full_acc = tl.zeros([CHUNK], tl.int32)
    for c in range(0, count, CHUNK):
        j = c + offs
        ok = j < count
        allowed = ok & (tl.load(src + j.to(tl.int64) * src_stride, mask=ok, other=0) != 0)
        kind = tl.zeros([CHUNK], tl.int32)  # without lengths every allowed block is partial: always correct
        if KNOWN:
            if TRANSPOSED:
                kind = block_kind(j, fixed, n, m, BQ, BK, CAUSAL)
            else:
                kind = block_kind(fixed, j, n, m, BQ, BK, CAUSAL)
        part_acc += (allowed & (kind == 0)).to(tl.int32)
        full_acc += (allowed & (kind == 1)).to(tl.int32)
    n_part = tl.sum(part_acc, 0)
    n_full = tl.sum(full_acc, 0)
    tl.store(NUM, n_part)
    tl.store(NUM + 1, n_full)
    p_next = n_part * 0
    f_next = n_part
    for c in range(0, count, CHUNK):
        j = c + offs
        ok = j < count
        allowed = ok & (tl.load(src + j.to(tl.int64) * src_stride, mask=ok, other=0) != 0)
        kind = tl.zeros([CHUNK], tl.int32)
        if KNOWN:
            if TRANSPOSED:
                kind = block_kind(j, fixed, n, m, BQ, BK, CAUSAL)
            else:
                kind = block_kind(fixed, j, n, m, BQ, BK, CAUSAL)
        part = (allowed & (kind == 0)).to(tl.int32)
        full = (allowed & (kind == 1)).to(tl.int32)
        tl.store(IDX + p_next + tl.cumsum(part, 0) - 1, j, mask=part != 0)
        tl.store(IDX + f_next + tl.cumsum(full, 0) - 1, j, mask=full != 0)
        p_next += tl.sum(part, 0)
        f_next += tl.sum(full, 0)


@triton.jit
def _block_lists_kernel(MASK, smb, smh, sma, smb_k, KV_NUM, KV_IDX, Q_NUM, Q_IDX, n_qb, n_kb, hm, n, m,
                        BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr, KNOWN: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Programs ``(row, mask batch x head)``: rows below ``n_qb`` write the key-block list of that query block,
    the others the query-block list of key block ``row - n_qb``."""
    row = tl.program_id(0)
    bh = tl.program_id(1)
    src = MASK + (bh // hm).to(tl.int64) * smb + (bh % hm).to(tl.int64) * smh
    if row < n_qb:
        r = bh.to(tl.int64) * n_qb + row
        _one_list(src + row.to(tl.int64) * sma, smb_k, n_kb, KV_NUM + 2 * r, KV_IDX + r * n_kb, row, n, m, BQ, BK,
                  CAUSAL, KNOWN, False, CHUNK)
    else:
        col = row - n_qb
        r = bh.to(tl.int64) * n_kb + col
        _one_list(src + col.to(tl.int64) * smb_k, sma, n_qb, Q_NUM + 2 * r, Q_IDX + r * n_qb, col, n, m, BQ, BK,
                  CAUSAL, KNOWN, True, CHUNK)


def _convert(mask: Tensor, block_q: int, block_k: int, n: int, m: int, causal: bool,
             backward: bool) -> Tuple[Tensor, ...]:
    bm, hm, nq, nk = mask.shape
    dev = mask.device
    kv_num = torch.empty((bm, hm, nq, 2), dtype=torch.int32, device=dev)
    kv_idx = torch.empty((bm, hm, nq, nk), dtype=torch.int32, device=dev)
    rows_t = nk if backward else 0  # the transposed lists only serve the backward
    q_num = torch.empty((bm, hm, rows_t, 2), dtype=torch.int32, device=dev)
    q_idx = torch.empty((bm, hm, rows_t, nq), dtype=torch.int32, device=dev)
    if mask.numel() == 0:
        return kv_num, kv_idx, q_num, q_idx
    if bm * hm > MAX_GRID_YZ:
        raise ValueError(f"block_mask: at most {MAX_GRID_YZ} (batch x head) planes, got {bm} x {hm}")
    flat = mask.view(torch.uint8)
    chunk = min(_MAX_CHUNK, max(16, triton.next_power_of_2(max(nq, nk))))
    with on_device(mask):
        _block_lists_kernel[(nq + rows_t, bm * hm)](
            flat, *flat.stride(), kv_num, kv_idx, q_num, q_idx, nq, nk, hm, n, m,
            BQ=block_q, BK=block_k, CAUSAL=bool(causal), KNOWN=n > 0, CHUNK=chunk, num_warps=max(1, chunk // 256),
        )
    return kv_num, kv_idx, q_num, q_idx


@torch.library.custom_op("longattn::block_lists", mutates_args=())
def block_lists_op(mask: Tensor, block_q: int, block_k: int, n: int, m: int, causal: bool,
                   backward: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _convert(mask, block_q, block_k, n, m, causal, backward)


@block_lists_op.register_fake
def _(mask, block_q, block_k, n, m, causal, backward):
    bm, hm, nq, nk = mask.shape
    new = mask.new_empty
    rows_t = nk if backward else 0
    return (new((bm, hm, nq, 2), dtype=torch.int32), new((bm, hm, nq, nk), dtype=torch.int32),
            new((bm, hm, rows_t, 2), dtype=torch.int32), new((bm, hm, rows_t, nq), dtype=torch.int32))


def block_lists_from_mask(block_mask: Tensor, block_size: Optional[Tuple[int, int]] = None,
                          seq_lens: Optional[Tuple[int, int]] = None, causal: bool = False, *,
                          backward: bool = True) -> BlockLists:
    """Convert a bool block mask ``(Bm, Hm, n_qblocks, n_kblocks)`` (on a CUDA GPU, or the CPU under the Triton
    interpreter) into :class:`BlockLists`, in one launch and without a host sync.

    ``block_size=(block_q, block_k)``, ``seq_lens=(N, M)`` and ``causal`` let the lists tell full blocks from the
    ones the kernels must mask, and drop blocks the causal band hides; without them every allowed block is partial.
    ``backward=False`` leaves out the transposed lists (``q_num``/``q_idx`` None), which only the backward reads.
    """
    if block_mask.dim() != 4:
        raise ValueError(f"block_mask must have 4 dims (B, H, q_blocks, k_blocks), got shape {tuple(block_mask.shape)}")
    if block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must have dtype torch.bool, got {block_mask.dtype}")
    known = block_size is not None and seq_lens is not None
    bq, bk = block_size if known else (1, 1)
    n, m = seq_lens if known else (0, 0)
    args = (block_mask, int(bq), int(bk), int(n), int(m), bool(causal) and known, bool(backward))
    kv_num, kv_idx, q_num, q_idx = block_lists_op(*args) if torch.compiler.is_compiling() else _convert(*args)
    return BlockLists(kv_num, kv_idx, q_num, q_idx) if backward else BlockLists(kv_num, kv_idx, None, None)
