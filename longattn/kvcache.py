"""Inference: attention of a few new tokens against a KV cache, ``flash_attention_with_kvcache`` (FlashAttention's
convention), with contiguous or paged (vLLM-style) caches.

The semantics are :func:`longattn.reference.flash_attention_with_kvcache`. This module checks the arguments (once
per call signature: a decode step skips the checks), describes the call (:class:`longattn.call.KVCache` in an
:class:`longattn.call.AttentionCall`) and runs it through :func:`longattn.runner.decode` on the backend chosen by
:func:`longattn.backends.dispatch.choose_decode`: SDPA's default kernel for one new token against a contiguous cache
of a known length where it is the faster (the dispatch table's ``decode`` entries), else on a GPU the Triton decode
pass (the new keys and values written into the cache, each sequence's keys split over programs, flash-decoding;
nothing read on the host, so a step can be captured in a CUDA graph), elsewhere the PyTorch backend.
"""
from __future__ import annotations

import functools
import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.autograd import forward_ad

from longattn import _validation as V
from longattn import runner
from longattn._autograd import transform_reason, writes_into
from longattn._fp8 import check_descale
from longattn.backends import dispatch as _dispatch
from longattn.backends import sdpa as sdpa_backend
from longattn.backends.plan import Rejected
from longattn.backends.triton import support as triton_support
from longattn.backends.torch.decoding import write_cache
from longattn.call import AttentionCall, Branch, KVCache, dilated_branches, int32_index
from longattn.functional import Window

__all__ = ["flash_attention_with_kvcache", "dilated_attention_with_kvcache", "check_cache_args", "check_cache_values",
           "check_block_table", "write_cache"]

FN = "flash_attention_with_kvcache"
DFN = "dilated_attention_with_kvcache"


def _check_tensor(x, name: str, dims: int, what: str, fn: str = FN) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{fn}: {name} must have {dims} dims {what}, got shape {tuple(x.shape)}")


def _check_index(x, name: str, shape: tuple, device: torch.device, fn: str = FN) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor of int32, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must have dtype int32 (or int64), got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{fn}: {name} must have shape {shape}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{fn}: {name} must be on the inputs' device {device}, got {x.device}")


def check_cache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, fn: str = FN):
    """Shapes, dtypes and devices (no values); returns ``(capacity, page_size)`` (page size 0 when contiguous)."""
    _check_tensor(q, "q", 4, "(batch, new tokens, heads, head_dim)", fn)
    B, n_q, hq, d = q.shape
    paged = block_table is not None
    layout = "(pages, page_size, kv_heads, head_dim)" if paged else "(batch, max_len, kv_heads, head_dim)"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(c, name, 4, layout, fn)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if paged and (k_cache.shape[0] < 1 or k_cache.shape[1] < 1):
        raise ValueError(f"{fn}: paged k_cache and v_cache need at least 1 page and a page size >= 1 (shape "
                         f"{layout}), got {tuple(k_cache.shape)}")
    hk = k_cache.shape[2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype not in V.DTYPES + V.FP8_DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {c.dtype}; allowed: float16, bfloat16, float32, float64, "
                            "float8_e4m3fn (with q float16, bfloat16 or float32)")
    fp8 = k_cache.dtype in V.FP8_DTYPES or v_cache.dtype in V.FP8_DTYPES
    if fp8 and (k_cache.dtype != v_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32)):
        raise TypeError(f"{fn}: float8 caches need both k_cache and v_cache float8_e4m3fn and q float16, bfloat16 or "
                        f"float32; got q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    # One row of each cache, in the dtype the checks compare (a cache of no rows or no batch rows has none to cut),
    # expanded to hk rows: a head-count error's SDPA-layout hint reads dim 1 as the heads of q and k transposed, and
    # only q would be (the caches' layout is their own), so it is hinted where q's dim 1 is a multiple of hk.
    stand_in = lambda c: c.new_empty((1, 1, *c.shape[2:]), dtype=q.dtype if fp8 else c.dtype)  # noqa: E731
    V.check_attention_inputs(q, stand_in(k_cache).expand(B, hk, hk, -1), stand_in(v_cache).expand(B, hk, hk, -1),
                             fn=fn, names=("q", "k_cache", "v_cache"))
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: give both k and v (new tokens to append) or neither")
    if k is not None:
        if not torch.compiler.is_compiling():  # (traced, no tensor has memory: the graph's check op runs it)
            _check_appendable(q, k, v, k_cache, v_cache, fn)
        for name, x in (("k", k), ("v", v)):
            _check_tensor(x, name, 4, "(batch, new tokens, kv_heads, head_dim)", fn)
            want = k_cache.dtype if fp8 else q.dtype  # the cache's own values: float8 ones for a float8 cache
            if tuple(x.shape) != (B, n_q, hk, d) or x.dtype != want or x.device != q.device:
                raise ValueError(f"{fn}: {name} must be ({B}, {n_q}, {hk}, {d}) {want} on {q.device} (one row "
                                 f"per query token), got {tuple(x.shape)} {x.dtype} on {x.device}")
    if not paged and k_cache.shape[0] != B:
        raise ValueError(f"{fn}: a contiguous k_cache must have batch {B} (q's), got {k_cache.shape[0]}")
    if paged:
        _check_tensor(block_table, "block_table", 2, "(batch, max_pages)", fn)
        _check_index(block_table, "block_table", (B, block_table.shape[1]), q.device, fn)
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        page_size, capacity = 0, k_cache.shape[1]
    if not V._is_int(cache_seqlens):  # an int is checked (>= 0) on every call
        if not isinstance(cache_seqlens, Tensor):
            raise TypeError(f"{fn}: cache_seqlens must be an int or a torch.Tensor of int32 (or int64) of shape "
                            f"({B},), got {type(cache_seqlens).__name__}")
        _check_index(cache_seqlens, "cache_seqlens", (B,), q.device, fn)
    return capacity, page_size


def _inputs_cache_meets(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], k_cache: Tensor,
                       v_cache: Tensor) -> Optional[Tuple[str, str]]:
    """The names of the first of ``q``, ``k``, ``v`` that may share an element with a cache, and of that cache, or
    None: the call appends ``k``, ``v`` to the caches before it reads ``q``, ``k``, ``v``, so such an input could be
    overwritten first (a silently wrong answer)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            continue
        for cache_name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.dtype.itemsize != c.dtype.itemsize:
                if _memory(x) == _memory(c) != 0:
                    return name, cache_name
            elif _caches_meet(c, x):
                return name, cache_name
    return None


def _check_appendable(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, fn: str) -> None:
    """Caches that ``k``, ``v`` are appended to: no two elements of one share memory, the two are not one memory,
    and none of ``q``, ``k``, ``v`` shares memory with them (:func:`_inputs_cache_meets`)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _may_share_memory(c):
            raise ValueError(f"{fn}: {name} has elements that share memory (an expanded or overlapping view, "
                             f"strides {c.stride()}), so appending new tokens (k, v) would write one row over "
                             "another: pass a cache with its own memory per row")
    if _caches_meet(k_cache, v_cache):
        same = _storage_of(k_cache).data_ptr() == _storage_of(v_cache).data_ptr()
        raise ValueError(f"{fn}: k_cache and v_cache {'are the same memory' if same else 'overlap in memory'}, "
                         "so appending new tokens (k, v) would write values over keys: pass two caches (or two "
                         "views of a fused cache that do not overlap)")
    met = _inputs_cache_meets(q, k, v, k_cache, v_cache)
    if met is not None:
        raise ValueError(f"{fn}: {met[0]} overlaps {met[1]} in memory, so appending the new "
                         "tokens (k, v) could write over it before it is read: pass a tensor of its own memory "
                         "(e.g. .clone()), or, for rows already written into the cache, no k, v and "
                         "cache_seqlens counting them")


def check_cache_values(seqlens: Tensor, n_new: int, capacity: int, block_table: Optional[Tensor],
                       num_pages: int, fn: str = FN) -> None:
    """The value checks (one device-to-host copy; skipped while a CUDA graph is being captured, where the kernels
    still never write past the cache)."""
    lens = seqlens.tolist()
    if any(x < 0 or x + n_new > capacity for x in lens):
        raise ValueError(f"{fn}: cache_seqlens + new tokens must lie in [0, {capacity}] (the cache's capacity), got "
                         f"cache_seqlens={lens} with {n_new} new tokens")
    if block_table is not None and block_table.numel():
        _check_page_range(int(block_table.min()), int(block_table.max()), num_pages, fn)
        if n_new:
            _check_appended_rows(seqlens, n_new, block_table, capacity // block_table.shape[1], fn)


def _check_appended_rows(seqlens: Tensor, n_new: int, block_table: Tensor, page_size: int, fn: str) -> None:
    """Each cache row that a paged call appends to (``n_new`` new tokens per sequence) is no other position the
    call reads or writes: two sequences appending into one shared page (a prefix's last page not copied first), or
    a page repeated in a row of ``block_table``, would have one new key written over another (a race in the
    kernels) or over a key that a sequence reads. Pages that are only read may be shared."""
    pages = block_table.long()
    n_keys = seqlens.long()[:, None] + n_new  # (B, 1): the rows each sequence reads, the new ones included
    cols = -(-int(n_keys.max()) // page_size)
    live = torch.arange(cols, device=pages.device) * page_size < n_keys  # (B, cols): the pages the call touches
    if torch.unique(pages[:, :cols][live]).numel() == int(live.sum()):
        return  # (no page touched twice: nothing shared)
    pos = torch.arange(cols * page_size, device=pages.device)
    rows = pages[:, :cols].repeat_interleave(page_size, 1) * page_size + pos % page_size  # (B, positions)
    touched = pos < n_keys
    written = touched & (pos >= n_keys - n_new)
    uniq, counts = torch.unique(rows[touched], return_counts=True)
    clash = written & torch.isin(rows, uniq[counts > 1])
    if clash.any():
        b, p = (int(i) for i in clash.nonzero()[0])
        others = [(int(c), int(d)) for c, d in ((touched & (rows == rows[b, p])).nonzero()) if (c, d) != (b, p)]
        raise ValueError(f"{fn}: block_table maps the row that sequence {b} appends at position {p} (page "
                         f"{int(pages[b, p // page_size])}, row {p % page_size}) to a row that the call also "
                         f"reads or writes as (sequence, position) {others[0]}: the pages a sequence appends to must "
                         "be its own (copy a shared page before appending to it)")


def _check_page_range(lo: int, hi: int, num_pages: int, fn: str, which: str = "") -> None:
    """The smallest and largest block-table entries (of ``which`` pages) index the ``num_pages`` pages of the cache."""
    if lo < 0 or hi >= num_pages:
        raise ValueError(f"{fn}: block_table entries must index the {num_pages} pages of k_cache, got values "
                         f"in [{lo}, {hi}]{which}")


def check_block_table(block_table: Tensor, num_pages: int, pages_used: int, device: torch.device, fn: str) -> None:
    """A ``(B, pages)`` block table's dtype and device, and that the entries of its first ``pages_used`` columns (the
    pages a call writes) index the ``num_pages`` pages of the cache (:func:`check_cache_values`' rule): for calls
    that write through the table with PyTorch indexing, where a negative entry would name another page; and that no
    page is among them twice (it would be written twice). The values are read on the host
    (:func:`longattn._validation.host_values`: once per table and version on a GPU, so the layers of one prefill
    share one read; skipped while a CUDA graph is being captured)."""
    _check_index(block_table, "block_table", tuple(block_table.shape), device, fn)
    if (not block_table.numel() or pages_used <= 0 or not V.has_values(block_table)
            or (block_table.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    used = [x for row in V.host_values(block_table) for x in row[:pages_used]]  # (not empty: rows and columns)
    _check_page_range(min(used), max(used), num_pages, fn, f" among the {pages_used} pages a sequence's prompt fills")
    if len(set(used)) < len(used):  # (every page filled from its first row: one used twice is written twice)
        twice = next(x for x, n in Counter(used).items() if n > 1)
        raise ValueError(f"{fn}: block_table names page {twice} more than once among the {pages_used} pages a "
                         "sequence's prompt fills (in one row or in two): each prompt needs pages of its own")


def _debug_env() -> bool:
    return os.environ.get("LONGATTN_DEBUG", "0") == "1"


def _debug_checks() -> bool:
    """``LONGATTN_DEBUG=1`` checks the values on a GPU too (a host synchronisation; never while a graph captures)."""
    return _debug_env() and not torch.cuda.is_current_stream_capturing()


def _check_length(length: int, n_new: int, capacity: int, fn: str) -> None:
    """``cache_seqlens`` given as an int (every sequence that long), checked on every call (free: on the host)."""
    if length < 0 or length + n_new > capacity:
        raise ValueError(f"{fn}: cache_seqlens + new tokens must lie in [0, {capacity}] (the cache's capacity), "
                         f"got cache_seqlens={length} with {n_new} new tokens")


def _checked_lengths(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                     out: Optional[Tensor], seqlens: Tensor, block_table: Optional[Tensor], length: Optional[int], *,
                     capacity: int, values: bool, fn: str) -> Tensor:
    """The checks of a KV-cache call that read memory or values, as one node of a ``torch.compile`` graph (its
    tracing reads neither), run where the eager call runs them: the caches' memory where new rows ``k``, ``v`` are
    appended (:func:`_check_appendable`), ``out``'s (:func:`_check_out_memory`), an int
    ``cache_seqlens`` (``length``, else None), and where ``values`` on a CPU (with ``LONGATTN_DEBUG=1`` on a GPU
    too, outside a CUDA graph's capture) the values of ``seqlens`` (``(B,)`` int32 or int64) and ``block_table``
    (:func:`check_cache_values`). Returns a copy of ``seqlens``, which the call then reads: the checks run before
    the call writes anything, on every run of the graph (not on a CUDA graph's replays, which run no Python)."""
    n_new = 0 if k is None else k.shape[1]
    if n_new:
        _check_appendable(q, k, v, k_cache, v_cache, fn)
    _check_out_memory(out, q, k_cache, v_cache, k, v, fn)
    if length is not None:
        _check_length(length, n_new, capacity, fn)
    if values and (not seqlens.is_cuda or _debug_checks()):
        check_cache_values(seqlens, n_new, capacity, block_table, k_cache.shape[0], fn)
    return seqlens.clone()


# The op of _checked_lengths, on a library (not torch.library.custom_op, whose Python autograd wrapper costs tens of
# microseconds a run: backends/triton/entry.py's decode ops say more), kept for what it raises where its copy goes
# unread (the SDPA route, which reads the int length).
_LIB = torch.library.Library("longattn", "FRAGMENT")
_LIB.define("checked_lengths(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k, Tensor? v, Tensor? out, "
            "Tensor seqlens, Tensor? block_table, SymInt? length, *, int capacity, bool values, str fn) -> Tensor")
_LIB.impl("checked_lengths", _checked_lengths, "CompositeExplicitAutograd")
torch.library.register_fake("longattn::checked_lengths", lambda *args, **kwargs: torch.empty_like(args[6]), lib=_LIB)
torch.fx.node.has_side_effect(torch.ops.longattn.checked_lengths.default)


def flash_attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    *,
    cache_seqlens: Union[Tensor, int],
    block_table: Optional[Tensor] = None,
    causal: bool = True,
    window: Window = (-1, -1),
    scale: Optional[float] = None,
    return_lse: bool = False,
    num_splits: int = 0,
    out: Optional[Tensor] = None,
    backend: str = "auto",
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of new query tokens against a KV cache (inference only: no autograd).

    Args:
        q: ``(B, Nq, Hq, D)``: ``Nq`` new tokens per sequence (1 when decoding; more for speculative decoding or
            chunked prefill).
        k_cache, v_cache: contiguous ``(B, M_max, Hk, D)`` (any strides: HF's ``(B, Hk, M, D)`` cache works as a
            ``transpose(1, 2)`` view), or paged ``(num_pages, page_size, Hk, D)`` with ``block_table``.
        k, v: optional new keys/values ``(B, Nq, Hk, D)``, written into the caches in place at positions
            ``cache_seqlens[b] ...`` before attending (the caller then advances ``cache_seqlens``).
        cache_seqlens: int32 ``(B,)`` (or an int): valid cached tokens per sequence before this call.
        block_table: int32 ``(B, max_pages)``: logical page ``i`` of sequence ``b`` is physical page
            ``block_table[b, i]`` of the paged caches. Every entry must be a page of the pool, the pages a
            sequence does not use too (pad with any valid page, e.g. 0; -1 is refused): the kernels' launch does
            not depend on the lengths' values, so they may read them. Sequences may share pages they only read (a
            common prefix); a row that ``k``, ``v`` are appended to must be no other position of the call (refused
            where the values are checked, see below; elsewhere the writes race: a wrong answer).
        causal, window: as in :func:`longattn.flash_attention`, bottom-right aligned: query token ``t`` sits at
            key position ``n_keys - Nq + t``, ``n_keys = cache_seqlens[b] (+ Nq when k is given)``. ``causal``
            defaults to True, where FlashAttention's ``flash_attn_with_kvcache`` defaults to False: with several
            new tokens, pass ``causal=False`` for FlashAttention's default (with one new token the two agree).
        scale: softmax scale, default ``D ** -0.5``. return_lse: also return the log-sum-exp ``(B, Hq, Nq)``.
        num_splits: key splits per (sequence, KV head); 0 chooses from the shapes and the GPU.
        out: optional ``(B, Nq, Hq, D)`` tensor to write the output into.
        backend: ``"auto"`` (Triton on a GPU, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
        k_descale, v_descale: for float8_e4m3fn caches (half the bytes of bfloat16 ones): float32 factors ``(1,)``
            or ``(B, Hk)``, the cached values being ``cache.float() * descale`` (None is 1). The queries stay
            float16/bfloat16 and new ``k``, ``v`` are float8 (written as given); the output has q's dtype.
        sinks: attention sinks ``(Hq,)``, as in :func:`longattn.flash_attention` (gpt-oss).
        softcap, alibi_slopes: logit soft-capping and ALiBi slopes ``(Hq,)`` or ``(B, Hq)``, as in
            :func:`longattn.flash_attention` (distances from each new token's key position).

    On CPU tensors the values are checked (``cache_seqlens`` within the capacity, block-table entries within the
    pages). On a GPU they are not read (a decode step makes no host synchronisation, and can be captured in a CUDA
    graph): the kernels clamp them, so an out-of-range value never reads or writes outside the caches, but it gives
    a wrong answer. With the environment variable ``LONGATTN_DEBUG=1`` they are checked on a GPU too (one
    device-to-host copy per call, skipped while a CUDA graph is captured); :func:`check_cache_values` checks them on
    demand. Under ``torch.compile`` a call is one graph (``fullgraph=True`` works) that new values of
    ``cache_seqlens`` and ``block_table`` do not recompile; the checks that read values or memory are a node of it,
    run on every run of the graph where the eager call would run them.
    """
    return _with_kvcache(FN, q, k_cache, v_cache, k, v, cache_seqlens, block_table, ("flash", causal, window), scale,
                         return_lse, num_splits, out, backend, (k_descale, v_descale), (sinks, softcap, alibi_slopes))


def dilated_attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    *,
    cache_seqlens: Union[Tensor, int],
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    head_split: bool = False,
    block_table: Optional[Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    num_splits: int = 0,
    out: Optional[Tensor] = None,
    backend: str = "auto",
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """LongNet decoding: causal dilated attention of new query tokens against a KV cache (inference only).

    Sequence ``b`` is its first ``cache_seqlens[b]`` cache rows followed by the new tokens when ``k``, ``v`` are
    given (appended in place, as in :func:`flash_attention_with_kvcache`): ``L`` rows. The ``Nq`` queries are its
    last ``Nq`` positions, and the output equals the last ``Nq`` rows of
    ``dilated_attention(whole sequence, causal=True, segment_lengths=..., dilation_rates=..., head_split=...)``:
    for each branch ``(w, r)`` a query at position ``p`` (if its branch selects it) attends to the selected keys of
    its own segment ``[w * (p // w), ...)`` up to ``p``, and the branches merge by log-sum-exp.

    Only those keys are read: on a GPU one Triton program per (key split, sequence x query head, branch) walks the
    rows ``s + o, s + o + r, ...`` of the segment (contiguous or paged cache), and the branches' partials merge with
    the splits' in one kernel; no host synchronisation, so a step can be captured in a CUDA graph.

    Shapes, ``cache_seqlens``, ``block_table``, ``scale``, ``return_lse`` (lse ``(B, Hq, Nq)``), ``num_splits``
    (per branch), ``out``, ``backend`` and float8 caches (``k_descale``, ``v_descale``) as in
    :func:`flash_attention_with_kvcache`; ``segment_lengths``,
    ``dilation_rates`` and ``head_split`` as in :func:`longattn.dilated_attention`.
    """
    return _with_kvcache(DFN, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                         ("dilated", segment_lengths, dilation_rates, head_split), scale, return_lse, num_splits, out,
                         backend, (k_descale, v_descale))


def _with_kvcache(fn, q, k_cache, v_cache, k, v, cache_seqlens, block_table, spec, scale, return_lse, num_splits,
                  out, backend, descales, mods=(None, 0.0, None)):
    transformed = _transform_reason(fn, backend, (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out,
                                                  *mods[::2], *descales),
                                    (("cache_seqlens", cache_seqlens), ("block_table", block_table)))
    compiling = torch.compiler.is_compiling()  # (traced: nothing kept, the values checked by the graph's op)
    key = None if transformed or compiling else _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                           spec, scale, return_lse, num_splits, out, backend,
                                                           descales, mods)
    checked = _CHECKED.get(key) if key is not None else None
    if checked is None:
        checked = _check(fn, q, k_cache, v_cache, k, v, cache_seqlens, block_table, spec, scale, return_lse,
                         num_splits, out, backend, descales, mods)
        if transformed:  # (the PyTorch backend, whose operations vmap batches; never kept under a signature)
            checked = replace(checked, impl="torch", rejected=tuple(
                Rejected(c, transformed) for c in ("sdpa", "triton") if backend == "auto"))
        if key is not None:
            if len(_CHECKED) >= _MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED[key] = checked
    if torch.is_grad_enabled():
        inputs = (q, k_cache, v_cache, k, v, mods[0], *descales)  # (mods[0]: the sinks)
        given = [name for name, x in zip(_GRAD_FREE, inputs) if isinstance(x, Tensor) and x.requires_grad]
        if given:
            raise ValueError(f"{fn}: inference only (no autograd); inputs require grad ({', '.join(given)}): call it "
                             "under torch.no_grad()")
    length = None
    capacity = checked.capacity if block_table is not None else k_cache.shape[1]  # (a growing cache's own)
    if isinstance(cache_seqlens, Tensor):
        seqlens = cache_seqlens
    else:
        length = int(cache_seqlens)
        seqlens = _filled_lengths(length, q.shape[0], q.device) if checked.impl != "sdpa" else None
        if not (compiling and seqlens is not None):  # (traced, a length that varies is checked by the graph's op)
            _check_length(length, checked.n_new, capacity, fn)  # (SDPA's route reads it: guarded on, traced)
    if (not compiling and seqlens is not None and (not q.is_cuda or _debug_checks())
            and V.has_values(seqlens)):  # (before the casts: int64 values past int32 are refused)
        check_cache_values(seqlens, checked.n_new, capacity, block_table, k_cache.shape[0], fn)
    if compiling and (checked.n_new or length is not None or out is not None or not q.is_cuda or _debug_env()):
        checked_lens = torch.ops.longattn.checked_lengths.default(
            q, k_cache, v_cache, k, v, out, _filled_lengths(0, q.shape[0], q.device) if seqlens is None else seqlens,
            block_table, None if seqlens is None else length, capacity=capacity, values=seqlens is not None, fn=fn)
        seqlens = None if seqlens is None else checked_lens
    if seqlens is not None:
        seqlens = int32_index(seqlens)  # (no copy when already int32 and contiguous)
    if block_table is not None:
        block_table = int32_index(block_table)
    cache = KVCache(k_cache, v_cache, k, v, seqlens, length, block_table, checked.page_size, checked.capacity,
                    _filled(descales, q.device) if checked.fp8 else None, num_splits, out, key)
    sinks, _, slopes = mods
    call = AttentionCall(scale=checked.scale, causal=checked.causal, window=checked.window,
                         branches=checked.branches, cache=cache, sinks=sinks, softcap=checked.softcap,
                         alibi=None if slopes is None else slopes.expand(q.shape[0], q.shape[2]))
    if q.shape[0] == 0 or capacity == 0:  # no sequence, or no key (nothing cached, nothing appended): rows that
        # see no key give 0, and a log-sum-exp of -inf (or the sink's logit); the kernels' reductions need a key.
        runner.plan_nothing(q, "no sequence" if q.shape[0] == 0 else "no key: nothing cached, nothing appended")
        with writes_into(out):
            o = (out if out is not None else q.new_empty((*q.shape[:3], v_cache.shape[3]))).zero_()
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device,
                         dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        if sinks is not None:
            lse.copy_(sinks.to(lse.dtype)[None, :, None].expand_as(lse))
    else:
        with writes_into(out):  # (an out made under torch.inference_mode(): the backends' copies into it too)
            o, lse = runner.decode(checked.impl, q, call, return_lse, rejected=checked.rejected)
    return (o, lse) if return_lse else o


def _transform_reason(fn: str, backend: str, tensors: tuple, indices: tuple) -> Optional[str]:
    """Why a KV-cache call on ``tensors`` (None and ints skipped) cannot run on a kernel (or SDPA's) backend, or
    None (:func:`longattn._autograd.transform_reason`). Forward-mode tangents and differentiating ``torch.func``
    transforms (``grad``, ``jvp``, ``vjp``, ...) are refused (inference only: a tangent would be dropped, or a
    kernel fail deep inside); under ``vmap`` alone ``"auto"`` and ``"torch"`` run the PyTorch backend (whose
    operations vmap batches, appending into batched caches in place) and the kernel backends refuse by name. The
    indices ``cache_seqlens`` and ``block_table`` must not be batched there: their values are checked against the
    capacity before anything is written, which a batched tensor hides."""
    tensors = tuple(t for t in tensors if isinstance(t, Tensor))
    why = transform_reason(*tensors)
    if why is None:
        return None
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise ValueError(f"{fn}: inference only (no autograd): an input carries a forward-mode AD tangent "
                         "(torch.autograd.forward_ad or torch.func.jvp), which this function would not propagate; "
                         "call it on the primal values (forward_ad.unpack_dual(x).primal)")
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    kinds = {str(i.key()).rsplit(".", 1)[-1] for i in retrieve_all_functorch_interpreters()}
    if kinds - {"Vmap"}:
        raise ValueError(f"{fn}: inference only (no autograd): it runs under a differentiating torch.func "
                         f"transform ({', '.join(sorted(kinds - {'Vmap'}))}), whose derivatives it does not give; "
                         "call it outside the transform (or on detached inputs)")
    V.check_backend(backend, fn)
    if backend not in ("auto", "torch"):
        raise ValueError(f"{fn}: backend={backend!r} cannot run: {why}, which its kernels do not support; "
                         "backend='torch' (or 'auto') computes it")
    for name, t in indices:
        if isinstance(t, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise ValueError(f"{fn}: {name} is batched by vmap: its values are checked against the cache's capacity "
                             "before rows are written, which a batched tensor does not allow; pass it unbatched "
                             "(from outside the vmapped function, in_dims=None), one row per sequence of each cache")
    return why


def _filled_lengths(length: int, batch: int, device: torch.device) -> Tensor:
    """``cache_seqlens`` given as an int, as the int32 ``(B,)`` tensor the kernels read."""
    return torch.full((batch,), length, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class _Checked:
    """What the argument checks decide from shapes, dtypes and flags alone: the capacity and page size, the new
    tokens written, the pattern (``causal``/``window``, or LongNet's ``branches``), the scale, whether the caches
    are float8, the backend that runs the call and the ones tried before it."""

    capacity: int
    page_size: int
    n_new: int
    causal: bool
    window: Tuple[int, int]
    branches: Tuple[Branch, ...]
    scale: float
    fp8: bool
    impl: str
    softcap: float = 0.0
    rejected: Tuple[Rejected, ...] = ()  # the backends tried before impl, and why not (the plan's)


_GRAD_FREE = ("q", "k_cache", "v_cache", "k", "v", "sinks", "k_descale", "v_descale")  # (none may require grad)
_CHECKED: Dict[tuple, _Checked] = {}  # by call signature: a decode step skips the checks
_MAX_CHECKED = 256


def _ints(x) -> bool:
    return type(x) in (tuple, list) and all(type(i) is int for i in x)


def _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, spec, scale, return_lse, num_splits, out,
               backend, descales=(None, None), mods=(None, 0.0, None)) -> Optional[tuple]:
    """A key under which calls pass the same checks and launch the same kernels (shapes, strides, dtypes, devices,
    alignment, flags), or None for an argument of an unexpected type (the checks then run and name it). The values
    of ``cache_seqlens`` and ``block_table`` are not part of it: they never change what runs."""
    if not (isinstance(q, Tensor) and isinstance(k_cache, Tensor) and isinstance(v_cache, Tensor)):
        return None
    if not (type(return_lse) is bool and type(num_splits) is int and type(backend) is str
            and (scale is None or type(scale) is float)):
        return None
    if spec[0] == "flash":
        if not (type(spec[1]) is bool and type(spec[2]) is tuple and _ints(spec[2])):
            return None
        spec_key: tuple = spec
    else:
        if not (_ints(spec[1]) and _ints(spec[2]) and type(spec[3]) is bool):
            return None
        spec_key = ("dilated", tuple(spec[1]), tuple(spec[2]), spec[3])
    sinks, softcap, slopes = mods
    if type(softcap) is not float:
        return None
    if torch.is_grad_enabled() and isinstance(slopes, Tensor) and slopes.requires_grad:
        return None  # (the slopes' check reads this flag and grad mode: run it every time, as on a first call)
    if not all(x is None or isinstance(x, Tensor) for x in (k, v, block_table, out, sinks, slopes, *descales)):
        return None
    if type(cache_seqlens) is int:
        lens_key: tuple = ("int",)
    elif isinstance(cache_seqlens, Tensor):
        lens_key = V.tensor_key(cache_seqlens)
    else:
        return None
    caches = (V.tensor_key(k_cache), V.tensor_key(v_cache)) if block_table is not None else _growing_key(k_cache,
                                                                                                          v_cache)
    # caches that meet, or a contiguous cache whose rows meet (its key keeps only classes of its strides, which such a
    # view shares with a cache of its own memory per row), are refused where rows are appended, an out that meets an
    # input always: part of the key then
    shared = (k is not None and _caches_meet(k_cache, v_cache),
              k is not None and _inputs_cache_meets(q, k, v, k_cache, v_cache) is not None,
              out is not None and _inputs_out_meets(out, q, k_cache, v_cache, k, v) is not None)
    overlapping = (k is not None and block_table is None
                   and (_may_share_memory(k_cache) or _may_share_memory(v_cache)))
    return (V.tensor_key(q), *caches, shared, overlapping, V.tensor_key(k), V.tensor_key(v), lens_key,
            V.tensor_key(block_table), V.tensor_key(out), spec_key, scale, return_lse, num_splits, backend,
            V.tensor_key(sinks), softcap, V.tensor_key(slopes), *(V.tensor_key(x) for x in descales))


def _int_class(x: int) -> tuple:
    """What Triton's specialisation (and the launch plan) reads of an integer argument: 0, 1, a multiple of 16,
    beyond int32."""
    return x == 0, x == 1, x % 16 == 0, x >= 2 ** 31


def _growing_key(k_cache: Tensor, v_cache: Tensor) -> tuple:
    """The signature of contiguous caches without their length and stride values: a cache that grows by a few rows
    per step (transformers' dynamic cache is a new, longer tensor every step) keeps its checks and launch plan.
    Kept: every other dimension, whether the two shapes are equal (the checks ask for it), the specialisation class
    of the length and of every stride, and the length's power-of-two bucket (the plan's split count is chosen from
    it); the plan reads the length and strides of each call."""
    m = k_cache.shape[1]
    return (k_cache.shape[0], k_cache.shape[2:], k_cache.shape == v_cache.shape, _int_class(m), m.bit_length(),
            tuple(_int_class(x) for x in (*k_cache.stride(), *v_cache.stride())), k_cache.dtype, v_cache.dtype,
            k_cache.device, v_cache.device, V.aligned16(k_cache), V.aligned16(v_cache))


def _storage_of(t: Tensor) -> Tensor:
    """``t`` itself, or under ``torch.func`` transforms the tensor with storage that it wraps (vmap's whole batch)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _memory(t: Tensor) -> int:
    """The address of the storage of ``t`` (under ``torch.func`` transforms, of the tensor it wraps), or 0 for a
    meta or fake tensor, which has no memory (a fake one's address PyTorch warns against reading)."""
    t = _storage_of(t)
    if type(t) is not Tensor and not V.has_values(t):
        return 0
    return t.untyped_storage().data_ptr()


def _may_share_memory(t: Tensor) -> bool:
    """Whether two elements of ``t`` may lie at one address (an expanded or overlapping view): PyTorch's own check
    where it can tell; where it cannot (a strided view), whether some dimension's stride, taken in increasing order,
    falls inside the span of the dimensions before it (without that, no two elements can meet)."""
    if not t.numel():
        return False
    t = _storage_of(t)  # (under vmap: the whole batch of caches, whose rows must not meet either)
    code = torch._debug_has_internal_overlap(t)  # 0: no overlap, 1: overlap, 2: too hard to tell
    if code != 2:
        return code == 1
    span = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def _inputs_out_meets(out: Optional[Tensor], q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                      v: Optional[Tensor]) -> Optional[str]:
    """The name of the first input that ``out`` may share an element with, or None. ``out`` exactly ``q`` (the same
    elements, as an in-place call) is allowed; a meta or fake ``out`` (its storage at address 0) meets nothing."""
    if out is None:
        return None
    memory = _memory(out)  # (read once: a decode step asks on every call)
    if not memory:
        return None
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is None or _memory(x) != memory:
            continue  # (another storage: no element in common)
        if x.dtype.itemsize != out.dtype.itemsize:
            return name  # (one storage viewed as two element sizes: taken as meeting)
        if name == "q" and (x.data_ptr(), x.shape, x.stride()) == (out.data_ptr(), out.shape, out.stride()):
            continue
        if _caches_meet(out, x):
            return name
    return None


def _check_out_memory(out: Optional[Tensor], q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                      v: Optional[Tensor], fn: str) -> None:
    """``out`` (where given): no two of its elements share memory, nor one with an input
    (:func:`_inputs_out_meets`)."""
    if out is not None and _may_share_memory(out):
        raise ValueError(f"{fn}: out has elements that share memory (an expanded or overlapping view, strides "
                         f"{out.stride()}), so one output row would be written over another: pass an out with its "
                         "own memory per element")
    met = _inputs_out_meets(out, q, k_cache, v_cache, k, v)
    if met is not None:
        raise ValueError(f"{fn}: out overlaps {met} in memory, so the kernels would write output rows over rows they "
                         "still read: pass an out of its own memory (or q itself, which each row is read before its "
                         "output is written)")


def _caches_meet(a: Tensor, b: Tensor) -> bool:
    """Whether an element of ``a`` and one of ``b`` (same dtype, each without internal overlap) may lie at one
    address. Views of one storage with the same strides (a fused cache's ``kv[:, :, 0]`` and ``kv[:, :, 1]``, or a
    fused projection's query and key heads, whose shapes differ under grouped-query attention) meet exactly when
    their offsets differ by ``sum(i_d * stride_d)`` with ``-size_b_d < i_d < size_a_d``; views with different
    strides are taken to meet where their address ranges do. Meta and fake tensors (their storages at address 0)
    have no memory to share."""
    if not (a.numel() and b.numel()):
        return False
    memory = _memory(a)
    if not memory or _memory(b) != memory:
        return False
    a, b = _storage_of(a), _storage_of(b)
    delta = b.storage_offset() - a.storage_offset()
    if a.stride() != b.stride():
        span = lambda t: sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))  # noqa: E731
        return -span(b) <= delta <= span(a)  # (the ranges [offset, offset + span] intersect)
    return _views_meet(delta, tuple(a.shape), tuple(b.shape), a.stride())


@functools.lru_cache(maxsize=256)
def _views_meet(delta: int, shape_a: Tuple[int, ...], shape_b: Tuple[int, ...], strides: Tuple[int, ...]) -> bool:
    """Whether a view of ``shape_a`` and one of ``shape_b``, both of ``strides``, the second's offset ``delta``
    past the first's, share an element (a decode step's fused cache asks the same each step: kept): element ``i``
    of the first meets element ``j`` of the second where ``sum((i_d - j_d) * stride_d) == delta``. A dimension of
    stride 0 (an expanded view) moves no address: left out."""
    dims = []
    for st, n_a, n_b in zip(strides, shape_a, shape_b):
        lo, hi = 1 - n_b, n_a - 1  # the digits i_d - j_d
        if st < 0:
            st, lo, hi = -st, -hi, -lo
        if st and (lo or hi):
            dims.append((st, lo, hi))
    return _offset_reachable(delta, tuple(sorted(dims, reverse=True)))


def _offset_reachable(delta: int, dims: Tuple[Tuple[int, int, int], ...]) -> bool:
    """Whether ``delta == sum(digit_i * stride_i)`` with ``lo_i <= digit_i <= hi_i`` (``lo_i <= 0 <= hi_i``) for
    ``dims``' ``(stride, lo, hi)`` triples, largest stride first."""
    if not dims:
        return delta == 0
    (stride, lo, hi), rest = dims[0], dims[1:]
    least, most = sum(st * d_lo for st, d_lo, _ in rest), sum(st * d_hi for st, _, d_hi in rest)  # the smaller
    # strides reach [least, most]: the digits that leave delta' in that range
    first, last = -((most - delta) // stride), (delta - least) // stride
    return any(_offset_reachable(delta - digit * stride, rest) for digit in range(max(first, lo), min(last, hi) + 1))


def _check(fn, q, k_cache, v_cache, k, v, cache_seqlens, block_table, spec, scale, return_lse, num_splits, out,
           backend, descales=(None, None), mods=(None, 0.0, None)) -> _Checked:
    """Every check that needs no values, and the choice of backend and launch plan."""
    if not isinstance(q, Tensor):
        raise TypeError(f"{fn}: q must be a torch.Tensor, got {type(q).__name__}")
    V.check_flag(return_lse, "return_lse", fn)
    capacity, page_size = check_cache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, fn)
    causal, window, branches = True, (-1, -1), ()
    if spec[0] == "flash":
        causal, window = V.check_flag(spec[1], "causal", fn), V.check_window(spec[2], fn=fn)
    else:
        segs, rates = V.check_dilated_args(spec[1], spec[2], fn=fn)
        head_split = V.check_flag(spec[3], "head_split", fn)
        # segments counted from each sequence's first position; a segment past the sequence's end selects what the
        # clipped one would, so one of 2**bit_length(capacity) rows or more (past every cache of this call's
        # signature: a growing cache keeps its length's bit length) is cut to that (and its rate with it)
        span = 1 << capacity.bit_length()
        branches = dilated_branches(min(max(segs), span), q.shape[2], segs, rates, head_split, fn=fn)
    scale = V.check_scale(scale, q.shape[-1], fn=fn)
    V.check_backend(backend, fn)
    if not V._is_int(num_splits) or num_splits < 0:
        raise ValueError(f"{fn}: num_splits must be an int >= 0 (0: chosen from the shapes), got {num_splits!r}")
    if out is not None and (not isinstance(out, Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, Tensor)
               else type(out).__name__)
        raise ValueError(f"{fn}: out must be a tensor like q {tuple(q.shape)} {q.dtype} on {q.device}, got {got}")
    if not torch.compiler.is_compiling():  # (traced, no tensor has memory: the graph's check op runs it)
        _check_out_memory(out, q, k_cache, v_cache, k, v, fn)
    fp8 = k_cache.dtype in V.FP8_DTYPES
    _check_cache_descales(descales, fp8, q.shape[0], k_cache.shape[2], q.device, fn)
    n_new = q.shape[1] if k is not None else 0
    sinks, softcap, slopes = mods
    V.check_sinks(sinks, q.shape[2], q.device, fn=fn)
    softcap = V.check_softcap(softcap, fn=fn)
    V.check_alibi(slopes, q.shape[0], q.shape[2], q.device, fn=fn)
    modified = sinks is not None or softcap or slopes is not None
    reason = "score modifications" if modified else sdpa_backend.decode_unsupported_reason(
        q, kv_heads=k_cache.shape[2], dilated=len(branches) > 0, paged=block_table is not None, fp8=fp8,
        length_known=not isinstance(cache_seqlens, Tensor), need_lse=return_lse)
    sdpa = _dispatch.SdpaDecode(q.shape[2] != k_cache.shape[2]) if reason is None else None
    triton_reason = triton_support.cache_layout_reason(k_cache, v_cache)
    impl = _dispatch.choose_decode(backend, q, fn=fn, fp8_cache=fp8, sdpa=sdpa, triton_reason=triton_reason)
    return _Checked(capacity, page_size, n_new, causal, window, branches, scale, fp8, impl, softcap,
                    _rejected_backends(backend, impl, q, fp8, reason, triton_reason))



def _rejected_backends(backend: str, impl: str, q: Tensor, fp8: bool,
                       sdpa_reason: Optional[str], triton_reason: Optional[str] = None) -> Tuple[Rejected, ...]:
    """The backends a KV-cache call tries before ``impl`` (SDPA, Triton, PyTorch, in
    :func:`longattn.backends.dispatch.choose_decode`'s order) and why each did not take it, for the backend the
    caller asked: the plan's ``rejected``. Found with the checks, once per call signature."""
    order = ("sdpa", "triton", "torch")
    out = []
    for cand in order[:order.index(impl)] if impl in order else ():
        if backend != "auto":
            why = f"backend={backend!r}"
        elif cand == "sdpa":
            why = (f"PyTorch's SDPA does not compute this call exactly ({sdpa_reason})" if sdpa_reason is not None
                   else "the dispatch table measured our decode kernel faster here")
        else:
            why = (triton_reason or triton_support.unsupported_reason(q, fp8_cache=fp8)
                   or "not a CUDA tensor (the interpreter is never an automatic choice)")
        out.append(Rejected(cand, why))
    return tuple(out)


def _filled(descales, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Both descale factors of float8 caches, a factor of 1 ``(1,)`` where one is not given."""
    return tuple(_unit_factor(device) if x is None else x for x in descales)


@functools.lru_cache(maxsize=None)
def _unit_factor(device: torch.device) -> Tensor:
    """A float32 ``(1,)`` one on ``device``, made once (a decode step allocates nothing for an absent factor;
    the kernels only read it)."""
    return torch.ones(1, dtype=torch.float32, device=device)


def _check_cache_descales(descales, fp8: bool, batch: int, kv_heads: int, device: torch.device, fn: str) -> None:
    """``k_descale`` / ``v_descale``: only with float8 caches; float32 ``(1,)`` or ``(B, Hk)`` on the device."""
    for name, d in zip(("k_descale", "v_descale"), descales):
        if d is None:
            continue
        if not fp8:
            raise ValueError(f"{fn}: {name} applies to float8_e4m3fn caches only")
        check_descale(d, name, batch, kv_heads, device, fn)
