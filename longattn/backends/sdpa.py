"""PyTorch's own attention (``F.scaled_dot_product_attention`` with no backend chosen) as a longattn backend.

``backend="auto"`` runs a call here when SDPA computes exactly what was asked and the dispatch table
(:mod:`longattn.backends.auto_table`) says SDPA's default kernel is at least as fast as ours for that kind of call:
dense attention, or causal attention with as many queries as keys (SDPA aligns its causal mask top-left, longattn
bottom-right; the two agree only when ``N == M``), no window, no log-sum-exp asked for. Grouped-query heads go
through ``enable_gqa`` (torch >= 2.5).

Non-finite inputs: longattn's rule (:mod:`longattn.reference`) is IEEE arithmetic over the keys a query may attend
(a NaN or ``+inf`` score among them makes the row NaN; a key it may not attend never affects it). SDPA's CUDA
kernels (cuDNN, flash, memory-efficient) follow it (checked on an H200); its CPU kernels do not: the CPU flash kernel
gives 0 for a query holding a NaN, and a NaN in a masked key reaches every row through the additive mask. So on
other devices a call whose q or k holds a non-finite value never runs SDPA's kernel: :func:`unsupported_reason`
sends a ``flash_attention`` call to the PyTorch backend, and :func:`grouped_sdpa` computes its masked softmax
explicitly. Reading the values costs one pass over q and k, nothing against the attention on a CPU; under
``torch.compile`` tracing the values are unknown and SDPA's kernel runs as traced.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn import _validation as V
from longattn._autograd import transform_reason, writes_into

if TYPE_CHECKING:  # pragma: no cover
    from longattn.call import AttentionCall


_IEEE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
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
    transformed = transform_reason(q, k)  # (before reading values, which vmap refuses: the PyTorch backend runs)
    if transformed is not None:
        return transformed
    if nonfinite_on_cpu(q, k):
        return "a non-finite value in q or k (PyTorch's CPU SDPA kernel zeroes a NaN query's row)"
    return None


def nonfinite_on_cpu(*tensors: Optional[Tensor]) -> bool:
    """Whether ``tensors`` (None skipped) are off CUDA, hold values, and one of them holds a NaN or an infinity:
    the inputs on which SDPA's CPU kernels depart from IEEE arithmetic (module docstring). False on CUDA tensors
    (SDPA's CUDA kernels follow it), meta and fake tensors (a ``FakeTensorMode`` of one's own) and under
    ``torch.compile`` tracing (no values to read)."""
    present = [t for t in tensors if t is not None]
    if (not present or present[0].is_cuda or torch.compiler.is_compiling()
            or not all(V.has_values(t) for t in present)):
        return False
    if any(t.dtype not in _IEEE_DTYPES for t in present):
        return False  # float8 inputs never run SDPA's kernel (and torch has no isfinite for them)
    return not all(bool(torch.isfinite(t).all()) for t in present)


def _explicit(qt: Tensor, kt: Tensor, vt: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
              scale: Optional[float]) -> Tensor:
    """What :func:`grouped_sdpa` computes, by matrices and IEEE arithmetic (for non-finite CPU inputs): masked keys
    are excluded (never added to), a row with no key gives 0, a NaN or ``+inf`` score among its keys gives NaN."""
    group = qt.shape[1] // kt.shape[1]
    acc = torch.float64 if qt.dtype == torch.float64 else torch.float32
    kt, vt = kt.repeat_interleave(group, 1).to(acc), vt.repeat_interleave(group, 1).to(acc)
    scale = qt.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(qt.to(acc), kt.transpose(-1, -2)) * scale
    if is_causal:  # SDPA's causal mask is aligned top-left
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(acc)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse))  # rows without keys: exp(-inf) = 0
    return torch.matmul(p, vt).to(qt.dtype)


def grouped_sdpa(qt: Tensor, kt: Tensor, vt: Tensor, *, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                 scale: Optional[float] = None) -> Tensor:
    """``F.scaled_dot_product_attention`` on SDPA's layout, q ``(B, Hq, N, D)``, k/v ``(B, Hk, M, D)`` with
    ``Hq % Hk == 0``: grouped-query heads through ``enable_gqa`` where torch has it, else K/V heads repeated.
    Non-finite q or k off CUDA: computed explicitly instead (:func:`nonfinite_on_cpu`, module docstring)."""
    # (under vmap no value can be read to check: transform_reason, as the backend choice reads it)
    if transform_reason(qt, kt, vt) is not None or nonfinite_on_cpu(qt, kt):
        return _explicit(qt, kt, vt, attn_mask, is_causal, scale)
    return _kernel(qt, kt, vt, attn_mask, is_causal, scale)


def _kernel(qt: Tensor, kt: Tensor, vt: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
            scale: Optional[float]) -> Tensor:
    """SDPA's own kernel for :func:`grouped_sdpa`, with no look at the values."""
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
    ``(B, N, Hq, D)``; ``scale`` None is SDPA's default, ``D ** -0.5``. SDPA's kernel as a user calls it, with no look
    at the values: the backend's route comes here only for calls :func:`unsupported_reason` accepted, which has read
    them already (non-finite CPU inputs never do)."""
    out = _kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, causal, scale)
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
        with writes_into(c.k_cache, c.v_cache):
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
