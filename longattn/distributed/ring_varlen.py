"""Packed variable-length batches across ranks: the ``cu_seqlens=`` paths of :func:`ring_attention` and
:func:`ring_dilated_attention`.

Two layouts of the packed batch of ``total`` rows (:mod:`longattn.distributed.shards`):

- ``"balanced"`` (flash attention; :func:`~longattn.distributed.shards.balanced_layout`): documents dealt out whole
  so that every rank has the same rows and causal work, the longest cut in ``2P`` chunks where that is needed.
  Each rank runs two single-GPU varlen calls: its whole documents on its own rows, while one ``all_to_all`` brings
  the rows of other ranks that its runs of cut documents read; then those runs against their documents' rows up to
  the run's end (causal) or all of them (:func:`balanced_flash_varlen`). See ``docs/distributed.md`` for why not a
  ring or an all-gather.
- ``"contiguous"``: rank ``i`` holds rows ``[i * n, (i + 1) * n)``, documents crossing shard boundaries. Each rank
  fetches, from the ranks that hold them, the rows its queries need, in one point-to-point exchange
  (:func:`fetch_rows`, differentiable: the backward sends the gradients of fetched rows back to their owners, which
  add them up), then runs the single-GPU variable-length function on them:

  - flash: the keys and values of every document its queries touch, from the document's first row to its last
    query (causal) or to the document's end, fetching only the rows needed. With a causal mask a document that
    spans several ranks gives the later ranks more keys (up to the whole document), and the documents' work (which
    grows as their squared lengths) falls on the ranks as it comes: on a long-tailed batch one rank can have 10-20%
    more work than the mean (:func:`work_per_rank`).
  - dilated: the queries, keys and values of the document pieces around its rows, cut at multiples of ``L``, the
    least common multiple of the segment lengths, from each document's start: such a cut is a segment boundary of
    every branch, so each piece is exactly dilated attention on its own. A rank computes at most ``2 * (L - 1)``
    rows more than its own (rows of neighbouring ranks, discarded), so this pays when the segments are short
    against the shard.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn import runner
from longattn._autograd import refuse_batched_gradients_across_ranks, refuse_second_derivative
from longattn._memo import own
from longattn.call import AttentionCall, SeqLens, accumulator_dtype, longest_sequence
from longattn.distributed.shards import balanced_layout, global_rank, group_size_rank, packed_order, row_ranges

FN = "ring_attention"  # (the function whose packed path this is, named in errors)
Range = Tuple[int, int]  # rows [lo, hi) of the global packed batch


def _transfers(ranges: Sequence[Range], rank: int, n: int) -> Tuple[List[Tuple[int, int, int]],
                                                                      List[Tuple[int, int, int]]]:
    """What this rank's fetch moves, as ``(peer, first, last)`` global rows: ``incoming`` (rows of
    ``ranges[rank]`` held by each rank, this one included) and ``outgoing`` (this rank's rows in another rank's
    range). Shards have ``n`` rows."""
    lo, hi = ranges[rank]
    incoming, outgoing = [], []
    for r, (rlo, rhi) in enumerate(ranges):
        a, b = max(lo, r * n), min(hi, (r + 1) * n)
        if a < b:
            incoming.append((r, a, b))
        a, b = max(rlo, rank * n), min(rhi, (rank + 1) * n)
        if r != rank and a < b:
            outgoing.append((r, a, b))
    return incoming, outgoing


def _exchange(sends: List[Tuple[int, Tensor]], recvs: List[Tuple[int, Tensor]], group) -> None:
    ops = [dist.P2POp(dist.isend, t.contiguous(), global_rank(group, r), group) for r, t in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, r), group) for r, t in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _FetchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ranges, group):
        _, rank = group_size_rank(group)
        n, (lo, _) = x.shape[0], ranges[rank]
        incoming, outgoing = _transfers(ranges, rank, n)
        out = x.new_empty((ranges[rank][1] - lo,) + tuple(x.shape[1:]))
        recvs = []
        for r, a, b in incoming:
            if r == rank:
                out[a - lo:b - lo] = x[a - rank * n:b - rank * n]
            else:
                recvs.append((r, out[a - lo:b - lo]))
        _exchange([(r, x[a - rank * n:b - rank * n]) for r, a, b in outgoing], recvs, group)
        ctx.ranges, ctx.group, ctx.n = ranges, group, n
        return out

    @staticmethod
    def backward(ctx, grad):
        # The forward's transfers reversed: gradients of fetched rows go back to their owners, which add them up.
        refuse_batched_gradients_across_ranks(FN, grad)
        _, rank = group_size_rank(ctx.group)
        n, (lo, _) = ctx.n, ctx.ranges[rank]
        incoming, outgoing = _transfers(ctx.ranges, rank, n)
        grad = grad.contiguous()
        dx = grad.new_zeros((n,) + tuple(grad.shape[1:]))
        sends = []
        for r, a, b in incoming:
            if r == rank:
                dx[a - rank * n:b - rank * n] += grad[a - lo:b - lo]
            else:
                sends.append((r, grad[a - lo:b - lo]))
        recvs = [(r, grad.new_empty((b - a,) + tuple(grad.shape[1:]))) for r, a, b in outgoing]
        _exchange(sends, recvs, ctx.group)
        for (_, a, b), (_, buf) in zip(outgoing, recvs):
            dx[a - rank * n:b - rank * n] += buf
        return dx, None, None


def fetch_rows(x: Tensor, ranges: Sequence[Range], group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Rows ``ranges[rank]`` of the global packed tensor whose contiguous shards ``x`` ``(n, ...)`` the ranks of
    ``group`` hold (collective: every rank passes the same ``ranges``, one range per rank). Differentiable."""
    return _FetchRows.apply(x, [tuple(r) for r in ranges], group)


def index_add(dst: Tensor, dim: int, index: Tensor, src: Tensor, deterministic: bool) -> Tensor:
    """``dst.index_add_(dim, index, src)``, in a fixed order when ``deterministic``: on CUDA the additions that meet
    in one row of ``dst`` are atomic adds in an order that varies from run to run, so a deterministic call adds in
    passes that each reach a row at most once (pass ``j`` adds the ``j``-th occurrence of every index)."""
    if not deterministic or index.numel() == 0:
        return dst.index_add_(dim, index, src)
    index = index.long()
    ordered, order = torch.sort(index, stable=True)
    occurrence = torch.empty_like(index)
    occurrence[order] = torch.arange(len(index), device=index.device) - torch.searchsorted(ordered, ordered)
    for j in range(int(occurrence.max()) + 1):
        at = (occurrence == j).nonzero().squeeze(1)
        dst.index_add_(dim, index[at], src.index_select(dim, at))
    return dst


def _documents(cu: List[int], a: int, e: int) -> List[Tuple[int, int]]:
    """The documents ``[s, t)`` that overlap rows ``[a, e)``, in order (empty documents left out)."""
    return [(s, t) for s, t in zip(cu, cu[1:]) if s < t and s < e and t > a]


def _cu(points: List[int], base: int, device) -> Tensor:
    return torch.tensor([p - base for p in points], dtype=torch.int32, device=device)


def flash_plan(cu: List[int], n: int, world: int, causal: bool) -> List[Tuple[Range, List[int], List[int]]]:
    """For every rank: the key rows it fetches, and the boundaries (global rows) of its query and key pieces."""
    plans = []
    for r in range(world):
        a, e = r * n, (r + 1) * n
        docs = _documents(cu, a, e)
        if not docs:
            plans.append(((a, a), [a, e], [a, a]))
            continue
        q_points = [a] + [s for s, _ in docs[1:]] + [e]
        k_points = [docs[0][0]] + [s for s, _ in docs[1:]] + [e if causal else docs[-1][1]]
        plans.append(((k_points[0], k_points[-1]), q_points, k_points))
    return plans


def ring_flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: List[int], *, group, causal: bool, scale: float,
                      backend: str, layout: str = "contiguous", deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """This rank's rows of ``flash_attention_varlen`` on the packed batch sharded over ``group`` in ``layout``
    (``"contiguous"`` or ``"balanced"``): ``(out, lse)``, both differentiable; ``deterministic`` as there."""
    if layout == "balanced":
        return balanced_flash_varlen(q, k, v, cu, group=group, causal=causal, scale=scale, backend=backend,
                                     deterministic=deterministic)
    from longattn.varlen import flash_attention_varlen

    world, rank = group_size_rank(group)
    plans = flash_plan(cu, q.shape[0], world, causal)
    (k_lo, _), q_points, k_points = plans[rank]
    kv = fetch_rows(torch.cat((k, v), dim=-1), [p[0] for p in plans], group)
    ks, vs = kv.split(k.shape[-1], dim=-1)
    return flash_attention_varlen(q, ks, vs, cu_seqlens_q=_cu(q_points, q_points[0], q.device),
                                  cu_seqlens_k=_cu(k_points, k_lo, q.device), causal=causal, scale=scale,
                                  return_lse=True, backend=backend, deterministic=deterministic)


# --- the balanced layout -------------------------------------------------------------------------------------------

def _pairs(nq: int, nk: int, causal: bool) -> int:
    """Visible query-key pairs of a sequence of ``nq`` queries and ``nk >= nq`` keys (causal: aligned bottom-right)."""
    return nq * nk - (nq * (nq - 1) // 2 if causal else 0)


class Calls(NamedTuple):
    """A rank's two varlen calls in the balanced layout (host lists): ``local`` its whole documents, the boundaries
    ``(cu_q, cu_k)`` of a call over all its rows whose runs of cut documents have no keys; ``cut`` its runs of cut
    documents (the shard's last rows), ``(cu_q, cu_k)`` over them and ``keys``, the global rows of the call's keys
    in order; ``whole``: how many rows its whole documents take (the first ones)."""

    local: Tuple[List[int], List[int]]
    cut: Tuple[List[int], List[int]]
    keys: Tensor
    whole: int


def balanced_calls(cu: Tuple[int, ...], world: int, rank: int, causal: bool) -> Calls:
    """The calls of rank ``rank``: its whole documents attend to themselves; each run of a cut document (rows
    ``[g, g + m)`` of document ``[s, e)``) to the document's rows ``[s, g + m)`` (causal: the run's queries are the
    last ones, aligned bottom-right) or ``[s, e)``."""
    layout = balanced_layout(cu, world)
    whole = [cu[d + 1] - cu[d] for d in layout.whole[rank]]
    parts = layout.parts[rank]
    local_q = list(itertools.accumulate(whole + [m for _, _, m in parts], initial=0))
    local_k = list(itertools.accumulate(whole + [0] * len(parts), initial=0))
    starts = torch.tensor([cu[d] for d, _, _ in parts], dtype=torch.int64)
    ends = torch.tensor([g + m if causal else cu[d + 1] for d, g, m in parts], dtype=torch.int64)
    cut_q = list(itertools.accumulate((m for _, _, m in parts), initial=0))
    cut_k = [0] + torch.cumsum(ends - starts, 0).tolist()
    return Calls((local_q, local_k), (cut_q, cut_k), row_ranges(starts, ends - starts), sum(whole))


def work_per_rank(cu: Sequence[int], world: int, causal: bool, layout: str) -> List[int]:
    """The query-key pairs each rank's attention computes for a packed batch with boundaries ``cu`` split over
    ``world`` ranks in ``layout`` (``"contiguous"`` or ``"balanced"``), from the calls the ranks make. The batch's
    pairs (over its documents, ``L (L + 1) / 2`` causal, ``L ** 2`` otherwise) divided by ``world`` is a rank's
    share."""
    cu = tuple(int(c) for c in cu)
    work = []
    for rank in range(world):
        if layout == "balanced":
            calls = balanced_calls(cu, world, rank, causal)
            sequences = [calls.local, calls.cut]
        else:
            _, q_points, k_points = flash_plan(list(cu), cu[-1] // world, world, causal)[rank]
            sequences = [(q_points, k_points)]
        work.append(sum(_pairs(q1 - q0, k1 - k0, causal) for cu_q, cu_k in sequences
                        for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]) if q1 > q0 and k1 > k0))
    return work


class _Exchange(NamedTuple):
    """The rows of keys and values the ranks swap for their calls over cut documents (one ``all_to_all``):
    ``send`` this rank's rows (local indices) for the other ranks, rank after rank, ``send_splits`` and
    ``recv_splits`` the row counts per rank, ``any``: whether any rank swaps anything."""

    send: Tensor
    send_splits: List[int]
    recv_splits: List[int]
    any: bool


class _Plan(NamedTuple):
    """What a rank's calls need on its device: the two calls' ``seqlens`` ``local`` and ``cut``, ``whole`` rows,
    ``sources`` (the call over cut documents reads its keys at these rows of its own runs followed by the rows
    received) and the ``exchange``."""

    local: SeqLens
    cut: SeqLens
    whole: int
    sources: Tensor
    exchange: _Exchange


def _seqlens(bounds: Tuple[List[int], List[int]], device) -> SeqLens:
    # own(): the library made these tensors, so the kernels read their values on the host once
    return SeqLens(*(own(torch.tensor(c, dtype=torch.int32, device=device)) for c in bounds),
                   longest_sequence(bounds[0]), longest_sequence(bounds[1]))


@functools.lru_cache(maxsize=16)
def balanced_plan(cu: Tuple[int, ...], world: int, rank: int, causal: bool, device: torch.device) -> _Plan:
    """:func:`balanced_calls` of every rank, turned into this rank's plan on ``device`` (cached: a model's layers
    share one batch)."""
    n = cu[-1] // world
    calls = [balanced_calls(cu, world, r, causal) for r in range(world)]
    where = packed_order(cu, "balanced", world)  # global row -> owner * n + local row
    needs = []  # needs[r][p]: the rows (global, sorted) rank r reads from rank p
    for r, c in enumerate(calls):
        owner = where[c.keys] // n
        needs.append([torch.unique(c.keys[owner == p]) if p != r else c.keys[:0] for p in range(world)])
    mine = calls[rank]
    owner, local = where[mine.keys] // n, where[mine.keys] % n
    first = list(itertools.accumulate((len(x) for x in needs[rank]), initial=n - mine.whole))
    sources = local - mine.whole  # the cut runs' own rows come first, then what each rank sent, rank after rank
    for p in range(world):
        if p != rank:
            at = owner == p
            sources[at] = first[p] + torch.searchsorted(needs[rank][p], mine.keys[at])
    send = torch.cat([where[needs[p][rank]] % n for p in range(world)])
    exchange = _Exchange(send.to(device), [len(needs[p][rank]) for p in range(world)],
                         [len(x) for x in needs[rank]], any(len(x) for row in needs for x in row))
    return _Plan(_seqlens(mine.local, device), _seqlens(mine.cut, device), mine.whole, sources.to(device), exchange)


def _start_exchange(k: Tensor, v: Tensor, ex: _Exchange, group):
    """Start sending this rank's rows ``ex.send`` of ``k``, ``v`` (stacked) to the ranks that read them: ``(buffer
    of the rows received, the work to wait for)``, or ``(empty buffer, None)`` when no rank swaps anything."""
    rows = torch.stack((k.index_select(0, ex.send), v.index_select(0, ex.send)), dim=1)
    got = rows.new_empty((sum(ex.recv_splits),) + tuple(rows.shape[1:]))
    if not ex.any:
        return got, None
    return got, dist.all_to_all_single(got, rows, ex.recv_splits, ex.send_splits, group=group, async_op=True)


def _cut_keys(k: Tensor, v: Tensor, got: Tensor, plan: _Plan) -> Tuple[Tensor, Tensor]:
    """The keys and values of the call over cut documents: its rows of this rank's cut runs and of ``got``."""
    w = plan.whole
    keys = torch.cat((torch.stack((k[w:], v[w:]), dim=1), got)).index_select(0, plan.sources)
    return keys[:, 0], keys[:, 1]


class _BalancedVarlen(torch.autograd.Function):
    """``(out, lse)`` of a rank's rows in the packed balanced layout, differentiable in both.

    Forward: the exchange of the rows the call over cut documents reads starts, the call over the whole documents
    runs meanwhile (its runs of cut documents get no keys there), then the call over the cut runs writes their
    rows. Backward: the same exchange, overlapped with the whole documents' backward, then the cut runs' backward;
    the float32 gradients of rows received go back to their owners (a second ``all_to_all``), which add them up
    (in a fixed order for deterministic calls).
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, calls: Tuple[AttentionCall, AttentionCall], impl: str, group):
        w = plan.whole
        got, work = _start_exchange(k, v, plan.exchange, group)
        out, lse = runner.forward(q[None], k[None, :w], v[None, :w], calls[0], backend=impl, fn=FN)
        if work is not None:
            work.wait()
        if w < q.shape[0]:
            ks, vs = _cut_keys(k, v, got, plan)
            out[:, w:], lse[:, :, w:] = runner.forward(q[None, w:], ks[None], vs[None], calls[1], backend=impl,
                                                       fn=FN)
        ctx.save_for_backward(q, k, v, out, lse)  # not the keys received: the backward swaps them again
        ctx.cfg = (plan, calls, impl, group)
        ctx.set_materialize_grads(False)
        return out[0], lse[0]

    @staticmethod
    def backward(ctx, do, dlse):
        refuse_second_derivative(FN)
        refuse_batched_gradients_across_ranks(FN, do, dlse)
        q, k, v, out, lse = ctx.saved_tensors
        plan, calls, impl, group = ctx.cfg
        w, acc = plan.whole, accumulator_dtype(q.dtype)
        deterministic = calls[0].deterministic
        do = torch.zeros_like(out) if do is None else do[None]
        dlse = None if dlse is None else dlse[None]
        got, work = _start_exchange(k, v, plan.exchange, group)
        dq, dk_w, dv_w = runner.backward(do, q[None], k[None, :w], v[None, :w], out, lse, calls[0], backend=impl,
                                         fn=FN, grad_dtype=acc, dlse=dlse)
        dkv = torch.zeros((k.shape[0], 2) + tuple(k.shape[1:]), dtype=acc, device=k.device)
        dkv[:w, 0], dkv[:w, 1] = dk_w[0], dv_w[0]
        if work is not None:
            work.wait()
        back = dkv.new_zeros((len(got),) + tuple(dkv.shape[1:]))
        if w < q.shape[0]:
            ks, vs = _cut_keys(k, v, got, plan)
            dq_c, dk_c, dv_c = runner.backward(do[:, w:], q[None, w:], ks[None], vs[None], out[:, w:],
                                               lse[:, :, w:], calls[1], backend=impl, fn=FN, grad_dtype=acc,
                                               dlse=None if dlse is None else dlse[:, :, w:])
            dq[:, w:] = dq_c  # (the first call gave these rows no keys)
            sources = torch.zeros((k.shape[0] - w + len(got),) + tuple(dkv.shape[1:]), dtype=acc, device=k.device)
            index_add(sources, 0, plan.sources, torch.stack((dk_c[0], dv_c[0]), dim=1),  # a row read twice: both
                      deterministic)
            dkv[w:] += sources[:k.shape[0] - w]
            back = sources[k.shape[0] - w:]
        ex = plan.exchange
        if ex.any:  # the gradients of the rows received go back to their owners
            mine = dkv.new_empty((len(ex.send),) + tuple(dkv.shape[1:]))
            dist.all_to_all_single(mine, back.contiguous(), ex.send_splits, ex.recv_splits, group=group)
            index_add(dkv, 0, ex.send, mine, deterministic)
        return dq[0].to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype), None, None, None, None


def balanced_flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Sequence[int], *, group, causal: bool, scale: float,
                          backend: str, deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """This rank's rows of ``flash_attention_varlen`` on a packed batch in the balanced layout: ``(out (n, Hq, D),
    lse (Hq, n))``, differentiable in q, k, v (and through ``lse``); ``deterministic``: the calls' flag, and the
    gradients of rows read twice summed in a fixed order."""
    world, rank = group_size_rank(group)
    plan = balanced_plan(tuple(int(c) for c in cu), world, rank, bool(causal), q.device)
    calls = tuple(AttentionCall(scale=scale, causal=bool(causal), seqlens=s, deterministic=deterministic)
                  for s in (plan.local, plan.cut))
    impl = runner.choose(backend, q[None], calls[0], fn=FN)
    return _BalancedVarlen.apply(q, k, v, plan, calls, impl, group)


def dilated_plan(cu: List[int], n: int, world: int, period: int) -> List[Tuple[Range, List[int]]]:
    """For every rank: the rows it fetches (its rows widened to multiples of ``period`` from each document's
    start, within the document) and the boundaries (global rows) of the pieces in them."""
    plans = []
    for r in range(world):
        a, e = r * n, (r + 1) * n
        docs = _documents(cu, a, e)
        if not docs:
            plans.append(((a, a), [a, a]))
            continue
        s0, t0 = docs[0]
        lo = s0 + (a - s0) // period * period if a > s0 else s0
        s1, t1 = docs[-1]
        hi = min(t1, s1 + -(-(e - s1) // period) * period)
        points = [lo] + [s for s, _ in docs[1:]] + [hi]
        plans.append(((lo, hi), points))
    return plans


def ring_dilated_varlen(q: Tensor, k: Tensor, v: Tensor, cu: List[int], *, group, segment_lengths: Sequence[int],
                        dilation_rates: Sequence[int], causal: bool, head_split: bool, scale: float,
                        backend: str, deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """This rank's rows of ``dilated_attention_varlen`` on the packed batch sharded over ``group``."""
    from longattn.varlen import dilated_attention_varlen

    world, rank = group_size_rank(group)
    n = q.shape[0]
    period = 1
    for w in segment_lengths:
        period = period * w // math.gcd(period, w)
    plans = dilated_plan(cu, n, world, period)
    (lo, hi), points = plans[rank]
    ranges = [p[0] for p in plans]
    hq = q.shape[1]
    qkv = fetch_rows(torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1), ranges, group)
    d = q.shape[-1]
    qs, ks, vs = qkv.split([hq * d, k.shape[1] * d, v.shape[1] * d], dim=-1)
    out, lse = dilated_attention_varlen(qs.unflatten(1, (hq, d)), ks.unflatten(1, (k.shape[1], d)),
                                        vs.unflatten(1, (v.shape[1], d)), cu_seqlens=_cu(points, lo, q.device),
                                        segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                        causal=causal, head_split=head_split, scale=scale, return_lse=True,
                                        backend=backend, deterministic=deterministic)
    mine = slice(rank * n - lo, (rank + 1) * n - lo)
    return out[mine], lse[:, mine]
