"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: all-to-all from sequence shards to whole sequences of some heads.

Every rank holds its shard ``(B, N/P, H, D)`` of the queries, keys and values (any layout of
:func:`longattn.distributed.shard`). One all-to-all gives each rank the *whole* sequence of ``Hq/P`` query heads
(and of the key/value heads those read); the rank puts the sequence back into its natural order (a zigzag shard
holds two chunks from both ends), runs the single-GPU operation on it, and a second all-to-all returns every rank
its rows of every head. Both all-to-alls are differentiable (each one's backward is the other), so the local call
keeps its own autograd and any single-GPU operation can run in the middle: flash attention
(:func:`ulysses_attention`), LongNet's dilated attention (:func:`ulysses_dilated_attention`), their packed
variable-length forms.

Heads: ``Hq`` must be divisible by ``P``. Key/value heads are repeated ``P / gcd(Hk, P)`` times before the
all-to-all, so that the ``Hk * P / gcd(Hk, P)`` heads divide evenly and rank ``r`` receives exactly the copies
its query heads read (none when ``P`` divides ``Hk``; one head per rank when ``Hk`` divides ``P``).

Per rank and call: the forward sends and receives ``(N/P) (Hq + 2 Hk') D`` elements (``Hk'`` the repeated key/value
heads) in one all-to-all, and ``(N/P) Hq D`` for the output; the backward the same amounts reversed.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.call import AttentionCall, Branch, SeqLens, dilated_branches
from longattn.distributed.ring import with_score_mods
from longattn.distributed.shards import (
    LAYOUTS, Resolved, check_same_across_ranks, chunk_ids, effective, group_size_rank,
)

# The local computation on whole sequences of this rank's heads: (q, k, v, first query head) -> (out, lse), lse
# None when the call does not return it
Local = Callable[[Tensor, Tensor, Tensor, int], Tuple[Tensor, Tensor]]


def _chunk_order(layout: str, world: int) -> Optional[List[int]]:
    """The global chunk numbers of the gathered shards (rank 0's chunks, then rank 1's, ...), or None when that
    is already the natural order (contiguous layout, or one rank)."""
    order = [c for r in range(world) for c in chunk_ids(layout, r, world)]
    return None if order == sorted(order) else order


def _in_order(x: Tensor, chunks: List[int]) -> Tensor:
    """``x[:, chunks]`` of a ``(B, chunks, ...)`` tensor, by slices: indexing a GPU tensor with a Python list first
    copies the list to the GPU, which waits for the stream."""
    return torch.cat([x[:, c:c + 1] for c in chunks], dim=1)


def _seq_to_heads(xs: Sequence[Tensor], group, world: int, order: Optional[List[int]]) -> List[Tensor]:
    """Shards ``(B, n, H_x, D)`` (one dtype) -> whole sequences ``(B, P n, H_x / P, D)`` in natural order of this
    rank's ``1/P`` of every tensor's heads, in one all-to-all."""
    B, n, _, D = xs[0].shape
    heads = [x.shape[2] // world for x in xs]
    send = xs[0].new_empty((world, B, n, sum(heads), D))
    start = 0
    for x, h in zip(xs, heads):  # part i of the heads goes to rank i
        send[:, :, :, start:start + h] = x.reshape(B, n, world, h, D).permute(2, 0, 1, 3, 4)
        start += h
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    S = send.shape[3]
    full = recv.permute(1, 0, 2, 3, 4)  # (B, P, n, S, D): the ranks' rows in shard order
    if order is not None:  # shard order -> natural order: natural chunk c is gathered chunk order.index(c)
        chunks = len(order)
        full = _in_order(full.reshape(B, chunks, world * n // chunks, S, D), sorted(range(chunks),
                                                                               key=order.__getitem__))
    full = full.reshape(B, world * n, S, D)
    return list(full.split(heads, dim=2))


def _heads_to_seq(xs: Sequence[Tensor], group, world: int, order: Optional[List[int]]) -> List[Tensor]:
    """The inverse of :func:`_seq_to_heads`: whole sequences ``(B, N, h_x, D)`` of this rank's heads -> this rank's
    shard ``(B, N/P, P h_x, D)`` of every head."""
    B, N, _, D = xs[0].shape
    n = N // world
    heads = [x.shape[2] for x in xs]
    send = xs[0].new_empty((world, B, n, sum(heads), D))
    start = 0
    for x, h in zip(xs, heads):
        if order is not None:  # natural order -> shard order
            x = _in_order(x.reshape(B, len(order), N // len(order), h, D), order)
        send[:, :, :, start:start + h] = x.reshape(B, world, n, h, D).transpose(0, 1)
        start += h
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's heads of this rank's rows
    outs, start = [], 0
    for h in heads:
        outs.append(recv[:, :, :, start:start + h].permute(1, 2, 0, 3, 4).reshape(B, n, world * h, D))
        start += h
    return outs


class _AllToAll(torch.autograd.Function):
    """:func:`_seq_to_heads` (``to_heads``) or :func:`_heads_to_seq` of several tensors; the backward runs the
    other one on the gradients."""

    @staticmethod
    def forward(ctx, to_heads: bool, group, world: int, order, *xs):
        ctx.cfg = (to_heads, group, world, order)
        return tuple((_seq_to_heads if to_heads else _heads_to_seq)(xs, group, world, order))

    @staticmethod
    def backward(ctx, *grads):
        to_heads, group, world, order = ctx.cfg
        grads = [g.contiguous() for g in grads]
        return (None, None, None, None, *(_heads_to_seq if to_heads else _seq_to_heads)(grads, group, world, order))


def kv_repeats(hk: int, world: int) -> int:
    """How many times each key/value head is repeated before the all-to-all: ``P / gcd(Hk, P)``, the least count
    that makes the heads divisible by ``P``. Rank ``r`` then receives the copies its query heads read: with
    ``g' = Hq / lcm(Hk, P)`` local query heads per received key/value head, local query head ``j`` (global
    ``r Hq / P + j``) reads received head ``j // g'``, a copy of head ``(r Hq / P + j) // (Hq / Hk)``."""
    return world // math.gcd(hk, world)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, local: Local, group, world: int, rank: int, layout: str,
             packed: bool, return_lse: bool):
    """``local`` on whole sequences of this rank's heads, between the two all-to-alls; this rank's rows back."""
    if packed:  # (n, H, D): one batch row for the all-to-alls
        q, k, v = q[None], k[None], v[None]
    order = _chunk_order(layout, world)
    c = kv_repeats(k.shape[2], world)
    if c > 1:
        k, v = k.repeat_interleave(c, dim=2), v.repeat_interleave(c, dim=2)
    qh, kh, vh = _AllToAll.apply(True, group, world, order, q, k, v)
    if packed:
        qh, kh, vh = qh.squeeze(0), kh.squeeze(0), vh.squeeze(0)
    out, lse = local(qh, kh, vh, rank * (q.shape[2] // world))
    if packed:
        out, lse = out[None], None if lse is None else lse[None]
    (out,) = _AllToAll.apply(False, group, world, order, out)
    if return_lse:  # (B, h, N) -> (B, N, h, 1) -> this rank's rows of every head (B, n, Hq, 1) -> (B, Hq, n)
        (lse,) = _AllToAll.apply(False, group, world, order, lse.transpose(1, 2).unsqueeze(-1))
        lse = lse.squeeze(-1).transpose(1, 2)
    else:
        lse = None
    if packed:
        out, lse = out.squeeze(0), None if lse is None else lse.squeeze(0)
    return out, lse


def ulysses_options(fn: str, q: Tensor, k: Tensor, v: Tensor, world: int, *, layout, causal, scale, backend,
                    return_lse, cu_seqlens, dilated: Optional[dict] = None, ring_size: Optional[int] = None,
                    deterministic=False) -> Tuple[dict, Optional[str]]:
    """This rank's call checked: ``(its options as they take effect, None)``, or ``({}, the error message)``.

    ``world`` is the Ulysses degree (``Hq`` must be divisible by it). ``ring_size``: the call is a hybrid's, whose
    ``layout`` cuts the sequence over a ring of that many Ulysses groups (so the zigzag chunks are of a Ulysses
    group's rows, and packed batches must be contiguous). Every option of the calling function is in the dict, and
    all ranks must agree on it (:func:`check_same_across_ranks`): a new option is added there.
    """
    from longattn import _validation as V
    from longattn.distributed.ring import packed_cu_seqlens

    try:
        causal, return_lse = (V.check_flag(x, name, fn) for name, x in (("causal", causal), ("return_lse", return_lse)))
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
        V.check_backend(backend, fn)
        if cu_seqlens is None:
            cu = None
            V.check_attention_inputs(q, k, v, fn=fn, self_attention=True)
        else:
            cu = packed_cu_seqlens(q, k, v, cu_seqlens, world * (ring_size or 1), fn)
            if ring_size is not None and layout != "contiguous":
                raise ValueError(f"{fn}: packed batches (cu_seqlens) are split contiguously over the ring; layout "
                                 f"must be 'contiguous', got {layout!r}")
        chunked = q.shape[0 if cu is not None else 1] * (1 if ring_size is None else world)
        if layout == "zigzag" and chunked % 2:
            raise ValueError(f"{fn}: the zigzag layout needs an even {'ring ' if ring_size else ''}shard length "
                             f"(two chunks), got {chunked}")
        hq = q.shape[-2]
        if hq % world:
            raise ValueError(
                f"{fn}: the number of query heads (Hq={hq}) must be divisible by the Ulysses group size (P={world}): "
                f"each rank attends with Hq/P whole heads. An uneven split would need padding heads (the rank with "
                f"the most heads sets the pace either way); use ring_attention, or a group whose size divides Hq")
        scale_used = V.check_scale(scale, q.shape[-1], fn=fn)
        deterministic_used = V.check_deterministic(deterministic, fn)
        options = {"layout": layout, "causal": causal, "scale": Resolved(scale_used, scale), "backend": backend,
                   "return_lse": return_lse, "cu_seqlens": cu,
                   "deterministic": Resolved(deterministic_used, deterministic)}
        if dilated is not None:
            segs, rates = V.check_dilated_args(dilated["segment_lengths"], dilated["dilation_rates"], fn=fn)
            head_split = V.check_flag(dilated["head_split"], "head_split", fn)
            options.update(segment_lengths=segs, dilation_rates=rates, head_split=head_split)
    except (TypeError, ValueError) as e:
        return {}, str(e)
    return options, None


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous",
    causal: bool = False, scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, deterministic: bool = False,
):
    """Exact attention over a sequence sharded across ``group``, by Ulysses' all-to-alls (collective call).

    Args:
        q: ``(B, N/P, Hq, D)``, this rank's shard of the queries as ``shard(x, group, layout)`` gives it; ``Hq``
            must be divisible by the group size ``P``.
        k, v: ``(B, N/P, Hk, D)``, ``Hq % Hk == 0``; any ``Hk`` (repeated as needed, see :func:`kv_repeats`).
        group: the process group the sequence is split over (default: the world).
        layout: ``"contiguous"`` (default) or ``"zigzag"``: the layout the shards were cut with. Every rank
            computes whole sequences, so the layout does not change the balance of causal work; ``zigzag`` is
            accepted so that Ulysses can run on the shards a ring (or hybrid) layer uses, at the cost of one
            reordering copy each way.
        causal: global causal masking. scale: softmax scale, default ``D ** -0.5``.
        backend: the local kernels, as :func:`longattn.flash_attention`.
        return_lse: also return the log-sum-exp of this rank's rows, ``(B, Hq, N/P)`` (float32; float64 for
            float64 inputs); differentiable.
        cu_seqlens: a packed variable-length batch: q ``(total/P, Hq, D)``, k and v ``(total/P, Hk, D)`` are this
            rank's rows (``shard(x, group, layout, dim=0)``; documents may cross shard boundaries) and
            ``cu_seqlens`` ``(batch + 1,)`` the global boundaries, the same on every rank; each rank runs
            :func:`longattn.flash_attention_varlen` on the whole batch of its heads. lse is then ``(Hq, total/P)``.
        softcap, alibi_slopes, sinks: logit soft-capping, ALiBi slopes ``(Hq,)`` or ``(B, Hq)`` (``(batch, Hq)``
            with ``cu_seqlens``) and attention sinks ``(Hq,)``, as in :func:`longattn.flash_attention`; every rank
            passes the same values and applies those of its heads. The gradient of ``sinks`` on each rank is that of
            its heads (zero elsewhere): summed over the group (as for any weight the ranks share) it is the whole
            gradient.
        deterministic: bitwise-identical gradients from run to run, as in :func:`longattn.flash_attention` (the
            local call's flag; also on under PyTorch's deterministic mode); compared across ranks as it takes effect.

    Returns:
        This rank's shard of ``flash_attention(q_full, k_full, v_full, causal=causal)`` (with ``cu_seqlens``, its
        rows of ``flash_attention_varlen`` on the gathered batch), in the layout of the inputs; differentiable in
        ``q``, ``k``, ``v`` (and ``sinks``). All ranks must pass shards of the same shape and dtype and the same
        options (compared as they take effect); otherwise every rank raises ``ValueError`` naming what differs and
        each rank's value. A group of one rank runs the single-GPU op.

    Memory per rank: the gathered sequences of ``Hq/P`` query heads and their key/value heads (``N (Hq + 2 Hk')
    D / P`` elements, ``Hk'`` the repeated key/value heads), their output, and the local kernel's own memory.
    """
    fn = "ulysses_attention"
    world, _ = group_size_rank(group)
    options, local_error = ulysses_options(fn, q, k, v, world, layout=layout, causal=causal, scale=scale,
                                           backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens,
                                           deterministic=deterministic)
    options, mods, local_error = with_score_mods(options, local_error, q, fn, softcap=softcap,
                                                 alibi_slopes=alibi_slopes, sinks=sinks)
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn=fn, options=options, local_error=local_error)
    o = effective(options)
    if o["cu_seqlens"] is None:
        from longattn.functional import flash_attention as attend
        kw = {}
    else:
        from longattn.varlen import flash_attention_varlen as attend
        kw = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)

    def local(q, k, v, first_head):
        result = attend(q, k, v, causal=o["causal"], scale=o["scale"], backend=backend, return_lse=o["return_lse"],
                        deterministic=o["deterministic"], **mods.heads(first_head, q.shape[-2]).kwargs(), **kw)
        return result if o["return_lse"] else (result, None)

    return ulysses_run(q, k, v, local, group, o)


def ulysses_run(q: Tensor, k: Tensor, v: Tensor, local: Local, group, o: dict):
    """``local`` between the two all-to-alls over ``group`` (alone for a group of one rank), with the options ``o``
    as they take effect (``layout``, ``cu_seqlens``, ``return_lse``): ``out``, or ``(out, lse)``."""
    world, rank = group_size_rank(group)
    if world == 1:  # the single-GPU op (zigzag over one rank is the natural order)
        out, lse = local(q, k, v, 0)
    else:
        out, lse = _ulysses(q, k, v, local, group, world, rank, o["layout"], o["cu_seqlens"] is not None,
                            o["return_lse"])
    return (out, lse) if o["return_lse"] else out


def local_branches(branches: Sequence[Branch], first: int, n_heads: int) -> Tuple[Branch, ...]:
    """The dilated ``branches`` of all query heads restricted to heads ``[first, first + n_heads)``, renumbered
    from 0. A branch whose offset is per head (``h % r`` of the *global* head ``h``) keeps that form when ``r``
    divides ``first``; otherwise each of its heads becomes a branch of one head with its fixed offset."""
    local = []
    for br in branches:
        a, b = max(br.head_start, first), min(br.head_start + br.n_heads, first + n_heads)
        if a >= b:
            continue
        if br.offset is not None or first % br.dilation == 0:
            local.append(replace(br, head_start=a - first, n_heads=b - a))
        else:
            local += [Branch(br.segment, br.dilation, h - first, 1, h % br.dilation) for h in range(a, b)]
    return tuple(local)


def ulysses_dilated_attention(
    q: Tensor, k: Tensor, v: Tensor, *, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
    group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous", causal: bool = False,
    head_split: bool = False, scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, deterministic: bool = False,
):
    """LongNet dilated attention over a sequence sharded across ``group``, by Ulysses' all-to-alls (collective).

    Each rank runs the single-GPU dilated attention on the whole sequence of its ``Hq/P`` query heads, so any
    segment lengths work and no segment needs special handling at shard boundaries (unlike
    :func:`longattn.distributed.ring_dilated_attention`). The heads keep their global identity: head ``h``'s
    offset is ``h % r`` of its global number, and ``head_split`` cuts the global heads into groups, so a rank's
    heads may belong to several groups. Where a rank's first head is not a multiple of a branch's rate, that
    branch runs as one branch per head (more, smaller kernel launches); ``Hq/P`` a multiple of every rate avoids it.

    Args:
        q, k, v, group, layout, causal, scale, backend, return_lse, deterministic: as :func:`ulysses_attention`.
        segment_lengths, dilation_rates, head_split: as :func:`longattn.dilated_attention`.
        cu_seqlens: a packed batch as in :func:`ulysses_attention`; the result is this rank's rows of
            :func:`longattn.dilated_attention_varlen` on the gathered batch.

    Returns:
        This rank's shard of ``dilated_attention(q_full, k_full, v_full, ...)``, differentiable in ``q``, ``k``,
        ``v`` (and ``(out, lse)`` with ``return_lse``). Options are checked across ranks as in
        :func:`ulysses_attention`; a group of one rank runs the single-GPU op.
    """
    from longattn import runner

    fn = "ulysses_dilated_attention"
    world, _ = group_size_rank(group)
    options, local_error = ulysses_options(
        fn, q, k, v, world, layout=layout, causal=causal, scale=scale, backend=backend, return_lse=return_lse,
        cu_seqlens=cu_seqlens, deterministic=deterministic,
        dilated=dict(segment_lengths=segment_lengths, dilation_rates=dilation_rates, head_split=head_split))
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn=fn, options=options, local_error=local_error)
    o = effective(options)
    cu, hq = o["cu_seqlens"], q.shape[-2]
    if cu is None:
        longest, seqlens = q.shape[1] * world, None
    else:
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        cu32 = cu_seqlens.to(torch.int32)
        seqlens = SeqLens(cu32, cu32, longest, longest)
    branches = dilated_branches(longest, hq, o["segment_lengths"], o["dilation_rates"], o["head_split"])

    def local(q, k, v, first_head):
        mine = local_branches(branches, first_head, q.shape[-2])
        call = AttentionCall(scale=o["scale"], causal=o["causal"], branches=mine, seqlens=seqlens,
                             deterministic=o["deterministic"])
        if seqlens is None:
            return runner.run(q, k, v, call, backend=backend, fn=fn)
        out, lse = runner.run(q[None], k[None], v[None], call, backend=backend, fn=fn)
        return out.squeeze(0), lse.squeeze(0)

    return ulysses_run(q, k, v, local, group, o)
