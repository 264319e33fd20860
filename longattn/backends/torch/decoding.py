"""KV-cache calls on PyTorch operations (the PyTorch backend's ``decode``), batched: no loop over sequences and no
host synchronisation on a GPU. The semantics are :func:`longattn.reference.flash_attention_with_kvcache` and
:func:`longattn.reference.dilated_attention_with_kvcache`."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from longattn._autograd import writes_into
from longattn._validation import FP8_DTYPES, has_values
from longattn.backends import sdpa as sdpa_backend
from longattn.call import AttentionCall, Band, Branch, accumulator_dtype, dequantize, modify_scores


def decode(q: Tensor, call: AttentionCall, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """A KV-cache call (``call.cache``): ``(out (B, Nq, Hq, D) in q's dtype, lse (B, Hq, Nq) or None)``. Float8
    caches are dequantised and computed in float32."""
    c = call.cache
    pattern = call.branches or call.band
    qc = q if c.descales is None else q.float()
    o, lse = _decode(qc, c.k_cache, c.v_cache, c.k_new, c.v_new, c.seqlens, c.block_table, pattern, call.scale,
                     return_lse, c.descales, call.softcap, call.alibi)
    o = c.out.copy_(o) if c.out is not None else o.to(q.dtype)
    return o, lse


def write_cache(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, start: Tensor,
                block_table: Optional[Tensor] = None) -> None:
    """Write ``k``, ``v`` ``(B, N, Hk, D)`` into the caches at logical rows ``start[b] .. start[b] + N - 1`` of each
    sequence (contiguous caches, or paged through ``block_table``), in place, in PyTorch (a prompt's keys after
    prefill; the Triton path appends inside its kernels). The rows must lie within the capacity."""
    B, n = k.shape[:2]
    pos = start.long()[:, None] + torch.arange(n, device=k.device)  # (B, N)
    if block_table is None:
        at = (torch.arange(B, device=k.device)[:, None], pos)
    else:
        at = (block_table.long().gather(1, pos // k_cache.shape[1]), pos % k_cache.shape[1])
    with writes_into(k_cache, v_cache):
        _raw(k_cache)[at], _raw(v_cache)[at] = _raw(k), _raw(v)


def _raw(x: Tensor) -> Tensor:
    """Float8 tensors as their bytes (indexing kernels do not take float8 on every device); others unchanged."""
    return x.view(torch.uint8) if x.dtype in FP8_DTYPES else x


def _cache_rows(cache: Tensor, block_table: Optional[Tensor], batch: int) -> Tensor:
    """Each sequence's logical rows ``(B, capacity, Hk, D)``: the cache itself, or its pages gathered in order."""
    if block_table is None:
        return cache
    return _raw(cache)[block_table.long()].reshape(batch, -1, *cache.shape[2:]).view(cache.dtype)


def _decode(q, k_cache, v_cache, k, v, seqlens, block_table, pattern, scale, need_lse, descales=None, softcap=0.0,
            alibi=None):
    """The PyTorch backend, batched (no loop over sequences, no host synchronisation): append in place, then SDPA
    over each sequence's logical rows under a mask of the valid keys and the band (or LongNet's branches, see
    :func:`_dilated_torch`); the log-sum-exp, when asked for, from the scores of the few new tokens. Float8 caches
    (``descales``: their factors) are dequantised to float32 rows (``q`` is then float32 too). With soft-capping or
    ALiBi (slopes ``(B, Hq)``) the scores are computed explicitly (:func:`_modified_decode`)."""
    B, n_q, hq, d = q.shape
    dev = q.device
    t = torch.arange(n_q, device=dev)
    if k is not None:
        write_cache(k_cache, v_cache, k, v, seqlens, block_table)
    n_keys = seqlens.long() + (n_q if k is not None else 0)  # (B,)
    # on a CPU reading values costs nothing (a meta or fake tensor has none; a traced one is read by no Python)
    used = (None if q.is_cuda or torch.compiler.is_compiling() or not has_values(n_keys)
            else max(1, int(n_keys.max())))
    shortest = None if used is None else int(n_keys.min())
    if used is not None and block_table is not None:
        block_table = block_table[:, :-(-used // k_cache.shape[1])]  # only the pages some sequence uses
    keys, values = _cache_rows(k_cache, block_table, B), _cache_rows(v_cache, block_table, B)
    if used is not None:
        keys, values = keys[:, :used], values[:, :used]
    if descales is not None:
        keys, values = (dequantize(x, f.expand(B, x.shape[2])) for x, f in zip((keys, values), descales))
    if used is None or shortest < used:
        # Rows past a sequence's length are no keys of the call and may hold anything (an uninitialised cache or a
        # reused page): their probability is 0, but 0 x NaN is NaN, so their values are zeroed (their scores are
        # masked to -inf below, which no NaN survives).
        live = torch.arange(values.shape[1], device=dev) < n_keys[:, None]  # (B, M)
        values = torch.where(live[:, :, None, None], values, torch.zeros((), dtype=values.dtype, device=dev))
    pos = n_keys[:, None] - n_q + t  # (B, Nq): key position of each new token
    if not isinstance(pattern, Band):
        return _dilated_torch(q, keys, values, pos, pattern, scale, need_lse)
    band = pattern
    if used is not None and not softcap and alibi is None:
        if shortest == used and (band.right is None or band.right >= n_q - 1) and (
                band.left is None or band.left >= used - 1):  # every new token sees every key: no mask
            return _sdpa_decode(q, keys, values, None, scale), (_lse(q, keys, None, scale) if need_lse else None)
    j = torch.arange(keys.shape[1], device=dev)
    i = pos[:, :, None]
    ok = j < n_keys[:, None, None]
    if band.right is not None:
        ok = ok & (j <= i + band.right)
    if band.left is not None:
        ok = ok & (j >= i - band.left)
    mask = ok[:, None]  # (B, 1, Nq, M)
    if softcap or alibi is not None:
        return _modified_decode(q, keys, values, mask, (i - j).abs(), scale, softcap, alibi, need_lse)
    any_key = mask.any(-1, keepdim=True)  # (B, 1, Nq, 1)
    o = _sdpa_decode(q, keys, values, mask | ~any_key, scale)  # a row without keys attends to all, then is 0
    o = torch.where(any_key.transpose(1, 2), o, 0.0)
    return o, (_lse(q, keys, mask, scale) if need_lse else None)


def _modified_decode(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, distance: Tensor, scale: float,
                     softcap: float, alibi: Optional[Tensor], need_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Decode with soft-capped or ALiBi scores: the scores of the new tokens against every key, modified
    (:func:`longattn.call.modify_scores`; ``distance`` ``(B, Nq, M)``), masked (``mask`` ``(B, 1, Nq, M)``), softmax
    and the weighted values; a token without keys gives 0 and lse ``-inf``."""
    B, n_q, hq, d = q.shape
    hk = keys.shape[2]
    acc = accumulator_dtype(q.dtype)
    qg = q.transpose(1, 2).to(acc).reshape(B, hk, (hq // hk) * n_q, d)  # the query heads of a group, stacked
    s = (torch.matmul(qg, keys.transpose(1, 2).to(acc).transpose(-1, -2)) * scale).view(B, hq, n_q, keys.shape[1])
    s = modify_scores(s, softcap, None if alibi is None else alibi[:, :, None, None], distance[:, None])
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Nq), -inf without keys
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.matmul(p.view(B, hk, -1, keys.shape[1]), values.transpose(1, 2).to(acc)).view(B, hq, n_q, d)
    return out.transpose(1, 2).contiguous().to(q.dtype), (lse if need_lse else None)


def _sdpa_decode(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """SDPA of q ``(B, Nq, Hq, D)`` over ``(B, M, Hk, D)`` keys and values under a ``(B, 1, Nq, M)`` mask, as
    ``(B, Nq, Hq, D)``."""
    o = sdpa_backend.grouped_sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                  scale=scale)
    return o.transpose(1, 2).contiguous()


def _lse(q: Tensor, keys: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """Log-sum-exp ``(B, Hq, Nq)`` of the scores of each query head against its KV head (-inf without keys)."""
    B, n_q, hq, d = q.shape
    hk = keys.shape[2]
    acc = accumulator_dtype(q.dtype)
    qg = q.transpose(1, 2).to(acc).reshape(B, hk, (hq // hk) * n_q, d)  # the query heads of a group, stacked
    s = (torch.matmul(qg, keys.transpose(1, 2).to(acc).transpose(-1, -2)) * scale).view(B, hq, n_q, keys.shape[1])
    return torch.logsumexp(s if mask is None else s.masked_fill(~mask, float("-inf")), dim=-1)


def _dilated_torch(q: Tensor, keys: Tensor, values: Tensor, pos: Tensor, branches: Tuple[Branch, ...], scale: float,
                   need_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """LongNet decode in PyTorch: the scores of the new tokens against every key once, then per branch a mask of
    the pairs it allows (query and key selected, same segment, key at or before the query), softmax and log-sum-exp,
    and the branches merged by log-sum-exp. ``pos`` ``(B, Nq)``: each token's position."""
    B, n_q, hq, d = q.shape
    hk = keys.shape[2]
    acc = accumulator_dtype(q.dtype)
    qg = q.transpose(1, 2).to(acc).reshape(B, hk, (hq // hk) * n_q, d)  # the query heads of a group, stacked
    kt, vt = keys.transpose(1, 2).to(acc), values.transpose(1, 2).to(acc)  # (B, Hk, M, D)
    s = (torch.matmul(qg, kt.transpose(-1, -2)) * scale).view(B, hq, n_q, keys.shape[1])
    j = torch.arange(keys.shape[1], device=q.device)
    heads = torch.arange(hq, device=q.device)
    p = pos.clamp(min=0)
    outs, lses = [], []
    for br in branches:
        w, r = br.segment, br.dilation
        active = (heads >= br.head_start) & (heads < br.head_start + br.n_heads)  # (Hq,)
        o = heads % r if br.offset is None else torch.full_like(heads, br.offset)
        in_q, in_k = (p % w)[:, None, :], (j % w)[None, None, None, :]  # (B, 1, Nq), (1, 1, 1, M)
        sel_q = active[None, :, None] & (pos >= 0)[:, None, :] & (in_q >= o[None, :, None]) & (
            (in_q - o[None, :, None]) % r == 0)  # (B, Hq, Nq)
        sel_k = (in_k >= o[None, :, None, None]) & ((in_k - o[None, :, None, None]) % r == 0)  # (1, Hq, 1, M)
        same = (j[None, None, :] // w == (p // w)[:, :, None]) & (j[None, None, :] <= pos[:, :, None])  # (B, Nq, M)
        allowed = sel_q[..., None] & sel_k & same[:, None]
        sb = s.masked_fill(~allowed, float("-inf"))
        lse_b = torch.logsumexp(sb, dim=-1)  # (B, Hq, Nq)
        prob = torch.exp(sb - torch.where(torch.isneginf(lse_b), 0.0, lse_b)[..., None])
        outs.append(torch.matmul(prob.view(B, hk, -1, keys.shape[1]), vt).view(B, hq, n_q, d))
        lses.append(lse_b)
    lse_all = torch.stack(lses)  # (branches, B, Hq, Nq)
    lse = torch.logsumexp(lse_all, dim=0)
    wts = torch.exp(lse_all - torch.where(torch.isneginf(lse), 0.0, lse)[None])  # 0 for a branch without keys
    out = (wts[..., None] * torch.stack(outs)).sum(0)  # (B, Hq, Nq, D)
    return out.transpose(1, 2).contiguous().to(q.dtype), (lse if need_lse else None)
