"""The description of one attention call: built once by the functional layer, read by every backend.

An :class:`AttentionCall` says *what* to compute, independently of how: the scale, the band of keys each query sees
by position (causal, window), the branches of dilated attention, the allowed blocks of block-sparse attention, and
for the variable-length and KV-cache entry points the sequence boundaries or the cache. A backend reads it and
runs its passes; the ring code builds one per block it computes. The two pieces of semantics several backends share
are defined here too: :func:`head_groups` (``head_split``'s cut of the heads) and :func:`merge_partial` (the
log-sum-exp merge of partial results). :mod:`longattn.reference` stays independent of this module: it is the
specification.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from longattn._tracing import export_flag


UNBOUNDED_WINDOW = 2 ** 30  # a window side this wide covers any sequence the kernels take (:meth:`Band.for_kernels`)


@dataclass(frozen=True)
class Band:
    """Keys a query sees by position, bottom-right aligned: query ``i`` of ``N`` sits at key position
    ``p = i + M - N`` and sees keys ``p - left <= j <= p + right``; ``None`` leaves a side unbounded."""

    left: Optional[int] = None
    right: Optional[int] = None

    def for_kernels(self) -> "Band":
        """The same band with a side of :data:`UNBOUNDED_WINDOW` keys or more left unbounded: no sequence a kernel
        takes is that long, so nothing changes but the kernels' 32-bit position arithmetic, which such a side would
        overflow (``i + shift + right`` near ``2**31``)."""
        def side(x: Optional[int]) -> Optional[int]:
            return None if x is None or x >= UNBOUNDED_WINDOW else x
        return Band(side(self.left), side(self.right))

    @staticmethod
    def of(causal: bool, window: Tuple[int, int] = (-1, -1)) -> "Band":
        """The band of ``causal`` and ``window = (left, right)`` (``-1``: unbounded); causal caps ``right`` at 0.
        Bands are immutable: one object serves every call with the same arguments (outside ``torch.compile``
        tracing), as for :func:`flash_call`."""
        return _interned(_BANDS, (causal, window[0], window[1]), lambda: Band._of(causal, window))

    @staticmethod
    def _of(causal: bool, window: Tuple[int, int]) -> "Band":
        left, right = window
        right = None if right < 0 else right
        if causal:
            right = 0 if right is None else min(right, 0)
        return Band(None if left < 0 else left, right)


_BANDS: dict = {}  # (causal, left, right) -> Band (Band.of)
_INTERNED_KEPT = 4096  # entries a table of _interned keeps: more than a process makes, unless its scales vary


def _interned(table: dict, key: tuple, make):
    """The immutable value ``table`` holds for ``key``, made by ``make()`` on its first request (kept while the
    table has fewer than :data:`_INTERNED_KEPT` entries). Under ``torch.compile`` tracing it is made every time, with
    no lookup either (a guard on the table would recompile)."""
    if torch.compiler.is_compiling():
        return make()
    found = table.get(key)
    if found is None:
        found = make()
        if len(table) < _INTERNED_KEPT:
            table[key] = found
    return found


@dataclass(frozen=True)
class Branch:
    """One branch of dilated attention over query heads ``[head_start, head_start + n_heads)``.

    The sequence is cut into segments of ``segment`` positions (the last may be shorter); inside each, head ``h``
    attends among the positions ``offset, offset + dilation, ...`` of the segment, ``offset`` being ``h % dilation``
    when it is None (LongNet's per-head offsets).
    """

    segment: int
    dilation: int
    head_start: int
    n_heads: int
    offset: Optional[int] = None

    def covers(self, n_heads: int) -> bool:
        """Whether the branch gives every position of every head."""
        return self.dilation == 1 and self.head_start == 0 and self.n_heads == n_heads


@dataclass(frozen=True)
class BlockSparse:
    """The allowed block pairs: ``mask`` bool ``(B or 1, H or 1, q_blocks, k_blocks)`` at ``block_size``; ``lists``
    the Triton kernels' form of it (:class:`longattn.backends.triton.lists.BlockLists`), when a Triton pass runs."""

    mask: Tensor
    block_size: Tuple[int, int]
    lists: Optional[object] = None


def longest_sequence(cu: Sequence[int]) -> int:
    """The longest sequence of a packed batch's bounds ``cu`` (host ints; 0 for none). A plain loop: Dynamo cannot
    trace ``max``'s ``default=`` (``torch.compile`` logged a warning and broke the graph there on every trace)."""
    longest = 0
    for a, b in zip(cu, cu[1:]):
        longest = max(longest, b - a)
    return longest


@dataclass(frozen=True)
class SeqLens:
    """A packed batch: sequence ``b`` is query rows ``cu_q[b]:cu_q[b+1]`` and key rows ``cu_k[b]:cu_k[b+1]`` of
    tensors with one batch row; ``cu_*`` int32 on the inputs' device, ``max_*`` the longest sequence's lengths
    (the kernels' grid)."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def int32_index(t: Tensor) -> Tensor:
    """An index tensor (``cu_seqlens``, ``cache_seqlens``, ``block_table``) as the kernels read it: int32 and
    contiguous, a copy only where it is not so already (the kernels index it as ``base + i``, or by row with unit
    stride along the row)."""
    return t.to(torch.int32).contiguous()


@dataclass(frozen=True)
class KVCache:
    """The cache of a KV-cache call (``flash_attention_with_kvcache`` and its dilated twin): ``q`` holds the ``Nq``
    new tokens of each of ``B`` sequences.

    ``k_cache``/``v_cache``: contiguous ``(B, capacity, Hk, D)`` or paged ``(pages, page_size, Hk, D)`` read
    through ``block_table`` (int32 ``(B, max_pages)``); ``k_new``/``v_new``: ``(B, Nq, Hk, D)`` written into the
    cache at rows ``seqlens[b] ...`` before attending, or None; ``seqlens``: int32 ``(B,)`` cached rows before this
    call, ``length`` the same as an int when the caller gave one (every sequence that long: known on the host);
    ``page_size`` 0 for a contiguous cache; ``descales``: the ``(k, v)`` float32 factors of float8 caches;
    ``num_splits``: key splits per (sequence, KV head), 0 to choose; ``out``: a tensor to write the output into;
    ``signature``: what the shapes decide (the Triton backend keys its launch plans by it), None when not
    cacheable."""

    k_cache: Tensor
    v_cache: Tensor
    k_new: Optional[Tensor]
    v_new: Optional[Tensor]
    seqlens: Tensor
    length: Optional[int]
    block_table: Optional[Tensor]
    page_size: int
    capacity: int
    descales: Optional[Tuple[Tensor, Tensor]] = None
    num_splits: int = 0
    out: Optional[Tensor] = None
    signature: Optional[tuple] = None

    @property
    def n_new(self) -> int:
        """New tokens appended per sequence (0 without ``k_new``)."""
        return 0 if self.k_new is None else self.k_new.shape[1]


@dataclass(frozen=True)
class Descale:
    """FP8 inputs (``float8_e4m3fn``) and their descale factors: the true values of q, k and v are
    ``x.float() * descale`` per (batch or sequence, key/value head); ``scales`` is float32 ``(3, B, Hk)``
    (q's, k's, v's, contiguous; a query head reads its key/value head's factor)."""

    scales: Tensor


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of ``q (B, N, Hq, D)`` over ``k, v (B, M, Hk, D)`` (see :mod:`longattn.functional`).

    ``branches`` empty: every query head attends over the whole sequence (flash or block-sparse attention); else
    the dilated branches, merged by log-sum-exp. ``blocks``: block-sparse attention. ``seqlens``: a packed batch
    (:class:`SeqLens`; q, k, v then have one batch row, and each sequence is attended on its own, the band aligned
    per sequence and dilated segments counted from its first row). ``descale``: FP8 inputs (:class:`Descale`),
    forward only. ``out_dtype``: the output's dtype when it is not q's (FP8 inputs always name it; float32 keeps a
    partial result that is merged afterwards unrounded). ``sinks``: attention sinks ``(Hq,)``, one more softmax
    entry per query with no value (:func:`add_sinks`, applied by the runner to any backend's result). ``softcap``
    and ``alibi`` (float32 slopes ``(B, Hq)``, a row per sequence of a packed batch) modify the scores
    (:func:`modify_scores`) before the mask; a dilated call (``branches``) takes none of ``softcap``, ``alibi`` and
    ``sinks`` (the runner refuses it: :func:`longattn.runner.check_call`). ``cache``: a KV-cache call
    (:class:`KVCache`), run by a backend's ``decode`` (the band aligned at each sequence's last key, dilated
    segments counted from its first row). ``deterministic``: the gradients must be bitwise identical run to run, so
    no backward whose summation order varies may run it (the fused Gluon backward, SDPA's). ``need_lse``: whether
    the caller reads the log-sum-exp of a whole call (``return_lse``); where it does not, a backend that computes it
    only on request (FA4) may skip it and return None in its place.
    """

    scale: float
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    branches: Tuple[Branch, ...] = ()
    blocks: Optional[BlockSparse] = None
    seqlens: Optional[SeqLens] = None
    cache: Optional[KVCache] = None
    descale: Optional[Descale] = None
    out_dtype: Optional[torch.dtype] = None
    deterministic: bool = False
    sinks: Optional[Tensor] = None
    softcap: float = 0.0
    alibi: Optional[Tensor] = None
    alibi_offset: int = 0  # added to ALiBi's distance, |i + M - N + alibi_offset - j|: a block of a longer sequence
    need_lse: bool = True

    @property
    def band(self) -> Band:
        return Band.of(self.causal, self.window)

    @property
    def kind(self) -> str:
        """``"dilated"``, ``"block_sparse"`` or ``"flash"``."""
        return "dilated" if self.branches else "block_sparse" if self.blocks is not None else "flash"


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial results, log-sum-exps and merges of inputs of ``dtype`` are kept in: float64 for float64 inputs,
    float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize(x: Tensor, scales: Tensor, seqlens: Optional[Tensor] = None) -> Tensor:
    """The float32 values of FP8 ``x (B, S, H, D)``: ``x.float()`` times its factor per (batch, key/value head) from
    ``scales (B, Hk)``; with ``seqlens`` (int cumulative lengths of a packed batch, ``x`` of one batch row) row
    ``b`` of ``scales`` is sequence ``b``'s."""
    hk = scales.shape[1]
    if seqlens is not None:
        lengths = (seqlens[1:] - seqlens[:-1]).long()
        scales = torch.repeat_interleave(scales, lengths, dim=0, output_size=x.shape[1])[None]  # (1, S, Hk)
    else:
        scales = scales[:, None]  # (B, 1, Hk)
    per_head = torch.repeat_interleave(scales.float(), x.shape[2] // hk, dim=2) if hk else scales.float()
    return x.float() * per_head[..., None]


def head_groups(n_heads: int, n_groups: int) -> List[range]:
    """``head_split``: ``n_groups`` contiguous groups of near-equal size, the first ``n_heads % n_groups`` one head
    larger (empty groups when there are more groups than heads)."""
    base, extra = divmod(n_heads, n_groups)
    groups, start = [], 0
    for i in range(n_groups):
        size = base + (1 if i < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def check_head_split(head_split: bool, n_heads: int, n_branches: int, fn: str) -> None:
    """``head_split`` runs branch ``i`` on head group ``i``: with more branches than (a nonzero number of) query
    heads some branch would have no head, which is a ``ValueError`` naming ``fn`` rather than a branch silently
    dropped."""
    if head_split and 0 < n_heads < n_branches:
        raise ValueError(f"{fn}: head_split=True runs branch i on head group i, so it needs at least as many query "
                         f"heads as branches; got {n_branches} branches (segment_lengths) for {n_heads} heads: use "
                         f"fewer branches, more heads, or head_split=False")


def _check_symbolic_length(n: torch.SymInt, segment_lengths: Sequence[int], fn: str) -> None:
    """A sequence length that ``torch.export`` keeps symbolic (a ``Dim``) plans dilated branches only as a multiple
    of every segment length (the segments are then whole, only their count symbolic; ``torch.compile`` recompiles
    for another length instead). The checks are guards: a ``Dim`` that is not declared a multiple fails the export
    with PyTorch's suggested fix; an example length that is no multiple is a ``ValueError`` naming ``fn``."""
    for w in segment_lengths:
        if n < w or n % w != 0:
            raise ValueError(f"{fn}: under torch.export with a dynamic sequence length, the length must be a "
                             f"multiple of every segment length; got segment_lengths={tuple(segment_lengths)} for "
                             f"an example length of {int(n)}: declare it as a multiple (e.g. "
                             f"{max(segment_lengths)} * Dim(...)) or export with a static length")


def dilated_branches(n: int, n_heads: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                     head_split: bool, fn: Optional[str] = None) -> Tuple[Branch, ...]:
    """The branches of LongNet dilated attention on ``n`` positions and ``n_heads`` query heads (see
    :func:`longattn.dilated_attention`): a segment longer than the sequence is the sequence; with ``head_split``
    branch ``i`` runs on head group ``i`` with offset ``i % r_i``.

    A rate past the segment, the heads and the branches is cut to the largest of those three: the same branch
    (every head keeps its offset ``h % r`` or ``i % r``, and a segment holds one selected position per head either
    way), so no backend ever sees an astronomical rate. ``head_split`` with more branches than heads (a branch
    with no head to run on) is a ``ValueError`` naming ``fn`` (by default the calling function)."""
    check_head_split(head_split, n_heads, len(segment_lengths),
                     fn if fn is not None else sys._getframe(1).f_code.co_name)
    if isinstance(n, torch.SymInt) and export_flag():
        _check_symbolic_length(n, segment_lengths, fn if fn is not None else sys._getframe(1).f_code.co_name)
    groups = head_groups(n_heads, len(segment_lengths)) if head_split else None
    branches = []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        w = w if w <= n else max(n, 1)  # (a comparison, not min: torch.export makes min symbolic)
        r = min(r, max(w, n_heads, len(segment_lengths)))
        if groups is None:
            branches.append(Branch(w, r, 0, n_heads, None if r > 1 else 0))
        elif len(groups[i]):
            branches.append(Branch(w, r, groups[i].start, len(groups[i]), i % r))
    return tuple(branches)


def flash_call(scale: float, causal: bool = False, window: Tuple[int, int] = (-1, -1),
               need_lse: bool = True) -> AttentionCall:
    """The :class:`AttentionCall` of plain attention. A call is immutable, so one object serves every call with the
    same arguments: it is built once and then found by them (its construction is a measurable share of a small
    call's host time), except under ``torch.compile`` tracing."""
    window = tuple(window)
    return _interned(_PLAIN_CALLS, (scale, causal, window, need_lse),
                     lambda: AttentionCall(scale=scale, causal=causal, window=window, need_lse=need_lse))


_PLAIN_CALLS: dict = {}  # (scale, causal, window, need_lse) -> AttentionCall (flash_call)


def modify_scores(s: Tensor, softcap: float, slopes: Optional[Tensor], distance: Optional[Tensor]) -> Tensor:
    """The score modifications, in their order: soft-capping ``softcap * tanh(s / softcap)`` (``softcap`` 0: off),
    then ALiBi, ``- slope * distance`` with ``slopes`` broadcastable to ``s`` and ``distance`` ``|i + M - N - j|``
    (the query's key position minus the key's, in absolute value). ``s`` holds the scaled scores ``scale * q.k``."""
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s - slopes.to(s.dtype) * distance.to(s.dtype)
    return s


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """Attention sinks added to a finished result: ``out (B, N, Hq, D)`` and ``lse (B, Hq, N)`` over the keys,
    ``sinks (Hq,)`` logits. Each query's softmax gains the entry ``exp(sinks[h])`` with no value, so the output is
    scaled by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sinks[h])``, the returned log-sum-exp. A query that
    sees no key stays 0 (its log-sum-exp becomes ``sinks[h]``). Differentiable in out, lse and sinks (the gradient
    of a sink is ``-sum_i p_sink_i * rowsum(dO_i * O_i)`` through autograd); a sink of ``-inf`` is no sink."""
    s = sinks.to(lse.dtype)
    # -inf kept finite for the gradients; a NaN sink stays NaN, its gradient too (clamp's would be 0, not NaN)
    s = torch.where(torch.isneginf(s), torch.full_like(s, -1e30), s)[None, :, None].expand_as(lse)
    # a query that sees no key (lse -inf) takes the sink's score alone: logaddexp's own derivative at -inf is
    # finite (0), but its second derivative there is NaN (inf / inf), which would reach a double backward
    keys = ~torch.isneginf(lse)
    total = torch.where(keys, torch.logaddexp(torch.where(keys, lse, s), s), s)
    weight = torch.where(keys, torch.exp(torch.where(keys, lse, total) - total), 0.0)  # 0 for a query without keys
    out = (out.to(lse.dtype) * weight.transpose(1, 2)[..., None]).to(out.dtype)
    return out, torch.where(torch.isneginf(lse) & torch.isneginf(sinks.to(lse.dtype))[None, :, None], lse, total)


def merge_partial(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge two partial attention results: the weights are the softmax of the two log-sum-exps, so the result is
    attention over the union of both key sets (the Triton forward kernel's ``MERGE`` computes the same).

    ``lse_a``/``lse_b`` are shaped like ``out[..., 0]`` (pass transposed views of ``(B, H, N)`` tensors) and give the
    result's dtype (float32 or float64); the outputs are cast to it. Rows where both are ``-inf`` give 0 / ``-inf``
    with zero gradients; a ``+inf`` or NaN log-sum-exp gives NaN, as an IEEE softmax would. Differentiable.
    """
    lse_b = lse_b.to(lse_a.dtype)
    top = torch.maximum(lse_a, lse_b).detach()  # only a shift: the result does not depend on it
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_a = torch.exp(lse_a - top)
    w_b = torch.exp(lse_b - top)
    total = w_a + w_b
    live = total != 0  # (a NaN total stays NaN)
    safe = torch.where(live, total, torch.ones_like(total))
    out = (out_a.to(lse_a.dtype) * (w_a / safe)[..., None] + out_b.to(lse_a.dtype) * (w_b / safe)[..., None])
    lse = torch.where(live, top + torch.log(safe), torch.full_like(top, float("-inf")))
    return out, lse
