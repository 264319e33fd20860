"""FlashAttention 2's Python interface on longattn: code written for ``flash_attn`` runs after its import becomes
``from longattn.flash_attn_interface import flash_attn_func, ...``.

The signatures (names, order, defaults) and the semantics are those of ``flash_attn/flash_attn_interface.py`` of
flash-attn 2.8.3.post1, the current FlashAttention 2 release; each function maps its arguments onto
:func:`longattn.flash_attention`, :func:`longattn.flash_attention_varlen` or
:func:`longattn.flash_attention_with_kvcache` (``window_size`` is ``window``, ``softmax_scale`` is ``scale``,
``return_attn_probs`` / ``return_softmax_lse`` is ``return_lse``) and computes nothing itself. As in FlashAttention 2
(its ``csrc/flash_attn/flash_api.cpp``):

- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``; ``S_dmask`` is an empty ``(0,)`` tensor of
  q's dtype (FA2 returns the attention probabilities only with dropout, which is refused here; 2.7.0 and later
  return that empty tensor, earlier releases ``None``). ``softmax_lse`` is float32 ``(batch, nheads, seqlen_q)``,
  and ``(nheads, total_q)`` for the packed (varlen) functions (FA2's layout since 2.6.0; before, padded
  ``(batch, nheads, max_seqlen_q)``); a query that sees no key has output 0 and lse ``+inf`` (longattn's own
  functions give ``-inf``). With ``alibi_slopes`` under a causal mask (``causal``, or a window read as ``(-1, 0)``)
  FA2 adds ``slope * j`` to the scores (``mask.h``) rather than the documented ``-slope * |i + M - N - j|``: the
  same output, an lse larger by ``slope * (i + M - N)``, which the wrapper adds too.
- ``window_size``: a side below 0, or at least the key length, is unbounded; ``causal`` makes the right side 0;
  with the left side bounded, an unbounded right side is the key length. The key length is the keys' sequence
  length, ``max_seqlen_k`` for the packed functions (as given), the cache's capacity for the KV cache. (This differs
  from FA2's docstring only for sequences with more queries than keys.)
- ``softcap <= 0`` is off. ``flash_attn_with_kvcache``: ``causal=False`` by default (longattn's own function
  defaults to True); ``cache_seqlens=None`` is the whole cache (its capacity) and needs ``k=None``; an int is every
  sequence's length (with a paged cache too, where 2.8.3.post1 fails on it); inference only (no autograd graph).
  A contiguous cache with more rows than q's batch is read from its first rows, as in FA2.

Refused (``ValueError``), where longattn has no equivalent: ``dropout_p != 0``; the packed functions' paged
``block_table``; the KV cache's rotary embedding (``rotary_cos``, ``rotary_sin``), ``cache_batch_idx`` and
``cache_leftpad``, and new ``k``, ``v`` of another length than q's (FA2 appends any number; longattn's call one
key a query). Beyond FA2, float32 and float64 inputs (lse float64 then), any head dimension and page size, and
``max_seqlen_*=None`` are accepted; ``max_seqlen_*`` below the longest sequence are refused (FA2 does not check
them). Also refused where FA2 runs: a paged ``block_table`` with entries that are no page of the pool (FA2's
padding ``-1``), even in columns a sequence does not use (longattn's kernels may read them: pad with a valid page);
packed q, k, v with more rows than ``cu_seqlens_*[-1]`` (a static buffer's tail: pass the rows the batch has);
``max_seqlen_*``, ``softmax_scale`` or ``cache_seqlens`` given as 0-d tensors (pass ints and floats), and a
``softmax_scale`` at most 0. A ``softcap`` that is no number, or NaN, is refused too (FA2 reads any ``softcap <= 0``,
``-inf`` included, as off, and so does this interface). Errors of longattn's checks name longattn's function and
arguments.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from longattn.functional import flash_attention
from longattn.kvcache import flash_attention_with_kvcache
from longattn.varlen import flash_attention_varlen

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]

Result = Union[Tensor, Tuple[Tensor, Tensor, Tensor]]


def _refuse(value, allowed, name: str, fn: str, why: str) -> None:
    if value is not allowed if allowed is None else value != allowed:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
        raise ValueError(f"{fn}: {name} must be {allowed!r} ({why}), got {got}")


def _softcap(softcap):
    """FA2's reading of ``softcap``: a number at most 0 (``-inf`` too) is off, 0.0. Anything else, a cap or no number
    (NaN, None, a string), goes to longattn's check, which takes the cap or names the argument."""
    if isinstance(softcap, Real) and not isinstance(softcap, bool) and softcap <= 0:
        return 0.0
    return softcap


def _packed(t, dim: int, parts: int, name: str, layout: str, fn: str) -> Tuple[Tensor, ...]:
    """The ``parts`` views of ``t`` along ``dim`` (FA2's packed q/k/v or k/v), or an error naming ``name`` and its
    ``layout`` where ``t`` is no tensor of that layout."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != len(layout.split(",")) or t.shape[dim] != parts:
        raise ValueError(f"{fn}: {name} must have shape {layout} (dimension {dim} of size {parts}), got "
                         f"{tuple(t.shape)}")
    return t.unbind(dim)


def _window(window_size, causal: bool, seqlen_k: Optional[int]):
    """FA2's own reading of ``window_size`` for ``seqlen_k`` keys (flash_api.cpp), as longattn's ``window``."""
    try:
        left, right = (-1 if x < 0 or (seqlen_k is not None and x >= seqlen_k) else x for x in window_size)
    except (TypeError, ValueError):
        return window_size  # (longattn's check names what is wrong)
    if causal:
        right = 0
    return (left, seqlen_k) if left >= 0 and right < 0 and seqlen_k is not None else (left, right)


def _lse(lse: Tensor, alibi_slopes: Optional[Tensor] = None, window=None, offset=None) -> Tensor:
    """FA2's lse: ``+inf`` for a query without keys; and with ALiBi under FA2's causal mask (``window`` read as
    ``(-1, 0)``) larger by ``slope * (i + M - N)``, ``offset()`` giving ``i + M - N``: there FA2 adds ``slope * j``
    to the scores (its ``mask.h``), not ``-slope * (i + M - N - j)``: the same softmax, another lse."""
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)
    if alibi_slopes is None or not _fa2_causal(window):
        return lse
    return lse + alibi_slopes.to(lse.dtype)[..., None] * offset().to(lse.device)


def _fa2_causal(window) -> bool:
    try:
        return window[0] < 0 and window[1] == 0
    except (TypeError, IndexError):
        return False


def _probs(result, q: Tensor, return_attn_probs: bool, alibi_slopes=None, window=None, offset=None) -> Result:
    if not return_attn_probs:
        return result
    return result[0], _lse(result[1], alibi_slopes, window, offset), q.new_empty(0)


def _varlen_lse(lse: Tensor, alibi_slopes, window, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> Tensor:
    """:func:`_lse` of the packed ``(Hq, total_q)`` lse: each query's ``i + M_b - N_b`` and slope of its sequence."""
    if alibi_slopes is None or not _fa2_causal(window):
        return _lse(lse)
    cu_q, cu_k = cu_seqlens_q.to(lse.device).long(), cu_seqlens_k.to(lse.device).long()
    token = torch.arange(lse.shape[-1], device=lse.device)
    seq = torch.searchsorted(cu_q[1:], token, right=True)
    offset = token - cu_q[seq + 1] + (cu_k[1:] - cu_k[:-1])[seq]
    slopes = alibi_slopes.to(lse.device)[seq].T if alibi_slopes.dim() == 2 else alibi_slopes[:, None]
    return _lse(lse) + slopes.to(lse.dtype) * offset


def _positions(n: int, m, device) -> Tensor:
    """``i + M - N`` for ``n`` queries and ``m`` keys (an int, or one per sequence): ``(n,)`` or ``(B, 1, n)``."""
    i = torch.arange(n, device=device)
    return i + (m - n) if not isinstance(m, Tensor) else (m.to(device).long().view(-1, 1, 1) - n) + i


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Result:
    """FA2's ``flash_attn_func``: q ``(B, N, Hq, D)``, k, v ``(B, M, Hk, D)``; :func:`longattn.flash_attention`."""
    _refuse(dropout_p, 0.0, "dropout_p", "flash_attn_func", "longattn has no attention dropout")
    window = _window(window_size, causal, k.shape[1])
    result = flash_attention(q, k, v, causal=causal, window=window, scale=softmax_scale, return_lse=return_attn_probs,
                             softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                             deterministic=deterministic)
    return _probs(result, q, return_attn_probs, alibi_slopes, window, lambda: _positions(q.shape[1], k.shape[1],
                                                                                         q.device))


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Result:
    """FA2's ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` on the views of qkv ``(B, N, 3, H, D)``."""
    qkv = _packed(qkv, 2, 3, "qkv", "(batch, seqlen, 3, nheads, headdim)", "flash_attn_qkvpacked_func")
    return flash_attn_func(*qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Result:
    """FA2's ``flash_attn_kvpacked_func``: :func:`flash_attn_func` on q and the views of kv ``(B, M, 2, Hk, D)``."""
    kv = _packed(kv, 2, 2, "kv", "(batch, seqlen_k, 2, nheads_k, headdim)", "flash_attn_kvpacked_func")
    return flash_attn_func(q, *kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None) -> Result:
    """FA2's ``flash_attn_varlen_func``: q ``(total_q, Hq, D)``, k, v ``(total_k, Hk, D)``, lse ``(Hq, total_q)``;
    :func:`longattn.flash_attention_varlen`. ``block_table`` (paged keys) is refused."""
    fn = "flash_attn_varlen_func"
    _refuse(dropout_p, 0.0, "dropout_p", fn, "longattn has no attention dropout")
    _refuse(block_table, None, "block_table", fn, "no paged keys in packed calls: flash_attn_with_kvcache takes them")
    window = _window(window_size, causal, max_seqlen_k)
    result = flash_attention_varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                                    window=window, scale=softmax_scale, return_lse=return_attn_probs,
                                    softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                                    deterministic=deterministic)
    if not return_attn_probs:
        return result
    return result[0], _varlen_lse(result[1], alibi_slopes, window, cu_seqlens_q, cu_seqlens_k), q.new_empty(0)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Result:
    """FA2's ``flash_attn_varlen_qkvpacked_func``: :func:`flash_attn_varlen_func` on the views of qkv
    ``(total, 3, H, D)``, ``cu_seqlens`` and ``max_seqlen`` for queries and keys alike."""
    qkv = _packed(qkv, 1, 3, "qkv", "(total, 3, nheads, headdim)", "flash_attn_varlen_qkvpacked_func")
    return flash_attn_varlen_func(*qkv, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Result:
    """FA2's ``flash_attn_varlen_kvpacked_func``: :func:`flash_attn_varlen_func` on q and the views of kv
    ``(total_k, 2, Hk, D)``."""
    kv = _packed(kv, 1, 2, "kv", "(total_k, 2, nheads_k, headdim)", "flash_attn_varlen_kvpacked_func")
    return flash_attn_varlen_func(q, *kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """FA2's ``flash_attn_with_kvcache`` (``k``, ``v`` appended to the caches in place at ``cache_seqlens``):
    :func:`longattn.flash_attention_with_kvcache`. Rotary embedding, ``cache_batch_idx`` and ``cache_leftpad``
    are refused."""
    fn = "flash_attn_with_kvcache"
    rope = "no rotary embedding in longattn's call: apply it to q and the new k before the call"
    _refuse(rotary_cos, None, "rotary_cos", fn, rope)
    _refuse(rotary_sin, None, "rotary_sin", fn, rope)
    _refuse(cache_batch_idx, None, "cache_batch_idx", fn, "cache row b is sequence b: pass caches in q's batch order")
    _refuse(cache_leftpad, None, "cache_leftpad", fn, "every sequence's cache starts at row 0")
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if cache_seqlens is None and k is not None:
        raise ValueError(f"{fn}: cache_seqlens must be given with k, v (where to append them); None (the whole "
                         "cache) only without k and v")
    if k is not None and k.dim() == 4 and k.shape[1] != q.shape[1]:
        raise ValueError(f"{fn}: k and v must have q's {q.shape[1]} new tokens (longattn's call appends one key a "
                         f"query; FA2 takes any number), got {k.shape[1]}: append the others with a call of their own")
    if block_table is None and k_cache.dim() == 4 and k_cache.shape[0] > q.shape[0]:
        k_cache, v_cache = k_cache[:q.shape[0]], v_cache[:q.shape[0]]  # (FA2: sequence b is cache row b)
    lens = capacity if cache_seqlens is None else cache_seqlens
    window = _window(window_size, causal, capacity)
    with torch.no_grad():  # (FA2's has no backward: its output needs no grad, whatever its inputs)
        result = flash_attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=block_table, causal=causal, window=window,
            scale=softmax_scale, return_lse=return_softmax_lse, num_splits=num_splits,
            softcap=_softcap(softcap), alibi_slopes=alibi_slopes)
    if not return_softmax_lse:
        return result
    n_keys = lens + (q.shape[1] if k is not None else 0)  # (each sequence's keys, the appended ones too)
    return result[0], _lse(result[1], alibi_slopes, window, lambda: _positions(q.shape[1], n_keys, q.device))

