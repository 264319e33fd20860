"""Launchers of the decode kernels (:mod:`longattn.backends.triton.decode`): cache append, split-KV attention and
the log-sum-exp merge of the splits. Every size depends on shapes only (never on the values of ``cache_seqlens``),
so a decode step can be captured in a CUDA graph."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from longattn.backends.triton import decode as _decode
from longattn.backends.triton.launch import BandArgs, block_d, on_device
from longattn.call import Band

BLOCK_N = 64


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(batch: int, kv_heads: int, capacity: int, device: torch.device) -> int:
    """Key splits per (sequence, KV head): enough programs for two per SM, each split at least four key blocks."""
    programs = max(1, batch * kv_heads)
    want = -(-2 * _sm_count(device) // programs)
    most = max(1, -(-capacity // (4 * BLOCK_N)))
    return max(1, min(want, most, 128))


def _paged_args(block_table: Optional[Tensor], page_size: int, dummy: Tensor) -> tuple:
    if block_table is None:
        return dummy, 0, 1
    return block_table, block_table.stride(0), page_size


def append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, seqlens: Tensor, block_table: Optional[Tensor],
           page_size: int, capacity: int) -> None:
    """Write ``k``, ``v`` ``(B, Nq, Hk, D)`` into the caches at positions ``seqlens[b] + t`` (in place)."""
    B, n_new, hk, d = k.shape
    bt, bt_sb, ps = _paged_args(block_table, page_size, seqlens)
    with on_device(k):
        _decode._cache_append[(B, n_new)](
            k, v, k_cache, v_cache, seqlens, bt, *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3],
            *v_cache.stride()[:3], bt_sb, ps, k_cache.shape[0], capacity, n_new, hk,
            HEAD_D=d, BLOCK_D=block_d(d), BLOCK_H=max(1, 1 << (hk - 1).bit_length()), PAGED=block_table is not None,
        )


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor, n_extra: int, block_table: Optional[Tensor],
           page_size: int, capacity: int, band: Band, scale: float, splits: int) -> Tuple[Tensor, Tensor]:
    """Split-KV attention of q ``(B, Nq, Hq, D)`` over the first ``seqlens[b] + n_extra`` cache rows of each
    sequence: ``(out (B, Nq, Hq, D) in q's dtype, lse (B, Hq, Nq) float32)``."""
    B, n_q, hq, d = q.shape
    hk = k_cache.shape[2]
    group = hq // hk
    rows = group * n_q
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    po = torch.empty((splits, B, n_q, hq, d), device=q.device, dtype=torch.float32)
    pl = torch.empty((splits, B, hq, n_q), device=q.device, dtype=torch.float32)
    b_args = BandArgs.of(band)
    bt, bt_sb, ps = _paged_args(block_table, page_size, seqlens)
    with on_device(q):
        _decode._decode_split[(splits, B * hk, -(-rows // block_m))](
            q, k_cache, v_cache, seqlens, bt, po, pl, *q.stride()[:3], *k_cache.stride()[:3],
            *v_cache.stride()[:3], bt_sb, ps, k_cache.shape[0], capacity, n_q, n_extra, hq, hk, group, splits, scale, b_args.left, b_args.right,
            HEAD_D=d, BLOCK_D=block_d(d), BLOCK_M=block_m, BLOCK_N=BLOCK_N, HAS_LEFT=b_args.has_left,
            HAS_RIGHT=b_args.has_right, PAGED=block_table is not None, num_warps=4, num_stages=3,
        )
    if splits == 1:
        return po[0].to(q.dtype), pl[0]
    lse = torch.logsumexp(pl, dim=0)  # -inf where no split saw a key
    w = torch.exp(pl - torch.where(torch.isneginf(lse), 0.0, lse)[None])  # (S, B, Hq, Nq); 0 for empty splits
    out = (po * w.permute(0, 1, 3, 2)[..., None]).sum(0)
    return out.to(q.dtype), lse
