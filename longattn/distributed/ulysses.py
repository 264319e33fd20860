"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: all-to-all from sequence shards to whole sequences of some heads.

Every rank holds its shard ``(B, N/P, H, D)`` of the queries, keys and values (any layout of
:func:`longattn.distributed.shard`). One all-to-all gives each rank the *whole* sequence of ``Hq/P`` query heads
(and of the key/value heads those read), every rank's rows received straight into their natural places (a zigzag
shard holds two chunks from both ends: two all-to-alls, no reordering copy); the rank runs the single-GPU
operation on it, and a second all-to-all returns every rank its rows of every head. The heads are cut into
``ParallelOptions.head_chunks`` groups that are pipelined: all groups' inputs are sent at once, a group's attention
starts when its inputs are in, and its output travels while the next group computes; the backward runs each group's
saved graph in turn the same way (:class:`_Ulysses`). The all-to-alls (:mod:`longattn.distributed.all_to_all`)
run through NCCL, or, on explicit request (``ParallelOptions.transport``), on the copy engines straight into the
peers' memory. Any single-GPU operation can run in the middle: flash attention
(:func:`ulysses_attention`), LongNet's dilated attention (:func:`ulysses_dilated_attention`), their packed
variable-length forms, a ring (:func:`longattn.distributed.hybrid_attention`, one group).

Heads: ``Hq`` must be divisible by ``P``. Key/value heads are repeated ``P / gcd(Hk, P)`` times before the
all-to-all, so that the ``Hk * P / gcd(Hk, P)`` heads divide evenly and rank ``r`` receives exactly the copies
its query heads read (none when ``P`` divides ``Hk``; one head per rank when ``Hk`` divides ``P``).

Per rank and call: the forward sends and receives ``(N/P) (Hq + 2 Hk') D`` elements (``Hk'`` the repeated key/value
heads), and ``(N/P) Hq D`` for the output, in an all-to-all per head group and direction (two for zigzag); the
backward the same amounts reversed.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn import _autocast
from longattn._autograd import refuse_batched_gradients_across_ranks, refuse_second_derivative
from longattn.call import AttentionCall, Branch, SeqLens, dilated_branches, int32_index, longest_sequence
from longattn.distributed.all_to_all import Out, Part, Plan, open_route, workspace_bytes
from longattn.distributed.blocks import packed_cu_seqlens, rows_ordered, with_score_mods
from longattn.distributed.options import DEFAULT, ParallelOptions, check_options, host_checks_of
from longattn.distributed.shards import (
    LAYOUTS, Resolved, check_same_across_ranks, cut_error, default_layout, effective, group_size_rank,
)
from longattn.distributed.transport import requested

# The local computation on whole sequences of this rank's heads: (q, k, v, first query head, params) -> (out, lse),
# lse None when the call does not return it; params: the tensors given to ulysses_run (sinks), as the call must read
# them (leaves of the head groups' graphs inside the all-to-alls)
Local = Callable[[Tensor, Tensor, Tensor, int, Tuple[Optional[Tensor], ...]], Tuple[Tensor, Tensor]]


class _Ulysses(torch.autograd.Function):
    """The all-to-alls and ``local`` of every head group, pipelined: all groups' inputs are sent at once, each
    group's attention runs as soon as its inputs are in, and its output goes back while the next group computes.
    The backward does the same with the gradients, calling each group's saved graph (``torch.autograd.grad``) in
    turn; ``params`` are tensors ``local`` reads that may need gradients (attention sinks): it gets them as leaves of
    their own, so that their hooks run once, on the whole gradient, when autograd reaches them. The graphs are
    freed by the first backward: a second backward through the same call raises."""

    @staticmethod
    def forward(ctx, plan: Plan, local: Local, cfg: tuple, q: Tensor, k: Tensor, v: Tensor, *params: Tensor):
        chunks, with_lse, grad, options = cfg
        hk = k.shape[2] // plan.world
        # Key/value heads in groups as the queries, or (fewer than the groups) all sent with the first group and
        # each group reading the ones its queries read (head_chunks made the two fit).
        kv_groups = chunks if hk % chunks == 0 else 1
        inbound = [[Part(q, c, chunks)] + ([Part(k, c, kv_groups), Part(v, c, kv_groups)] if c < kv_groups else [])
                   for c in range(chunks)]
        outbound = [Out(chunks, q.shape[2], v.shape[3], q.dtype)]
        if with_lse:
            outbound.append(Out(chunks, q.shape[2], 1, _lse_dtype(q), per_head=True))
        backward = grad and requested(options.transport) == "copy_engine"
        reserve = _backward_workspace(plan, q, k, v, chunks, kv_groups, with_lse) if backward else 0
        # (a backward whose flags would not fit a link is refused here, before the forward runs)
        then = _backward_outbound(_shapes(q, k, v), chunks, kv_groups) if backward else ()
        route = open_route(plan, inbound, outbound, fresh=grad, options=options, reserve=reserve, then=then)
        try:
            return _Ulysses._forward_groups(ctx, plan, local, route, (chunks, kv_groups, with_lse, grad, options),
                                            q, k, v, params)
        except BaseException:
            route.abort()  # (copy engines: the peers are released; every rank's next call raises)
            raise

    @staticmethod
    def _forward_groups(ctx, plan: Plan, local: Local, route, cfg: tuple, q: Tensor, k: Tensor, v: Tensor, params):
        chunks, kv_groups, with_lse, grad, options = cfg
        P, rank = plan.world, plan.rank
        hq, hk = q.shape[2] // P, k.shape[2] // P
        wq = hq // chunks
        graphs = []
        leaves = tuple(p.detach().requires_grad_() if grad and p is not None and p.requires_grad else p
                       for p in params)
        for c in range(chunks):
            ins = route.inputs(c)
            if grad:
                ins = [t.detach().requires_grad_() for t in ins]
            if c == 0:
                kv = ins[1:]  # every group's, without groups of key/value heads
            with torch.enable_grad() if grad else contextlib.nullcontext():
                if kv_groups == chunks:
                    mine = ins
                else:  # the key/value heads this group's queries read: one, or whole groups of them
                    g = hq // hk
                    lo, hi = c * wq // g, ((c + 1) * wq - 1) // g + 1
                    mine = [ins[0]] + [x[:, :, lo:hi] for x in kv]
                out, lse = local(*mine, rank * hq + c * wq, leaves)
            route.give(0, c, out.detach())
            if with_lse:
                route.give(1, c, lse.detach())
            graphs.append((ins, out, lse) if grad else None)
        got = route.finish()
        ctx.plan, ctx.cfg, ctx.graphs, ctx.leaves = plan, (chunks, kv_groups, with_lse, options), graphs, leaves
        ctx.shapes = _shapes(q, k, v)
        return got[0] if not with_lse else (got[0], got[1])

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Optional[Tensor] = None):
        refuse_second_derivative("ulysses_attention")
        refuse_batched_gradients_across_ranks("ulysses_attention", d_out, d_lse)
        plan, (chunks, kv_groups, with_lse, options), graphs = ctx.plan, ctx.cfg, ctx.graphs
        if graphs is None or any(g is None for g in graphs):  # freed by the first backward (holding them would keep
            raise RuntimeError(  # every group's activations alive for as long as the output is)
                "ulysses_attention: backward through the same call a second time is not supported (each head "
                "group's graph is freed by the first backward, as autograd frees saved tensors); recompute the "
                "forward instead of retain_graph=True")
        k_dtype, v_dtype = ctx.shapes[4:]
        inbound = [[Part(d_out, c, chunks)] + ([Part(d_lse, c, chunks, per_head=True)] if with_lse else [])
                   for c in range(chunks)]
        route = open_route(plan, inbound, _backward_outbound(ctx.shapes, chunks, kv_groups), fresh=False,
                           options=options)
        try:
            return _Ulysses._backward_groups(ctx, route, chunks, kv_groups, with_lse, k_dtype, v_dtype)
        except BaseException:
            route.abort()  # (copy engines: the peers are released; every rank's next call raises)
            raise

    @staticmethod
    def _backward_groups(ctx, route, chunks: int, kv_groups: int, with_lse: bool, k_dtype, v_dtype):
        graphs = ctx.graphs
        first = graphs[0][0]  # q, k, v of the first group
        wanted = [i for i, p in enumerate(ctx.leaves) if p is not None and p.requires_grad]
        d_params = [None] * len(wanted)
        d_kv = [None, None]  # summed over the groups, without groups of key/value heads
        for c in range(chunks):
            ins, out, lse = graphs[c]
            if kv_groups != chunks:
                ins = [ins[0]] + list(first[1:])
            got = route.inputs(c)
            outputs, grads = [out] + ([lse] if with_lse else []), got
            # Outputs that depend on no input (an empty sequence's lse) take no part.
            grads = [g for x, g in zip(outputs, grads) if x.requires_grad]
            outputs = [x for x in outputs if x.requires_grad]
            inputs = list(ins) + [ctx.leaves[i] for i in wanted]
            found = (torch.autograd.grad(outputs, inputs, grads, allow_unused=True) if outputs
                     else [None] * len(inputs))
            graphs[c] = None  # this group's graph is done: its memory goes
            found = [torch.zeros_like(x) if g is None else g for x, g in zip(ins, found[:3])] + list(found[3:])
            if kv_groups == chunks:
                for j, g in enumerate(found[:3]):
                    route.give(j, c, g)
            else:
                route.give(0, c, found[0])
                # summed in float32 (float64 stays), rounded once (as one group's gradient is)
                d_kv = [g.to(torch.promote_types(g.dtype, torch.float32)) if acc is None else acc.add_(g)
                        for acc, g in zip(d_kv, found[1:3])]
            d_params = [g if acc is None else (acc if g is None else acc + g) for acc, g in zip(d_params, found[3:])]
        if kv_groups != chunks:
            for j, (g, dtype) in enumerate(zip(d_kv, (k_dtype, v_dtype)), start=1):
                route.give(j, 0, g.to(dtype))
        dq, dk, dv = route.finish(also=[g for g in d_params if g is not None])  # (the sinks' gradient too)
        ctx.graphs = None
        by_param = dict(zip(wanted, d_params))
        return (None, None, None, dq, dk, dv, *(by_param.get(i) for i in range(len(ctx.leaves))))


def _shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """What the backward's outputs are made of: ``(Hq, Hk, D, q.dtype, k.dtype, v.dtype)``."""
    return (q.shape[2], k.shape[2], v.shape[3], q.dtype, k.dtype, v.dtype)


def _backward_outbound(shapes: tuple, chunks: int, kv_groups: int) -> List[Out]:
    """The outputs :meth:`_Ulysses.backward` routes (``shapes``: :func:`_shapes` of the forward's inputs): the
    gradients of q, k and v."""
    Hq, Hk, D, q_dtype, k_dtype, v_dtype = shapes
    return [Out(chunks, Hq, D, q_dtype), Out(kv_groups, Hk, D, k_dtype), Out(kv_groups, Hk, D, v_dtype)]


def _backward_workspace(plan: Plan, q: Tensor, k: Tensor, v: Tensor, chunks: int, kv_groups: int,
                        with_lse: bool) -> int:
    """The copy-engine workspace of this forward's backward (reserved by the forward, so that it does not grow at
    the backward, at peak activation memory): the parts and outputs :meth:`_Ulysses.backward` routes."""
    meta = torch.device("meta")
    d_out = torch.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=meta)
    d_lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q), device=meta)
    inbound = [[Part(d_out, c, chunks)] + ([Part(d_lse, c, chunks, per_head=True)] if with_lse else [])
               for c in range(chunks)]
    return workspace_bytes(plan, inbound, [Out(chunks, q.shape[2], v.shape[3], q.dtype),
                                           Out(kv_groups, k.shape[2], k.shape[3], k.dtype),
                                           Out(kv_groups, v.shape[2], v.shape[3], v.dtype)])


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The log-sum-exp's dtype for inputs like ``q`` (float32; float64 for float64)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def head_chunks(hq: int, hkv: int, world: int, multiple_of: int = 1, wanted: int = DEFAULT.head_chunks) -> int:
    """How many head groups a call is cut into: ``wanted`` (``ParallelOptions.head_chunks``) where it divides a
    rank's ``hq / P`` query heads (each group a multiple of ``multiple_of`` of them) and each group's query heads read
    whole groups of the rank's ``hkv / P`` key/value heads (``hkv`` counted after :func:`kv_repeats`) or share one;
    else 1."""
    c, q, kv = wanted, hq // world, hkv // world
    if c > 1 and q % c == 0 and (q // c) % multiple_of == 0 and kv > 0:
        w, g = q // c, q // kv  # query heads a group, query heads a key/value head
        if w % g == 0 or g % w == 0:
            return c
    return 1


def kv_repeats(hk: int, world: int) -> int:
    """How many times each key/value head is repeated before the all-to-all: ``P / gcd(Hk, P)``, the least count
    that makes the heads divisible by ``P``. Rank ``r`` then receives the copies its query heads read: with
    ``g' = Hq / lcm(Hk, P)`` local query heads per received key/value head, local query head ``j`` (global
    ``r Hq / P + j``) reads received head ``j // g'``, a copy of head ``(r Hq / P + j) // (Hq / Hk)``."""
    return world // math.gcd(hk, world)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, local: Local, group, world: int, rank: int, layout: str,
             packed: bool, return_lse: bool, params: Sequence[Optional[Tensor]], multiple_of: int,
             chunks: Optional[int], options: ParallelOptions):
    """``local`` on whole sequences of this rank's heads, between the two all-to-alls; this rank's rows back."""
    if packed:  # (n, H, D): one batch row for the all-to-alls
        q, k, v = q[None], k[None], v[None]
        inner = local

        def local(q, k, v, first_head, params):
            out, lse = inner(q[0], k[0], v[0], first_head, params)
            return out[None], None if lse is None else lse[None]
    c = kv_repeats(k.shape[2], world)
    if c > 1:
        k, v = k.repeat_interleave(c, dim=2), v.repeat_interleave(c, dim=2)
    if chunks is None:
        chunks = head_chunks(q.shape[2], k.shape[2], world, multiple_of, options.head_chunks)
    plan = Plan.of(layout, group, world, rank, q.shape[1])
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, *params))
    result = _Ulysses.apply(plan, local, (chunks, return_lse, grad, options), q, k, v, *params)
    out, lse = result if return_lse else (result, None)
    if packed:
        out, lse = out.squeeze(0), None if lse is None else lse.squeeze(0)
    return out, lse


def ulysses_options(fn: str, q: Tensor, k: Tensor, v: Tensor, world: int, *, layout, causal, scale, backend,
                    return_lse, cu_seqlens, dilated: Optional[dict] = None, ring_size: Optional[int] = None,
                    deterministic=False, options=None) -> Tuple[dict, Optional[str]]:
    """This rank's call checked: ``(its options as they take effect, None)``, or ``({}, the error message)``.

    ``world`` is the Ulysses degree (``Hq`` must be divisible by it). ``ring_size``: the call is a hybrid's, whose
    ``layout`` cuts the sequence over a ring of that many Ulysses groups (so the zigzag chunks are of a Ulysses
    group's rows, and packed batches must be contiguous). Every option of the calling function is in the dict, and
    all ranks must agree on it (:func:`check_same_across_ranks`): a new option is added there.
    """
    from longattn import _validation as V

    try:
        parallel = check_options(options, fn)
        causal, return_lse = (V.check_flag(x, name, fn) for name, x in (("causal", causal), ("return_lse", return_lse)))
        if not isinstance(layout, str) or layout not in LAYOUTS:
            hint = (" ('balanced' is the ring's packed layout: a Ulysses call gathers whole sequences, so its packed "
                    "batches are sharded 'contiguous' or 'zigzag')" if layout == "balanced" else "")
            raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}{hint}")
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
        if backend not in ("auto", "torch"):  # (a backend the rank's call cannot run, refused before the all-to-all)
            from longattn import runner

            runner.choose(backend, q, AttentionCall(scale_used, causal=causal), fn=fn, k=k, v=v)
        options = {"layout": layout, "causal": causal, "scale": Resolved(scale_used, scale), "backend": backend,
                   "return_lse": return_lse, "cu_seqlens": cu,
                   "deterministic": Resolved(deterministic_used, deterministic),
                   # ranks cutting the heads differently, or moving them differently, would issue different
                   # collectives
                   **parallel.compared("head_chunks", "transport")}
        if dilated is not None:
            segs, rates = V.check_dilated_args(dilated["segment_lengths"], dilated["dilation_rates"], fn=fn)
            head_split = V.check_flag(dilated["head_split"], "head_split", fn)
            options.update(segment_lengths=segs, dilation_rates=rates, head_split=head_split)
    except (TypeError, ValueError) as e:
        return {}, str(e)
    return options, None


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None,
    causal: bool = False, scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, deterministic: bool = False, options: Optional[ParallelOptions] = None,
):
    """Exact attention over a sequence sharded across ``group``, by Ulysses' all-to-alls (collective call).

    Args:
        q: ``(B, N/P, Hq, D)``, this rank's shard of the queries as ``shard(x, group, layout)`` gives it; ``Hq``
            must be divisible by the group size ``P``.
        k, v: ``(B, N/P, Hk, D)``, ``Hq % Hk == 0``; any ``Hk`` (repeated as needed, see :func:`kv_repeats`).
        group: the process group the sequence is split over (default: the world).
        layout: ``"zigzag"`` or ``"contiguous"``: the layout the shards were cut with; default (None) that of
            :func:`~longattn.distributed.shard` and ``ring_attention``: ``"zigzag"``, for a packed batch
            ``"contiguous"`` (so that ``shard(x)``'s shards are read as they were cut: a causal call on shards read
            in another layout would be silently wrong: the tensors ``shard`` cut in another layout than the call's
            are refused, ``ValueError`` on every rank, where the order of the rows matters: causal, ALiBi, packed
            batches). Every rank computes whole sequences, so the layout does not change the balance of causal work
            (its two pieces of a zigzag shard travel in two all-to-alls, no reordering copy).
        causal: global causal masking. scale: softmax scale, default ``D ** -0.5``.
        backend: the local kernels, as :func:`longattn.flash_attention`.
        return_lse: also return the log-sum-exp of this rank's rows, ``(B, Hq, N/P)`` (float32; float64 for
            float64 inputs); differentiable.
        cu_seqlens: a packed variable-length batch: q ``(total/P, Hq, D)``, k and v ``(total/P, Hk, D)`` are this
            rank's rows (``shard(x, group, layout, dim=0)``; documents may cross shard boundaries) and
            ``cu_seqlens`` ``(batch + 1,)`` the global boundaries, the same on every rank; each rank runs
            :func:`longattn.flash_attention_varlen` on the whole batch of its heads. lse is then ``(Hq, total/P)``.
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).
        softcap, alibi_slopes, sinks: logit soft-capping, ALiBi slopes ``(Hq,)`` or ``(B, Hq)`` (``(batch, Hq)``
            with ``cu_seqlens``) and attention sinks ``(Hq,)``, as in :func:`longattn.flash_attention`; every rank
            passes the same values and applies those of its heads. The gradient of ``sinks`` on each rank is that of
            its heads (zero elsewhere): summed over the group (as for any weight the ranks share) it is the whole
            gradient.
        deterministic: bitwise-identical gradients from run to run, as in :func:`longattn.flash_attention` (the
            local call's flag; also on under PyTorch's deterministic mode); compared across ranks as it takes effect.
        options: how the call runs (:class:`~longattn.distributed.ParallelOptions`: the all-to-alls' transport, the
            head groups pipelined, the option check's exchange, the copy engines' timeout); ``None``: the defaults.
            Its ``transport`` and ``head_chunks`` are compared across ranks.

    Returns:
        This rank's shard of ``flash_attention(q_full, k_full, v_full, causal=causal)`` (with ``cu_seqlens``, its
        rows of ``flash_attention_varlen`` on the gathered batch), in the layout of the inputs; differentiable in
        ``q``, ``k``, ``v`` (and ``sinks``). All ranks must pass shards of the same shape and dtype and the same
        options (compared as they take effect); otherwise every rank raises ``ValueError`` naming what differs and
        each rank's value. A group of one rank runs the single-GPU op. The backward runs once per call: a second
        backward through the same result (``retain_graph=True``) raises ``RuntimeError`` (the head groups' graphs
        are freed by the first, see :class:`_Ulysses`); so does a gradient of the gradients.

    Memory per rank: the gathered sequences of ``Hq/P`` query heads and their key/value heads (``N (Hq + 2 Hk')
    D / P`` elements, ``Hk'`` the repeated key/value heads), their output, and the local kernel's own memory.
    """
    fn = "ulysses_attention"
    q, k, v = _autocast.cast_inputs(q, k, v)  # SDPA's autocast rule, as every attention function
    world, _ = group_size_rank(group, f"{fn}: group")
    checked, local_error = ulysses_options(fn, q, k, v, world, layout=default_layout(layout, cu_seqlens is not None),
                                           causal=causal, scale=scale,
                                           backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens,
                                           deterministic=deterministic, options=options)
    checked, mods, local_error = with_score_mods(checked, local_error, q, fn, softcap=softcap,
                                                 alibi_slopes=alibi_slopes, sinks=sinks)
    if local_error is None and rows_ordered(checked, mods):  # (shard()'s tensors cut in another layout: refused)
        local_error = cut_error(fn, {"q": q, "k": k, "v": v}, checked["layout"], layout)
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn=fn, options=checked, local_error=local_error,
                            host_checks=host_checks_of(options), grad_inputs=(sinks,))
    o = effective(checked)
    if o["cu_seqlens"] is None:
        from longattn.functional import flash_attention as attend
        kw = {}
    else:
        from longattn.varlen import flash_attention_varlen as attend
        kw = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)

    def local(q, k, v, first_head, params):
        mine = mods._replace(sinks=params[0]).heads(first_head, q.shape[-2])
        result = attend(q, k, v, causal=o["causal"], scale=o["scale"], backend=backend, return_lse=o["return_lse"],
                        deterministic=o["deterministic"], **mine.kwargs(), **kw)
        return result if o["return_lse"] else (result, None)

    return ulysses_run(q, k, v, local, group, o, params=(mods.sinks,), options=check_options(options, fn))


def ulysses_run(q: Tensor, k: Tensor, v: Tensor, local: Local, group, o: dict,
                params: Sequence[Optional[Tensor]] = (), multiple_of: int = 1, chunks: Optional[int] = None,
                options: ParallelOptions = DEFAULT):
    """``local`` between the two all-to-alls over ``group`` (alone for a group of one rank), with the options ``o``
    as they take effect (``layout``, ``cu_seqlens``, ``return_lse``): ``out``, or ``(out, lse)``. ``params``: the
    tensors ``local`` reads that may need gradients (sinks); ``chunks``: head groups to pipeline (default
    :func:`head_chunks`, whose groups are whole multiples of ``multiple_of`` heads; 1 for a collective ``local``,
    whose rounds are better whole); ``options``: the call's :class:`~longattn.distributed.ParallelOptions`
    (already compared across the ranks by the caller: this runs no check)."""
    world, rank = group_size_rank(group)
    if world == 1 or q.shape[-2] == 0:  # the single-GPU op (zigzag over one rank is the natural order); no query
        out, lse = local(q, k, v, 0, tuple(params))  # heads (agreed by every rank): nothing to send, zero-size results
    else:
        out, lse = _ulysses(q, k, v, local, group, world, rank, o["layout"], o["cu_seqlens"] is not None,
                            o["return_lse"], params, multiple_of, chunks, options)
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
    group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None, causal: bool = False,
    head_split: bool = False, scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, deterministic: bool = False, options: Optional[ParallelOptions] = None,
):
    """LongNet dilated attention over a sequence sharded across ``group``, by Ulysses' all-to-alls (collective).

    Each rank runs the single-GPU dilated attention on the whole sequence of its ``Hq/P`` query heads, so any
    segment lengths work and no segment needs special handling at shard boundaries (unlike
    :func:`longattn.distributed.ring_dilated_attention`). The heads keep their global identity: head ``h``'s
    offset is ``h % r`` of its global number, and ``head_split`` cuts the global heads into groups, so a rank's
    heads may belong to several groups. Where a rank's first head is not a multiple of a branch's rate, that
    branch runs as one branch per head (more, smaller kernel launches); ``Hq/P`` a multiple of every rate avoids it.

    Args:
        q, k, v, group, layout, causal, scale, backend, return_lse, deterministic, options: as
            :func:`ulysses_attention`.
        segment_lengths, dilation_rates, head_split: as :func:`longattn.dilated_attention`.
        cu_seqlens: a packed batch as in :func:`ulysses_attention`; the result is this rank's rows of
            :func:`longattn.dilated_attention_varlen` on the gathered batch.
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).

    Returns:
        This rank's shard of ``dilated_attention(q_full, k_full, v_full, ...)``, differentiable in ``q``, ``k``,
        ``v`` (and ``(out, lse)`` with ``return_lse``). Options are checked across ranks as in
        :func:`ulysses_attention`; a group of one rank runs the single-GPU op; one backward per call, as there.
    """
    from longattn import runner

    fn = "ulysses_dilated_attention"
    q, k, v = _autocast.cast_inputs(q, k, v)
    world, _ = group_size_rank(group, f"{fn}: group")
    checked, local_error = ulysses_options(
        fn, q, k, v, world, layout=default_layout(layout, cu_seqlens is not None), causal=causal, scale=scale,
        backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens, deterministic=deterministic, options=options,
        dilated=dict(segment_lengths=segment_lengths, dilation_rates=dilation_rates, head_split=head_split))
    if local_error is None:  # (dilated segments are positions: shard()'s tensors cut in another layout are refused)
        local_error = cut_error(fn, {"q": q, "k": k, "v": v}, checked["layout"], layout)
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn=fn, options=checked, local_error=local_error,
                            host_checks=host_checks_of(options))
    o = effective(checked)
    cu, hq = o["cu_seqlens"], q.shape[-2]
    if cu is None:
        longest, seqlens = q.shape[1] * world, None
    else:
        longest = longest_sequence(cu)
        cu32 = int32_index(cu_seqlens)
        seqlens = SeqLens(cu32, cu32, longest, longest)
    branches = dilated_branches(longest, hq, o["segment_lengths"], o["dilation_rates"], o["head_split"], fn=fn)

    def local(q, k, v, first_head, params):
        mine = local_branches(branches, first_head, q.shape[-2])
        call = AttentionCall(scale=o["scale"], causal=o["causal"], branches=mine, seqlens=seqlens,
                             deterministic=o["deterministic"])
        if seqlens is None:
            return runner.run(q, k, v, call, backend=backend, fn=fn)
        out, lse = runner.run(q[None], k[None], v[None], call, backend=backend, fn=fn)
        return out.squeeze(0), lse.squeeze(0)

    # Head groups whose first heads are multiples of every rate keep each branch whole (local_branches).
    return ulysses_run(q, k, v, local, group, o, multiple_of=math.lcm(*o["dilation_rates"]),
                       options=check_options(options, fn))
