"""Packed variable-length batches across ranks: the ``cu_seqlens=`` paths of :func:`ring_attention` and
:func:`ring_dilated_attention`.

The packed batch of ``total`` rows is split contiguously: rank ``i`` holds rows ``[i * n, (i + 1) * n)``, documents
crossing shard boundaries. Each rank fetches, from the ranks that hold them, the rows its queries need, in one
point-to-point exchange (:func:`fetch_rows`, differentiable: the backward sends the gradients of fetched rows back
to their owners, which add them up), then runs the single-GPU variable-length function on them:

- flash: the keys and values of every document its queries touch, from the document's first row to its last query
  (causal) or to the document's end. This is the all-gather-by-document scheme of Llama 3's context parallelism,
  fetching only the rows needed; the alternative, a ring of K/V shards with a per-document zigzag layout, needs
  every document re-laid out by the caller and one pass per ring step. With the contiguous layout a document that
  spans several ranks under a causal mask gives the later ranks more keys (up to the whole document), so work is
  balanced only when documents are short against the shard (the usual packed batch).
- dilated: the queries, keys and values of the document pieces around its rows, cut at multiples of ``L``, the
  least common multiple of the segment lengths, from each document's start: such a cut is a segment boundary of
  every branch, so each piece is exactly dilated attention on its own. A rank computes at most ``2 * (L - 1)``
  rows more than its own (rows of neighbouring ranks, discarded), so this pays when the segments are short
  against the shard.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.distributed.shards import global_rank, group_size_rank

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
                      backend: str) -> Tuple[Tensor, Tensor]:
    """This rank's rows of ``flash_attention_varlen`` on the packed batch sharded over ``group``: ``(out, lse)``."""
    from longattn.varlen import flash_attention_varlen

    world, rank = group_size_rank(group)
    plans = flash_plan(cu, q.shape[0], world, causal)
    (k_lo, _), q_points, k_points = plans[rank]
    kv = fetch_rows(torch.cat((k, v), dim=-1), [p[0] for p in plans], group)
    ks, vs = kv.split(k.shape[-1], dim=-1)
    return flash_attention_varlen(q, ks, vs, cu_seqlens_q=_cu(q_points, q_points[0], q.device),
                                  cu_seqlens_k=_cu(k_points, k_lo, q.device), causal=causal, scale=scale,
                                  return_lse=True, backend=backend)


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
                        backend: str) -> Tuple[Tensor, Tensor]:
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
                                        backend=backend)
    mine = slice(rank * n - lo, (rank + 1) * n - lo)
    return out[mine], lse[:, mine]
