"""Generation with a KV cache: :class:`KVCache` (per-layer key/value caches, contiguous or paged) and the
sampling loop :func:`generate` behind :meth:`longattn.models.LongNet.generate`."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from longattn import _autocast
from longattn._validation import _is_int


class KVCache:
    """Key and value caches of every layer for ``batch`` sequences of up to ``capacity`` tokens.

    Contiguous: ``(batch, capacity, Hk, D)`` per layer. Paged (``page_size`` given): a pool of
    ``batch * ceil(capacity / page_size)`` pages ``(pages, page_size, Hk, D)`` per layer and one ``block_table``
    ``(batch, pages per sequence)`` shared by the layers (here each sequence owns a fixed run of pages; a server
    would hand pages out on demand). ``seqlens`` ``(batch,)`` int32: tokens cached so far.
    """

    def __init__(self, num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, *,
                 device=None, dtype=None, page_size: Optional[int] = None):
        if page_size is not None and (not _is_int(page_size) or page_size < 1):  # (True is no page size)
            raise ValueError(f"KVCache: page_size must be a positive int or None, got {page_size!r}")
        page_size = None if page_size is None else int(page_size)
        if capacity < 1 or batch < 1:
            raise ValueError(f"KVCache: batch and capacity must be >= 1, got {batch} and {capacity}")
        self.capacity = capacity
        if page_size is None:
            shape: Tuple[int, ...] = (batch, capacity, kv_heads, head_dim)
            self.block_table = None
        else:
            per = -(-capacity // page_size)
            shape = (batch * per, page_size, kv_heads, head_dim)
            self.block_table = torch.arange(batch * per, device=device, dtype=torch.int32).view(batch, per)
        self.layers: List[Tuple[Tensor, Tensor]] = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch, device=device, dtype=torch.int32)


def _sample(logits: Tensor, temperature: float, top_k: Optional[int], generator: Optional[torch.Generator]) -> Tensor:
    """Next tokens ``(B,)`` from last-position logits ``(B, V)``: greedy when ``temperature`` is 0."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, tokens: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: Optional[int] = None,
             page_size: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """``tokens`` ``(B, N)`` followed by ``max_new_tokens`` sampled tokens: ``(B, N + max_new_tokens)`` int64, a
    new tensor (``B = 0``: an empty one).

    The prompt runs once through the model (full causal dilated attention) and fills a :class:`KVCache`; every new
    token then costs one decode step per layer (:meth:`MultiheadDilatedAttention.decode`), reading only the cached
    keys its dilated branches select. The model runs in eval mode (dropout off, so that greedy decoding is greedy and
    the cached steps compute what the whole sequence would); each of its modules gets its training flag back after.
    """
    c = model.config
    if not c.causal:
        raise ValueError("LongNet.generate: the model must be causal (config.causal=True)")
    # (ints as the rest of the package takes them: NumPy's too, never a bool)
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"LongNet.generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature)
            or temperature < 0):
        raise ValueError(f"LongNet.generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"LongNet.generate: top_k must be a positive int or None, got {top_k!r}")
    if page_size is not None and (not _is_int(page_size) or page_size < 1):  # (named here: KVCache is internal)
        raise ValueError(f"LongNet.generate: page_size must be a positive int (tokens a cache page) or None "
                         f"(a contiguous cache), got {page_size!r}")
    top_k, page_size = (None if x is None else int(x) for x in (top_k, page_size))
    b, n = tokens.shape
    if max_new_tokens == 0:
        return tokens.to(torch.long, copy=True)  # (a new tensor, int64, as every other result)
    if b == 0:  # no sequence to continue: an empty result, no model run
        return tokens.new_zeros((0, n + max_new_tokens), dtype=torch.long)
    if n == 0:
        raise ValueError(f"LongNet.generate: tokens must hold at least one prompt token per row to generate from, got "
                         f"shape {tuple(tokens.shape)}")
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return _generate(model, tokens, max_new_tokens, temperature, top_k, page_size, generator)
    finally:
        for m, training in modes:
            m.training = training


def _generate(model, tokens: Tensor, max_new_tokens: int, temperature: float, top_k: Optional[int],
              page_size: Optional[int], generator: Optional[torch.Generator]) -> Tensor:
    b, n = tokens.shape
    attn = model.blocks[0].attn
    w = model.embedding.weight
    # the keys and values come out of the projections in the autocast dtype under torch.autocast: the cache too
    dtype = _autocast.autocast_dtype(w) or w.dtype
    cache = KVCache(len(model.blocks), b, n + max_new_tokens, attn.num_kv_heads, attn.head_dim, device=w.device,
                    dtype=dtype, page_size=page_size)
    x = model.embedding(tokens)
    for block, (kc, vc) in zip(model.blocks, cache.layers):
        x = block.step(x, lambda h, blk=block, kc=kc, vc=vc: blk.attn.prefill(h, kc, vc, cache.block_table))
    cache.seqlens.fill_(n)
    out = [tokens]
    nxt = _sample(model.logits(x[:, -1:])[:, 0], temperature, top_k, generator)
    for i in range(max_new_tokens):
        out.append(nxt[:, None])
        if i == max_new_tokens - 1:
            break
        x = model.embedding(nxt[:, None])
        for block, (kc, vc) in zip(model.blocks, cache.layers):
            x = block.step(x, lambda h, blk=block, kc=kc, vc=vc: blk.attn.decode(h, kc, vc, cache.seqlens,
                                                                                 cache.block_table))
        cache.seqlens += 1
        nxt = _sample(model.logits(x)[:, 0], temperature, top_k, generator)
    return torch.cat(out, dim=1)
