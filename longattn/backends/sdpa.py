"""PyTorch's own attention (``F.scaled_dot_product_attention`` with no backend chosen) as a longattn backend.

``backend="auto"`` runs a call here when SDPA computes exactly what was asked and the dispatch table
(:mod:`longattn.backends.auto_table`) says SDPA's default kernel is at least as fast as ours for that kind of call:
dense attention, or causal attention with as many queries as keys (SDPA aligns its causal mask top-left, longattn
bottom-right; the two agree only when ``N == M``), no window, no log-sum-exp asked for. Grouped-query heads go
through ``enable_gqa`` (torch >= 2.5).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from longattn.call import AttentionCall


_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def has_enable_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (added in torch 2.5)."""
    return _HAS_ENABLE_GQA


def unsupported_reason(q: Tensor, k: Tensor, *, causal: bool, window: Tuple[int, int],
                       need_lse: bool) -> Optional[str]:
    """Why SDPA cannot compute this :func:`longattn.flash_attention` call exactly (None when it can)."""
    if need_lse:
        return "the log-sum-exp is asked for"
    if window != (-1, -1):
        return "a sliding window"
    if causal and q.shape[1] != k.shape[1]:
        return "causal with N != M (SDPA aligns the causal mask top-left)"
    if q.shape[2] != k.shape[2] and not has_enable_gqa():
        return f"grouped-query heads need torch >= 2.5 (have {torch.__version__})"
    if q.is_cuda and q.shape[-1] % 8:
        return "a head dim that is not a multiple of 8 (SDPA's fused CUDA kernels need one)"
    return None


def grouped_sdpa(qt: Tensor, kt: Tensor, vt: Tensor, *, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                 scale: Optional[float] = None) -> Tensor:
    """``F.scaled_dot_product_attention`` on SDPA's layout, q ``(B, Hq, N, D)``, k/v ``(B, Hk, M, D)`` with
    ``Hq % Hk == 0``: grouped-query heads through ``enable_gqa`` where torch has it, else K/V heads repeated."""
    if kt.shape[1] == qt.shape[1]:
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    if has_enable_gqa():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = qt.shape[1] // kt.shape[1]
    return F.scaled_dot_product_attention(qt, kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1),
                                          attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: Optional[float] = None) -> Tensor:
    """Dense or causal (``N == M``) attention by SDPA: q ``(B, N, Hq, D)``, k/v ``(B, M, Hk, D)`` ->
    ``(B, N, Hq, D)``; ``scale`` None is SDPA's default, ``D ** -0.5``."""
    out = grouped_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def attention(q: Tensor, k: Tensor, v: Tensor, call: "AttentionCall") -> Tuple[Tensor, None]:
    """A flash ``call`` SDPA computes exactly (:func:`unsupported_reason` says None): ``(out, None)``; SDPA gives
    no log-sum-exp."""
    return flash_attention(q, k, v, causal=call.causal, scale=call.scale), None


def decode_unsupported_reason(q: Tensor, *, kv_heads: int, dilated: bool, paged: bool, fp8: bool,
                              length_known: bool, need_lse: bool) -> Optional[str]:
    """Why SDPA cannot compute a KV-cache call on ``q (B, Nq, Hq, D)`` exactly without a mask (None when it can):
    it can for one new token against a contiguous, non-float8 cache whose length is known on the host (an int
    ``cache_seqlens``); the token then sees every cached key (or the window's last ones)."""
    if dilated:
        return "dilated decode"
    if paged:
        return "a paged cache"
    if fp8:
        return "float8 caches"
    if q.shape[1] != 1:
        return "several new tokens (bottom-right causal needs a mask)"
    if not length_known:
        return "cache lengths per sequence in a tensor"
    if need_lse:
        return "the log-sum-exp is asked for"
    if q.shape[2] != kv_heads and not has_enable_gqa():
        return f"grouped-query heads need torch >= 2.5 (have {torch.__version__})"
    if q.is_cuda and q.shape[-1] % 8:
        return "a head dim that is not a multiple of 8 (SDPA's fused CUDA kernels need one)"
    return None


def decode(q: Tensor, call: "AttentionCall", return_lse: bool) -> Tuple[Tensor, None]:
    """A KV-cache call :func:`decode_unsupported_reason` accepts: the new keys and values written into the cache
    (in place), then SDPA of the one new token over the keys it sees (the cache's first ``length + 1`` rows, or
    their last ``left + 1`` with a window). ``(out, None)``."""
    c = call.cache
    n_keys = c.length + c.n_new
    if c.k_new is not None:
        c.k_cache[:, c.length:n_keys] = c.k_new
        c.v_cache[:, c.length:n_keys] = c.v_new
    left = call.band.left
    lo = 0 if left is None else max(0, n_keys - 1 - left)
    if n_keys == 0:  # no key to see: 0, as everywhere in longattn
        o = torch.zeros(q.shape[:3] + (c.v_cache.shape[-1],), dtype=q.dtype, device=q.device)
    else:
        keys, values = c.k_cache[:, lo:n_keys], c.v_cache[:, lo:n_keys]
        o = grouped_sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                         scale=call.scale).transpose(1, 2)
    if c.out is not None:
        return c.out.copy_(o), None
    return o, None
