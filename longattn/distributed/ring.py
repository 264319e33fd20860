"""Ring attention: exact softmax attention over a sequence sharded across the ranks of a process group.

Every rank keeps its shard of queries. Key/value shards travel round the ring (rank ``i`` sends to ``i + 1`` and
receives from ``i - 1``) with batched ``isend``/``irecv``; the transfer of the next block is started before the
attention on the block in hand, so communication overlaps compute. Partial results leave the kernels in float32
(float64 for float64 inputs) and merge by log-sum-exp in that precision: the output is rounded to the inputs' dtype
once, as on one device, however many ranks the ring has.

The backward runs the same ring: each rank computes its queries' share of the gradient of the visiting key/value
block (the flash backward fed with the *final* output and log-sum-exp) and adds it to float32 dK/dV accumulators
that travel with the block and arrive at the block's owner after a full turn. Memory per rank is O(N / P).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn import ops
from longattn.call import accumulator_dtype, merge_partial
from longattn.distributed.shards import (
    LAYOUTS, Resolved, check_same_across_ranks, effective, global_rank, group_size_rank,
)

Block = Tuple[slice, slice, bool]  # (query rows, key rows, causal diagonal?)


def merge_into(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge a partial result ``(out, lse)`` into the accumulators ``(out_acc, lse_acc)`` (views, float32 or float64)
    in place, by :func:`longattn.call.merge_partial`. ``lse_acc``/``lse`` are shaped like ``out[..., 0]``."""
    merged, merged_lse = merge_partial(out_acc, lse_acc, out, lse)
    out_acc.copy_(merged)
    lse_acc.copy_(merged_lse)


def block_plan(layout: str, rank: int, src: int, world: int, causal: bool, n: int) -> List[Block]:
    """Which parts of this rank's queries attend to which parts of rank ``src``'s key/value shard, and how.

    Returns ``(query rows, key rows, causal)`` triples; ``causal`` marks a diagonal block (same global positions on
    both sides), otherwise the block is fully visible. Blocks not listed are fully masked.
    In the zigzag layout rank ``i`` holds chunks ``(i, 2P-1-i)``: on its own shard the standard causal mask is
    exact; for ``src < i`` every query sees the first chunk of ``src`` and none of its second; for ``src > i`` only
    the second query chunk sees anything, and it sees all of ``src``.
    """
    everything = slice(0, n)
    if not causal:
        return [(everything, everything, False)]
    if src == rank:
        return [(everything, everything, True)]
    if layout == "contiguous":
        return [(everything, everything, False)] if src < rank else []
    half = n // 2
    if src < rank:
        return [(everything, slice(0, half), False)]
    return [(slice(half, n), everything, False)]


def _start_exchange(send: Tensor, recv: Tensor, to: int, frm: int, group) -> List:
    ops_ = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return dist.batch_isend_irecv(ops_)


def _wait(works: Optional[List]) -> None:
    for w in works or ():
        w.wait()


class _Ring:
    """The ring of a process group as seen from this rank."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = group_size_rank(group)
        self.next = global_rank(group, (self.rank + 1) % self.world)
        self.prev = global_rank(group, (self.rank - 1) % self.world)

    def exchange(self, send: Tensor) -> Tuple[Tensor, List]:
        """Start sending ``send`` to the next rank and receiving a tensor like it from the previous one."""
        recv = torch.empty_like(send)
        return recv, _start_exchange(send, recv, self.next, self.prev, self.group)


def _ring_forward(q, k, v, ring: _Ring, causal: bool, layout: str, scale: float, backend: str):
    B, n, H, D = q.shape
    out = torch.zeros((B, n, H, D), dtype=accumulator_dtype(q.dtype), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    kv = torch.stack([k, v])  # one message per step
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming, works = ring.exchange(kv) if step < ring.world - 1 else (None, None)
        for qs, ks, diag in block_plan(layout, ring.rank, src, ring.world, causal, n):
            o, lse_b = ops.attention_forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], causal=diag, scale=scale,
                                             backend=backend, out_dtype=out.dtype)
            merge_into(out[:, qs], lse[:, :, qs].transpose(1, 2), o, lse_b.transpose(1, 2))
        _wait(works)
        if incoming is not None:
            kv = incoming
    return out.to(q.dtype), lse


def _ring_backward(do, q, k, v, out, lse, ring: _Ring, causal: bool, layout: str, scale: float, backend: str):
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    kv = torch.stack([k, v])
    dkv_in, dkv_works = None, None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming, works = ring.exchange(kv) if step < ring.world - 1 else (None, None)
        dkv = torch.zeros(kv.shape, dtype=accumulator_dtype(q.dtype), device=kv.device)
        for qs, ks, diag in block_plan(layout, ring.rank, src, ring.world, causal, n):
            dq_b, dk_b, dv_b = ops.attention_backward(
                do[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs], lse[:, :, qs].contiguous(),
                causal=diag, scale=scale, backend=backend, grad_dtype=accumulator_dtype(q.dtype),
            )
            dq[:, qs] += dq_b
            dkv[0][:, ks] += dk_b
            dkv[1][:, ks] += dv_b
        _wait(dkv_works)  # the accumulator of this block, from the previous rank
        if dkv_in is not None:
            dkv += dkv_in
        dkv_in, dkv_works = ring.exchange(dkv)  # on to the next rank; after P steps it is home
        _wait(works)
        if incoming is not None:
            kv = incoming
    _wait(dkv_works)
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, layout, scale, backend):
        out, lse = _ring_forward(q, k, v, ring, causal, layout, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (ring, causal, layout, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do, q, k, v, out, lse, *ctx.cfg)
        return dq, dk, dv, None, None, None, None, None


def packed_cu_seqlens(q: Tensor, k: Tensor, v: Tensor, cu_seqlens, world: int, fn: str) -> List[int]:
    """Check packed shards ``(total/P, H, D)`` and the global ``cu_seqlens``; returns its boundaries."""
    from longattn import _validation as V

    V.check_packed_inputs(q, k, v, fn=fn)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{fn}: self-attention needs k and v shards as long as q's, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    return V.check_cu_seqlens(cu_seqlens, world * q.shape[0], "cu_seqlens", fn, q.device)


def _ring_options(q: Tensor, k: Tensor, v: Tensor, world: int, *, causal, layout, scale, backend, return_lse,
                  cu_seqlens) -> Tuple[dict, Optional[str]]:
    """This rank's call checked: ``(its options as they take effect, None)``, or ``({}, the error message)``.

    Every option of :func:`ring_attention` is in the dict, and all ranks must agree on it
    (:func:`check_same_across_ranks`): a new option is added there.
    """
    from longattn import _validation as V

    fn = "ring_attention"
    try:
        causal, return_lse = (V.check_flag(x, name, fn) for name, x in (("causal", causal), ("return_lse", return_lse)))
        V.check_backend(backend, fn)
        if cu_seqlens is None:
            cu, layout_used = None, "zigzag" if layout is None else layout
            if not isinstance(layout_used, str) or layout_used not in LAYOUTS:
                raise ValueError(f"{fn}: layout must be None or one of {LAYOUTS}, got {layout!r}")
            V.check_attention_inputs(q, k, v, fn=fn, self_attention=True)
            if layout_used == "zigzag" and q.shape[1] % 2:
                raise ValueError(f"{fn}: the zigzag layout needs an even shard length (two chunks), got {q.shape[1]}")
        else:
            cu, layout_used = packed_cu_seqlens(q, k, v, cu_seqlens, world, fn), "contiguous"
            if layout not in (None, "contiguous"):
                raise ValueError(f"{fn}: packed batches (cu_seqlens) are split contiguously; layout must be None or "
                                 f"'contiguous', got {layout!r}")
        scale_used = V.check_scale(scale, q.shape[-1], fn=fn)
    except (TypeError, ValueError) as e:
        return {}, str(e)
    return {"causal": causal, "layout": Resolved(layout_used, layout), "scale": Resolved(scale_used, scale),
            "backend": backend, "return_lse": return_lse, "cu_seqlens": cu}, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None, causal: bool = False,
    layout: Optional[str] = None, scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None,
):
    """Exact attention over a sequence sharded across the ranks of ``group`` (collective: every rank calls it).

    Args:
        q: ``(B, N/P, Hq, D)``, this rank's shard of the queries (see :func:`longattn.distributed.shard`).
        k, v: ``(B, N/P, Hk, D)``, this rank's shards of keys and values, ``Hq % Hk == 0`` (grouped-query).
        group: the process group the sequence is split over (default: the world).
        causal: global causal masking (position ``i`` sees positions ``j <= i`` of the full sequence).
        layout: how the global sequence maps to shards, ``"zigzag"`` (the default without ``cu_seqlens``; balances
            causal work, needs an even shard length) or ``"contiguous"`` (the only layout of packed batches).
        scale: softmax scale, default ``D ** -0.5``. backend: per-block kernels, as :func:`longattn.flash_attention`.
        return_lse: also return the log-sum-exp ``(B, Hq, N/P)``, float32 (float64 for float64 inputs; not
            differentiable).
        cu_seqlens: a packed variable-length batch: q ``(total/P, Hq, D)``, k and v ``(total/P, Hk, D)`` are this
            rank's contiguous rows of the packed batch (``shard(x, layout="contiguous", dim=0)``) and
            ``cu_seqlens`` ``(batch + 1,)`` the global boundaries (as in :func:`longattn.flash_attention_varlen`;
            the same on every rank, on the inputs' device). Documents may cross shard boundaries. Each rank fetches
            the key/value rows of the documents its queries touch (see :mod:`longattn.distributed.ring_varlen`); lse
            is then ``(Hq, total/P)``.

    Returns:
        This rank's shard of ``flash_attention(q_full, k_full, v_full, causal=causal)``, ``(B, N/P, Hq, D)`` (with
        ``cu_seqlens``: its rows of ``flash_attention_varlen`` on the gathered batch, ``(total/P, Hq, D)``).
        Differentiable in ``q``, ``k`` and ``v``. All ranks must pass shards of the same shape and dtype and the same
        options (compared as they take effect: ``scale=None`` and ``D ** -0.5`` agree); otherwise every rank raises
        ``ValueError`` naming what differs and each rank's value. A group of one rank runs the single-GPU op.
    """
    world, _ = group_size_rank(group)
    options, local_error = _ring_options(q, k, v, world, causal=causal, layout=layout, scale=scale, backend=backend,
                                         return_lse=return_lse, cu_seqlens=cu_seqlens)
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn="ring_attention", options=options,
                            local_error=local_error)
    o = effective(options)
    if o["cu_seqlens"] is not None:
        from longattn.distributed.ring_varlen import ring_flash_varlen

        out, lse = ring_flash_varlen(q, k, v, o["cu_seqlens"], group=group, causal=o["causal"], scale=o["scale"],
                                     backend=backend)
    elif world == 1:
        from longattn.functional import flash_attention

        return flash_attention(q, k, v, causal=o["causal"], scale=o["scale"], backend=backend, return_lse=return_lse)
    else:
        out, lse = _RingAttention.apply(q, k, v, _Ring(group), o["causal"], o["layout"], o["scale"], backend)
    return (out, lse) if o["return_lse"] else out
