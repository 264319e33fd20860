"""Plain PyTorch reference implementations: the specification of every operation in longattn.

Written to be read, not to be fast: each function builds the full score matrix and an explicit boolean mask of
which (query, key) pairs may attend, then applies a masked softmax. They compute in the input dtype (the tests use
float64) and are differentiable. A query with no allowed key outputs 0 and has log-sum-exp ``-inf`` (and zero
gradients, never NaN).

Shapes are batch-first: q ``(B, N, Hq, D)``, k and v ``(B, M, Hk, D)`` with ``Hq % Hk == 0``; query head ``h``
reads key/value head ``h // (Hq // Hk)``. The log-sum-exp (``return_lse=True``) has shape ``(B, Hq, N)``, dtype
float64 for float64 inputs and float32 otherwise.

Non-finite inputs follow IEEE arithmetic, as in ``F.scaled_dot_product_attention``: a score of ``+inf`` or NaN
among the keys a query may attend makes that query's output NaN and its log-sum-exp NaN (``+inf`` where the
non-finite scores are ``+inf``; never ``-inf``, which means "no key"); a score of ``-inf`` is a key of
weight 0 (a query whose allowed scores are all ``-inf`` sees no key: output 0, lse ``-inf``). The score of a key the
query may not attend never affects it, whatever its value. Values ``v`` must be finite: an infinite entry gives NaN
(``0 * inf``) to queries that give its key weight 0.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from longattn import _validation as V

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache", "dilated_attention",
           "dilated_attention_varlen", "dilated_attention_with_kvcache", "block_sparse_attention", "masked_attention",
           "flash_mask", "varlen_mask", "dilated_branch_selection", "head_groups", "cache_rows", "dequantize_fp8",
           "alibi_distance", "safe_logsumexp"]


def flash_mask(n: int, m: int, causal: bool = False, window: Tuple[int, int] = (-1, -1),
               device=None) -> Tensor:
    """Bool ``(N, M)``: which keys each query may see, bottom-right aligned.

    Query ``i`` sits at key position ``i + M - N``. ``causal`` allows keys ``j <= i + M - N``; ``window=(left,
    right)`` allows ``i + M - N - left <= j <= i + M - N + right`` (``-1``: unbounded on that side).
    """
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None, :]
    allowed = torch.ones(n, m, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


def safe_logsumexp(x: Tensor, dim: int) -> Tensor:
    """``logsumexp`` that is ``-inf`` (with zero, not NaN, gradients) where every entry is ``-inf``."""
    live = (~torch.isneginf(x)).any(dim=dim, keepdim=True)
    lse = torch.logsumexp(x.masked_fill(~live, 0.0), dim=dim, keepdim=True)
    return lse.masked_fill(~live, float("-inf")).squeeze(dim)


def alibi_distance(n: int, m: int, device=None) -> Tensor:
    """``(N, M)``: ``|i + M - N - j|``, how far key ``j`` lies from query ``i``'s key position (bottom-right
    aligned, as the masks); ALiBi subtracts ``slope * distance`` from the score."""
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None, :]
    return (i - j).abs()


def masked_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float,
                     sinks: Optional[Tensor] = None, softcap: float = 0.0, alibi: Optional[Tensor] = None,
                     distance: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention restricted to ``allowed`` (broadcastable to ``(B, Hq, N, M)``): ``(out, lse)``.

    ``sinks`` ``(Hq,)`` (attention sinks, gpt-oss): every query of head ``h`` has one more entry in its softmax, of
    score ``sinks[h]`` and no value; the log-sum-exp counts it. A query that sees no key then outputs 0 with
    log-sum-exp ``sinks[h]``.

    The scores ``s = scale * q.k`` are first soft-capped, ``softcap * tanh(s / softcap)`` (``softcap`` > 0), then
    ALiBi subtracts ``alibi[b, h] * distance[i, j]`` (``alibi`` ``(B, Hq)`` slopes, ``distance`` ``(N, M)``), and
    only then are the pairs ``allowed`` does not allow removed."""
    hq, hk = q.shape[2], k.shape[2]
    group = hq // hk if hk else 1
    k = k.repeat_interleave(group, dim=2)  # grouped-query: head h reads key/value head h // (Hq // Hk)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        scores = scores - alibi.to(scores.dtype)[:, :, None, None] * distance.to(scores.dtype)
    scores = scores.masked_fill(~allowed, float("-inf"))  # replaced, so a masked key's value never matters
    if sinks is not None:  # one more column: the sink's score, no value
        sink_column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        lse = safe_logsumexp(torch.cat([scores, sink_column], dim=-1), dim=-1)
        probs = torch.exp(scores - _no_keys_to_zero(lse)[..., None])
        return torch.einsum("bhnm,bmhd->bnhd", probs, v), lse
    lse = safe_logsumexp(scores, dim=-1)  # -inf where a row allows nothing; +inf or NaN from a +inf or NaN score
    probs = torch.exp(scores - _no_keys_to_zero(lse)[..., None])  # exp(-inf) = 0 for the masked entries
    out = torch.einsum("bhnm,bmhd->bnhd", probs, v)
    return out, lse


def _no_keys_to_zero(lse: Tensor) -> Tensor:
    """``lse`` with the ``-inf`` of rows that see no key replaced by 0 (their weights are then exp(-inf) = 0).

    Only ``-inf`` is replaced: a ``+inf`` or NaN log-sum-exp (a row with a ``+inf`` or NaN score among its allowed
    keys) stays, so that row's output is NaN, as IEEE arithmetic and ``F.scaled_dot_product_attention`` give.
    """
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _result(out: Tensor, lse: Tensor, return_lse: bool):
    lse = lse if lse.dtype == torch.float64 else lse.float()
    return (out, lse) if return_lse else out


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, window: Tuple[int, int] = (-1, -1),
                    scale: Optional[float] = None, return_lse: bool = False, sinks: Optional[Tensor] = None,
                    softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None):
    """Reference of :func:`longattn.flash_attention`: q ``(B, N, Hq, D)``, k/v ``(B, M, Hk, D)`` -> out
    ``(B, N, Hq, D)`` (and lse ``(B, Hq, N)``), with the mask of :func:`flash_mask` (and the ``sinks``,
    ``softcap`` and ALiBi slopes ``(Hq,)`` or ``(B, Hq)`` of :func:`masked_attention`)."""
    fn = "reference.flash_attention"
    V.check_attention_inputs(q, k, v, fn=fn)
    window = V.check_window(window, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    sinks = V.check_sinks(sinks, q.shape[2], q.device, fn=fn)
    softcap = V.check_softcap(softcap, fn=fn)
    alibi = V.check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device, fn=fn)
    allowed = flash_mask(q.shape[1], k.shape[1], causal, window, device=q.device)
    out, lse = masked_attention(q, k, v, allowed, scale, sinks, softcap, alibi,
                                alibi_distance(q.shape[1], k.shape[1], q.device))
    return _result(out, lse, return_lse)


def dequantize_fp8(x: Tensor, descale: Optional[Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
    """The true values of FP8 ``x (B, S, H, D)`` in ``dtype``: ``x * descale``, ``descale`` being one factor
    ``(1,)`` for the whole tensor or one per (batch, key/value head) ``(B, Hk)`` (FlashAttention-3's convention;
    query head ``h`` of a group of ``H // Hk`` uses factor ``h // (H // Hk)``); None is a factor of 1. The FP8 form
    of an operation is the operation on these values."""
    x = x.to(dtype)
    if descale is None:
        return x
    descale = descale.to(dtype)
    if descale.shape == (1,):
        return x * descale
    b, hk = descale.shape
    factors = torch.stack([descale[:, h // (x.shape[2] // hk)] for h in range(x.shape[2])], dim=1)  # (B, H)
    return x * factors[:, None, :, None]


def varlen_mask(cu_seqlens_q: Sequence[int], cu_seqlens_k: Sequence[int], causal: bool = False,
                window: Tuple[int, int] = (-1, -1), device=None) -> Tensor:
    """Bool ``(total_q, total_k)`` of packed sequences: query row ``i`` of sequence ``b`` (rows
    ``cu_q[b]:cu_q[b+1]``) may see key row ``j`` only if ``j`` is in the same sequence (rows ``cu_k[b]:cu_k[b+1]``)
    and, within it, :func:`flash_mask` allows the pair (bottom-right aligned per sequence)."""
    total_q, total_k = cu_seqlens_q[-1], cu_seqlens_k[-1]
    allowed = torch.zeros(total_q, total_k, dtype=torch.bool, device=device)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]
        allowed[q0:q1, k0:k1] = flash_mask(q1 - q0, k1 - k0, causal, window, device=device)
    return allowed


def flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           causal: bool = False, window: Tuple[int, int] = (-1, -1), scale: Optional[float] = None,
                           return_lse: bool = False, sinks: Optional[Tensor] = None, softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None):
    """Reference of packed variable-length attention: q ``(total_q, Hq, D)``, k/v ``(total_k, Hk, D)``; sequence
    ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]`` and attends only within itself, with the mask of
    :func:`varlen_mask`. Returns out ``(total_q, Hq, D)`` (and lse ``(Hq, total_q)``); rows that see no key give 0
    and lse ``-inf``. Each sequence is computed on its own tensors, so that nothing of another sequence, a
    non-finite value included (``0 * inf`` in a product over the whole packed batch), reaches its results or its
    gradients."""
    fn = "reference.flash_attention_varlen"
    cu_q, cu_k = V.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, fn=fn)
    window = V.check_window(window, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    sinks = V.check_sinks(sinks, q.shape[1], q.device, fn=fn)
    softcap = V.check_softcap(softcap, fn=fn)
    alibi = V.check_alibi(alibi_slopes, len(cu_q) - 1, q.shape[1], q.device, fn=fn)
    outs, lses = [q[:0] * 0], [q.new_empty((q.shape[1], 0))]  # (a batch without sequences: empty results)
    for b in range(len(cu_q) - 1):
        n, m = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out, lse = masked_attention(q[None, rows], k[None, cols], v[None, cols],
                                    flash_mask(n, m, causal, window, device=q.device), scale, sinks, softcap,
                                    None if alibi is None else alibi[b:b + 1], alibi_distance(n, m, q.device))
        outs.append(out[0])
        lses.append(lse[0])
    return _result(torch.cat(outs, 0), torch.cat(lses, 1), return_lse)


def cache_rows(cache: Tensor, b: int, n: int, block_table: Optional[Tensor] = None) -> Tensor:
    """The first ``n`` logical rows ``(n, Hk, D)`` of sequence ``b`` in a contiguous cache ``(B, M, Hk, D)`` or a
    paged one ``(pages, page_size, Hk, D)`` whose block table ``(B, max_pages)`` maps logical page ``i`` of
    sequence ``b`` to physical page ``block_table[b, i]``."""
    if block_table is None:
        return cache[b, :n]
    pos = torch.arange(n, device=cache.device)
    page_size = cache.shape[1]
    return cache[block_table[b, pos // page_size].long(), pos % page_size]


def flash_attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                                 v: Optional[Tensor] = None, *, cache_seqlens, block_table: Optional[Tensor] = None,
                                 causal: bool = True, window: Tuple[int, int] = (-1, -1),
                                 scale: Optional[float] = None, return_lse: bool = False,
                                 sinks: Optional[Tensor] = None, softcap: float = 0.0,
                                 alibi_slopes: Optional[Tensor] = None):
    """Reference of :func:`longattn.flash_attention_with_kvcache`, without touching the caches: sequence ``b``'s
    keys are its first ``cache_seqlens[b]`` cache rows followed by the new ``k[b]`` (when given), and the ``Nq``
    queries attend to them with :func:`flash_mask` (bottom-right aligned). Returns out ``(B, Nq, Hq, D)`` (and lse
    ``(B, Hq, Nq)``)."""
    B, n_q, _, d = q.shape
    seqlens = [int(x) for x in (cache_seqlens.tolist() if isinstance(cache_seqlens, Tensor)
                                else [cache_seqlens] * B)]
    scale = d ** -0.5 if scale is None else scale
    alibi = None if alibi_slopes is None else alibi_slopes.expand(B, q.shape[2])
    outs, lses = [], []
    for b in range(B):
        keys, values = cache_rows(k_cache, b, seqlens[b], block_table), cache_rows(v_cache, b, seqlens[b], block_table)
        if k is not None:
            keys, values = torch.cat([keys, k[b]]), torch.cat([values, v[b]])
        m = keys.shape[0]
        out, lse = masked_attention(q[b:b + 1], keys[None].to(q.dtype), values[None].to(q.dtype),
                                    flash_mask(n_q, m, causal, window, device=q.device), scale, sinks, softcap,
                                    None if alibi is None else alibi[b:b + 1], alibi_distance(n_q, m, q.device))
        outs.append(out)
        lses.append(lse)
    return _result(torch.cat(outs), torch.cat(lses), return_lse)


def dilated_attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                                   v: Optional[Tensor] = None, *, cache_seqlens, segment_lengths: Sequence[int],
                                   dilation_rates: Sequence[int], head_split: bool = False,
                                   block_table: Optional[Tensor] = None, scale: Optional[float] = None,
                                   return_lse: bool = False):
    """Reference of :func:`longattn.dilated_attention_with_kvcache`, without touching the caches: sequence ``b``
    is its first ``cache_seqlens[b]`` cache rows followed by the new ``k[b]`` (when given), ``L`` rows; the ``Nq``
    queries are its last ``Nq`` positions, and the result is the last ``Nq`` rows of causal
    :func:`dilated_attention` on the whole sequence (the earlier rows' queries do not matter under causal masking:
    they are zeros here). Queries before position 0 (``L < Nq``) give 0 and lse ``-inf``."""
    B, n_q, hq, d = q.shape
    seqlens = [int(x) for x in (cache_seqlens.tolist() if isinstance(cache_seqlens, Tensor)
                                else [cache_seqlens] * B)]
    outs, lses = [], []
    for b in range(B):
        keys, values = cache_rows(k_cache, b, seqlens[b], block_table), cache_rows(v_cache, b, seqlens[b], block_table)
        if k is not None:
            keys, values = torch.cat([keys, k[b]]), torch.cat([values, v[b]])
        n = keys.shape[0]
        out = q.new_zeros(1, n_q, hq, d)
        lse = torch.full((1, hq, n_q), float("-inf"), device=q.device,
                         dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        if n > 0:
            tail = min(n, n_q)  # the queries at positions >= 0
            q_full = torch.cat([q.new_zeros(n - tail, hq, d), q[b, n_q - tail:]])
            o_b, l_b = dilated_attention(q_full[None], keys[None].to(q.dtype), values[None].to(q.dtype),
                                         segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=True,
                                         head_split=head_split, scale=scale, return_lse=True)
            out[:, n_q - tail:] = o_b[:, n - tail:]
            lse[:, :, n_q - tail:] = l_b[:, :, n - tail:].to(lse.dtype)
        outs.append(out)
        lses.append(lse)
    return _result(torch.cat(outs), torch.cat(lses), return_lse)


def head_groups(n_heads: int, n_groups: int) -> List[range]:
    """``head_split``: heads cut into ``n_groups`` contiguous groups, the first ``n_heads % n_groups`` one larger."""
    sizes = [n_heads // n_groups + (1 if i < n_heads % n_groups else 0) for i in range(n_groups)]
    starts = [sum(sizes[:i]) for i in range(n_groups)]
    return [range(s, s + z) for s, z in zip(starts, sizes)]


def dilated_branch_selection(n: int, n_heads: int, segment_length: int, dilation: int,
                             offsets: Sequence[Optional[int]], device=None) -> Tuple[Tensor, Tensor]:
    """For one branch: ``selected`` bool ``(H, N)`` and the segment index ``(N,)`` of every position.

    Head ``h`` with offset ``offsets[h]`` (``None``: the head takes no part in this branch) selects, in the segment
    starting at ``s``, positions ``s + o, s + o + r, ...`` below ``min(s + w, N)``.
    """
    pos = torch.arange(n, device=device)
    segment = pos // segment_length
    in_segment = pos - segment * segment_length
    selected = torch.zeros(n_heads, n, dtype=torch.bool, device=device)
    for h, o in enumerate(offsets):
        if o is not None:
            selected[h] = (in_segment >= o) & ((in_segment - o) % dilation == 0)
    return selected, segment


def dilated_attention(q: Tensor, k: Tensor, v: Tensor, *, segment_lengths: Sequence[int],
                      dilation_rates: Sequence[int], causal: bool = False, head_split: bool = False,
                      scale: Optional[float] = None, return_lse: bool = False):
    """Reference of :func:`longattn.dilated_attention` (LongNet).

    Branch ``i`` (segment length ``w``, dilation ``r``): each selected query attends to the selected keys of its own
    segment (with ``causal`` only those at or before its position), giving ``O_i`` and ``L_i`` (``-inf`` where the
    query is not selected). Output: ``sum_i softmax_i(L_i) * O_i``; merged lse: ``logsumexp_i L_i``.
    """
    fn = "reference.dilated_attention"
    V.check_attention_inputs(q, k, v, fn=fn, self_attention=True)
    segment_lengths, dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    b, n, h, _ = q.shape
    groups = head_groups(h, len(segment_lengths)) if head_split else None
    outs, lses = [], []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        if head_split:
            offsets = [i % r if hh in groups[i] else None for hh in range(h)]
        else:
            offsets = [hh % r for hh in range(h)]
        selected, segment = dilated_branch_selection(n, h, w, r, offsets, device=q.device)
        allowed = selected[:, :, None] & selected[:, None, :] & (segment[:, None] == segment[None, :])
        if causal:
            allowed = allowed & flash_mask(n, n, causal=True, device=q.device)
        out_i, lse_i = masked_attention(q, k, v, allowed[None], scale)
        outs.append(out_i)
        lses.append(lse_i)
    lse_all = torch.stack(lses)  # (k, B, H, N)
    lse = safe_logsumexp(lse_all, dim=0)
    # softmax over branches; 0 for branches that skip the query
    weights = torch.exp(lse_all - _no_keys_to_zero(lse)[None])
    out = sum(weights[i].transpose(1, 2)[..., None] * outs[i] for i in range(len(outs)))
    return _result(out, lse, return_lse)


def dilated_attention_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, segment_lengths: Sequence[int],
                             dilation_rates: Sequence[int], causal: bool = False, head_split: bool = False,
                             scale: Optional[float] = None, return_lse: bool = False):
    """Reference of :func:`longattn.dilated_attention_varlen`: :func:`dilated_attention` applied to each sequence
    ``cu_seqlens[b]:cu_seqlens[b+1]`` of the packed q, k, v ``(total, H, D)`` on its own (its segments start at its
    first row). Returns out ``(total, Hq, D)`` (and lse ``(Hq, total)``)."""
    fn = "reference.dilated_attention_varlen"
    cu, _ = V.check_varlen_args(q, k, v, cu_seqlens, cu_seqlens, fn=fn)
    segment_lengths, dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    outs, lses = [], []
    for a, e in zip(cu, cu[1:]):
        out, lse = dilated_attention(q[None, a:e], k[None, a:e], v[None, a:e], segment_lengths=segment_lengths,
                                     dilation_rates=dilation_rates, causal=causal, head_split=head_split,
                                     scale=scale, return_lse=True)
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q * 0
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0))
    return _result(out, lse, return_lse)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, *, block_mask: Tensor,
                           block_size: Union[int, Tuple[int, int]] = 128, causal: bool = False,
                           scale: Optional[float] = None, return_lse: bool = False):
    """Reference of :func:`longattn.block_sparse_attention`: every pair inside an allowed block pair attends.

    ``block_mask`` ``(B or 1, Hq or 1, ceil(N / block_q), ceil(M / block_k))`` is expanded to the ``(N, M)`` pair
    mask (broadcast over batch and heads); ``causal`` applies on top, bottom-right aligned.
    """
    fn = "reference.block_sparse_attention"
    V.check_attention_inputs(q, k, v, fn=fn)
    bq, bk = V.check_block_mask(block_mask, q, k, block_size, fn=fn, raw=True)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    n, m = q.shape[1], k.shape[1]
    allowed = block_mask.to(q.device).repeat_interleave(bq, dim=2).repeat_interleave(bk, dim=3)[:, :, :n, :m]
    allowed = allowed & flash_mask(n, m, causal, device=q.device)
    out, lse = masked_attention(q, k, v, allowed, scale)
    return _result(out, lse, return_lse)
