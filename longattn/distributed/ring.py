"""Ring attention: exact softmax attention over a sequence sharded across the ranks of a process group.

Every rank keeps its shard of queries. Key/value shards travel round the ring (rank ``i`` sends to ``i + 1`` and
receives from ``i - 1``), with batched ``isend``/``irecv`` (NCCL, the default), or on request on the copy engines
into the next rank's memory (``ParallelOptions.transport``, :mod:`longattn.distributed.transport`); the transfer of
the next block is started before the attention on the block in hand, so communication overlaps compute. Partial
results leave the kernels in float32 (float64 for float64 inputs) and merge by log-sum-exp in that precision: the
output is rounded to the inputs' dtype once, as on one device, however many ranks the ring has.

The backward runs the same ring: each rank computes its queries' share of the gradient of the visiting key/value
block (the flash backward fed with the *final* output and log-sum-exp) and adds it to float32 dK/dV accumulators
that travel with the block and arrive at the block's owner after a full turn. Memory per rank is O(N / P).

Score modifications: soft-capping and ALiBi modify every block's scores (ALiBi by the global distance of the
block's queries and keys: the blocks are cut where global positions jump, :func:`alibi_plan`, and each call carries
its offset); attention sinks enter once, added to the merged result (:func:`longattn.call.add_sinks`, whose
gradient reaches the ring through the log-sum-exp's).
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn import _autocast
from longattn._autograd import refuse_batched_gradients_across_ranks, refuse_second_derivative
from longattn import _validation as V
from longattn import ops, runner
from longattn.call import AttentionCall, accumulator_dtype, add_sinks
from longattn.distributed.blocks import (
    ScoreMods, check_block_backend, check_packed_mods, merge_into, packed_cu_seqlens, rows_ordered, with_score_mods,
)
from longattn.distributed.options import ParallelOptions, check_options, host_checks_of
from longattn.distributed.shards import (
    LAYOUTS, Resolved, check_packed_layout, check_same_across_ranks, chunk_ids, cut_error, effective,
    group_size_rank,
)
from longattn.distributed.transport import Ring

FN = "ring_attention"
Block = Tuple[slice, slice, bool]  # (query rows, key rows, causal diagonal?)
AlibiBlock = Tuple[slice, slice, bool, int]  # the same and the block's ALiBi offset (see alibi_plan)


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


def alibi_plan(layout: str, rank: int, src: int, world: int, causal: bool, n: int) -> List[AlibiBlock]:
    """:func:`block_plan` cut into blocks of global positions in one run on both sides (a zigzag shard holds two
    chunks), with their ALiBi offsets: ``(query rows, key rows, causal diagonal?, offset)``, the global distance of
    local query ``i`` and key ``j`` of a block being ``i + offset - j``."""
    q_chunks, k_chunks = chunk_ids(layout, rank, world), chunk_ids(layout, src, world)
    c = n // len(q_chunks)
    return [(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), causal and qc == kc, (qc - kc) * c)
            for a, qc in enumerate(q_chunks) for b, kc in enumerate(k_chunks) if not (causal and kc > qc)]


def block_calls(layout: str, rank: int, src: int, world: int, causal: bool, n: int, scale: float,
                mods: ScoreMods, dtype: torch.dtype,
                deterministic: bool = False) -> List[Tuple[slice, slice, AttentionCall]]:
    """The blocks of this rank's queries over rank ``src``'s keys and values, each with its call: ``(query rows,
    key rows, call)``, the call's output in the accumulators' dtype (inputs of ``dtype``); ``deterministic``: the
    calls' flag (their backward sums in a fixed order)."""
    out_dtype = accumulator_dtype(dtype)
    base = AttentionCall(scale=scale, out_dtype=None if out_dtype == dtype else out_dtype, softcap=mods.softcap,
                         alibi=mods.alibi, deterministic=deterministic)
    if mods.alibi is None:
        plan = [(qs, ks, diag, 0) for qs, ks, diag in block_plan(layout, rank, src, world, causal, n)]
    else:
        plan = alibi_plan(layout, rank, src, world, causal, n)
    return [(qs, ks, replace(base, causal=diag, alibi_offset=offset)) for qs, ks, diag, offset in plan]


def _wait(works: Optional[List]) -> None:
    for w in works or ():
        w.wait()


def _kv_bytes(k: Tensor, dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of a stacked key/value message like ``k`` (in ``dtype``, default k's)."""
    return 2 * k.numel() * torch.empty((), dtype=dtype or k.dtype).element_size()


def backward_channels(k: Tensor, dtype: torch.dtype) -> dict:
    """The messages of a ring backward (for inputs of ``dtype``): key/value blocks and their float accumulators."""
    return {"kv": _kv_bytes(k), "dkv": _kv_bytes(k, accumulator_dtype(dtype))}


def _ring_forward(q, k, v, ring: Ring, causal: bool, layout: str, scale: float, backend: str,
                  mods: ScoreMods = ScoreMods(), deterministic: bool = False):
    # opened before anything is allocated (agreed across ranks); a failure after it releases the peers
    ring.open({"kv": _kv_bytes(k)})
    try:
        return _ring_forward_pass(q, k, v, ring, causal, layout, scale, backend, mods, deterministic)
    except BaseException:
        ring.abort()
        raise


def _ring_forward_pass(q, k, v, ring: Ring, causal: bool, layout: str, scale: float, backend: str,
                       mods: ScoreMods = ScoreMods(), deterministic: bool = False):
    B, n, H, D = q.shape
    out = torch.zeros((B, n, H, D), dtype=accumulator_dtype(q.dtype), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    kv = torch.stack([k, v])  # one message per step
    written: List[slice] = []  # query rows that hold a partial result (the others: 0 and -inf)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming, works = ring.exchange(kv) if step < ring.world - 1 else (None, None)
        for qs, ks, call in block_calls(layout, ring.rank, src, ring.world, causal, n, scale, mods, q.dtype,
                                        deterministic):
            o, lse_b = _block_forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], call, backend)
            if any(qs.start < w.stop and w.start < qs.stop for w in written):
                merge_into(out[:, qs], lse[:, :, qs].transpose(1, 2), o, lse_b.transpose(1, 2))
            else:  # a merge with nothing gives the block's result, bit for bit: one copy instead of the merge
                out[:, qs].copy_(o)
                lse[:, :, qs].copy_(lse_b)
            written.append(qs)
        _wait(works)
        if incoming is not None:
            kv = incoming
    ring.close(out, lse)
    return out.to(q.dtype), lse


def _block_forward(q, k, v, call: AttentionCall, backend: str) -> Tuple[Tensor, Tensor]:
    """One block's partial ``(out, lse)``, in the accumulators' dtype: :func:`longattn.ops.attention_forward`, or,
    for a block with score modifications (which it does not take), the runner's forward of the call."""
    if call.softcap or call.alibi is not None:
        return runner.forward(q, k, v, call, backend=backend, fn=FN)
    return ops.attention_forward(q, k, v, causal=call.causal, scale=call.scale, backend=backend,
                                 out_dtype=call.out_dtype or q.dtype)


def _block_backward(do, q, k, v, out, lse, dlse, call: AttentionCall, backend: str):
    """One block's share of the gradients, from the final ``out``, ``lse`` and the gradient ``dlse`` of ``lse``
    (or None), in the accumulators' dtype: the runner's explicit backward on the chosen backend."""
    return runner.backward(do, q, k, v, out, lse, call, backend=backend, fn=FN, grad_dtype=accumulator_dtype(q.dtype),
                           dlse=dlse)


def _ring_backward(do, q, k, v, out, lse, ring: Ring, causal: bool, layout: str, scale: float, backend: str,
                   mods: ScoreMods = ScoreMods(), deterministic: bool = False, dlse: Optional[Tensor] = None):
    ring.open(backward_channels(k, q.dtype))
    try:
        return _ring_backward_pass(do, q, k, v, out, lse, ring, causal, layout, scale, backend, mods,
                                   deterministic, dlse)
    except BaseException:
        ring.abort()
        raise


def _ring_backward_pass(do, q, k, v, out, lse, ring: Ring, causal: bool, layout: str, scale: float,
                        backend: str, mods: ScoreMods = ScoreMods(), deterministic: bool = False,
                        dlse: Optional[Tensor] = None):
    n, acc_dtype = q.shape[1], accumulator_dtype(q.dtype)
    dq = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    dq_rows = _Rows(n)  # query rows dq holds a sum for (the others are still unwritten)
    kv = torch.stack([k, v])
    dkv_in, dkv_works = None, None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming, works = ring.exchange(kv) if step < ring.world - 1 else (None, None)
        parts = []  # (key rows, dk, dv) of this step's blocks
        for qs, ks, call in block_calls(layout, ring.rank, src, ring.world, causal, n, scale, mods, q.dtype,
                                        deterministic):
            dq_b, dk_b, dv_b = _block_backward(do[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                               lse[:, :, qs].contiguous(),
                                               None if dlse is None else dlse[:, :, qs].contiguous(), call, backend)
            dq_rows.add(qs, (dq, dq_b))
            parts.append((ks, dk_b, dv_b))
        _wait(dkv_works)  # the accumulator of this block from the previous rank (it arrived during the blocks)
        if dkv_in is None:
            dkv, dkv_rows = torch.empty(kv.shape, dtype=acc_dtype, device=kv.device), _Rows(n)
        else:  # the blocks' sums go into it, in place
            dkv, dkv_rows = dkv_in, _Rows(n, full=True)
        for ks, dk_b, dv_b in parts:
            dkv_rows.add(ks, (dkv[0], dk_b), (dkv[1], dv_b))
        del parts
        dkv_rows.fill(dkv[0], dkv[1])
        if step == ring.world - 1:  # the sums are complete: they travel home in the gradients' dtype (the cast
            dkv = dkv.to(k.dtype)   # the owner would make; half the bytes of a float32 accumulator)
        dkv_in, dkv_works = ring.exchange(dkv, "dkv")  # on to the next rank; after P steps it is home
        _wait(works)
        if incoming is not None:
            kv = incoming
    _wait(dkv_works)
    dq_rows.fill(dq)
    if ring.in_workspace():  # (the last accumulator is a view of it)
        dkv_in = dkv_in.clone()
    ring.close(dq, dkv_in)
    return dq.to(q.dtype), dkv_in[0], dkv_in[1]


class _Rows:
    """Which rows of an accumulator hold a sum, so that the first block to reach a row writes it (a copy) instead
    of adding to zeros: the same sums, bit for bit, with one pass less over the accumulator and no zero-fill."""

    def __init__(self, n: int, full: bool = False):
        self.n, self.done = n, [(0, n)] if full else []

    def _missing(self, rows: slice) -> List[Tuple[int, int]]:
        gaps, start = [], rows.start
        for a, b in sorted(self.done):
            if b <= start or a >= rows.stop:
                continue
            if a > start:
                gaps.append((start, a))
            start = max(start, b)
        if start < rows.stop:
            gaps.append((start, rows.stop))
        return gaps

    def add(self, rows: slice, *pairs: Tuple[Tensor, Tensor]) -> None:
        """``acc[:, rows] += x`` for each ``(acc, x)`` (accumulators ``(B, n, ...)``), rows not yet written counting
        as zeros."""
        gaps, length = self._missing(rows), rows.stop - rows.start
        for acc, x in pairs:
            if gaps == [(rows.start, rows.stop)]:
                acc.narrow(1, rows.start, length).copy_(x)
            else:
                for a, b in gaps:
                    acc.narrow(1, a, b - a).zero_()
                acc.narrow(1, rows.start, length).add_(x)
        self.done.append((rows.start, rows.stop))

    def fill(self, *accs: Tensor) -> None:
        """Zero the rows no block wrote."""
        for a, b in self._missing(slice(0, self.n)):
            for acc in accs:
                acc.narrow(1, a, b - a).zero_()
        self.done.append((0, self.n))


class _RingAttention(torch.autograd.Function):
    """``(out, lse)`` of the ring, differentiable in both (a gradient of ``lse``: ``d lse / d s = P``, added to
    ``dS`` by the blocks' backward); ``mods`` soft-capping and ALiBi (sinks are added to the result);
    ``deterministic``: the blocks' calls are deterministic ones."""

    @staticmethod
    def forward(ctx, q, k, v, ring, causal, layout, scale, backend, mods, deterministic):
        out, lse = _ring_forward(q, k, v, ring, causal, layout, scale, backend, mods, deterministic)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (ring, causal, layout, scale, backend, mods, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        refuse_second_derivative(FN)
        refuse_batched_gradients_across_ranks(FN, do, dlse)
        q, k, v, out, lse = ctx.saved_tensors
        do = torch.zeros_like(out) if do is None else do
        dq, dk, dv = _ring_backward(do, q, k, v, out, lse, *ctx.cfg, dlse=dlse)
        return dq, dk, dv, None, None, None, None, None, None, None


def _ring_options(q: Tensor, k: Tensor, v: Tensor, world: int, *, causal, layout, scale, backend, return_lse,
                  cu_seqlens, deterministic=False, options=None) -> Tuple[dict, Optional[str]]:
    """This rank's call checked: ``(its options as they take effect, None)``, or ``({}, the error message)``.

    Every option of :func:`ring_attention` is in the dict, and all ranks must agree on it
    (:func:`check_same_across_ranks`): a new option is added there (the score modifications:
    :func:`with_score_mods`; of the :class:`ParallelOptions`, those that change the collectives).
    """
    fn = FN
    try:
        parallel = check_options(options, fn)
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
            cu = packed_cu_seqlens(q, k, v, cu_seqlens, world, fn)
            layout_used = "contiguous" if layout is None else check_packed_layout(layout, fn)  # (the default as before)
            if parallel.transport == "copy_engine" and world > 1:  # (asked for explicitly: never ignored silently)
                raise ValueError(f"{fn}: ParallelOptions.transport='copy_engine' has no packed-batch (cu_seqlens) "
                                 "path: a packed ring's rows travel by the group's collectives; use 'auto' or 'nccl'")
        scale_used = V.check_scale(scale, q.shape[-1], fn=fn)
        deterministic_used = V.check_deterministic(deterministic, fn)
        check_block_backend(backend, q, scale_used, fn)
    except (TypeError, ValueError) as e:
        return {}, str(e)
    return {"causal": causal, "layout": Resolved(layout_used, layout), "scale": Resolved(scale_used, scale),
            "backend": backend, "return_lse": return_lse, "cu_seqlens": cu,
            "deterministic": Resolved(deterministic_used, deterministic),
            # ranks moving the blocks differently would wait for messages never sent
            **parallel.compared("transport")}, None


def collective_grads(q: Tensor, k: Tensor, v: Tensor, checked: dict) -> dict:
    """The inputs whose gradients make a ring's backward run its collectives (``checked``: the call's options, as
    :func:`_ring_options` gives them): q, k and v, not the sinks (added to the merged result: their gradient is
    local); of a packed batch in the contiguous layout, k and v only (the rows a rank fetches are keys and values,
    their gradients travel back to their owners; the queries' gradient is local). Compared across ranks
    (:func:`check_same_across_ranks`): a rank whose backward runs without these would skip the exchange its peers
    wait in."""
    layout = checked.get("layout")
    if checked.get("cu_seqlens") is not None and isinstance(layout, Resolved) and layout.value == "contiguous":
        return {"k": k, "v": v}
    return {"q": q, "k": k, "v": v}


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None, causal: bool = False,
    layout: Optional[str] = None, scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, deterministic: bool = False, options: Optional[ParallelOptions] = None,
):
    """Exact attention over a sequence sharded across the ranks of ``group`` (collective: every rank calls it).

    Args:
        q: ``(B, N/P, Hq, D)``, this rank's shard of the queries (see :func:`longattn.distributed.shard`).
        k, v: ``(B, N/P, Hk, D)``, this rank's shards of keys and values, ``Hq % Hk == 0`` (grouped-query).
        group: the process group the sequence is split over (default: the world).
        causal: global causal masking (position ``i`` sees positions ``j <= i`` of the full sequence).
        layout: how the global sequence maps to shards, ``"zigzag"`` (the default without ``cu_seqlens``; balances
            causal work, needs an even shard length) or ``"contiguous"``. Packed batches (``cu_seqlens``):
            ``"balanced"`` (documents dealt out whole where that balances the causal work, the longest cut in
            ``2P`` chunks) or ``"contiguous"`` (the default, the batch's rows cut in ``P``). The tensors
            :func:`~longattn.distributed.shard` cut in another layout are refused (``ValueError`` on every rank) where
            the order of the rows matters (causal, ALiBi, packed batches); a tensor computed from one (a projection)
            cannot be told apart, and its result would be wrong.
        scale: softmax scale, default ``D ** -0.5``. backend: per-block kernels, as :func:`longattn.flash_attention`.
        return_lse: also return the log-sum-exp ``(B, Hq, N/P)``, float32 (float64 for float64 inputs),
            differentiable.
        cu_seqlens: a packed variable-length batch: q ``(total/P, Hq, D)``, k and v ``(total/P, Hk, D)`` are this
            rank's rows of the packed batch in ``layout`` (``shard(x, layout=layout, dim=0, cu_seqlens=cu_seqlens)``)
            and ``cu_seqlens`` ``(batch + 1,)`` the global boundaries (as in :func:`longattn.flash_attention_varlen`;
            the same on every rank, on the inputs' device). Each rank fetches the key/value rows of other ranks that
            its queries need (see :mod:`longattn.distributed.ring_varlen`); lse is then ``(Hq, total/P)``. Takes
            ``sinks`` but not yet ``softcap`` or ``alibi_slopes`` (``NotImplementedError``).
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).
        softcap, alibi_slopes, sinks: logit soft-capping, ALiBi slopes ``(Hq,)`` or ``(B, Hq)`` (distances between
            global positions) and attention sinks ``(Hq,)``, as in :func:`longattn.flash_attention`; every rank
            passes the same values. The gradient of ``sinks`` on each rank is its queries' share: summed over the
            group (as for any weight the ranks share) it is the whole sequence's.
        deterministic: bitwise-identical gradients from run to run, as in :func:`longattn.flash_attention`: every
            block's backward is a deterministic call (on Hopper the two Triton passes instead of the fused Gluon
            backward) and the gradients are summed in a fixed order. Also on under PyTorch's deterministic mode;
            compared across ranks as it takes effect.
        options: how the call runs (:class:`~longattn.distributed.ParallelOptions`: the blocks' transport, the
            option check's exchange, the copy engines' timeout); ``None``: the defaults. Its ``transport`` is
            compared across ranks.

    Returns:
        This rank's shard of ``flash_attention(q_full, k_full, v_full, causal=causal)``, ``(B, N/P, Hq, D)`` (with
        ``cu_seqlens``: its rows of ``flash_attention_varlen`` on the gathered batch, ``(total/P, Hq, D)``).
        Differentiable in ``q``, ``k``, ``v`` and ``sinks``. All ranks must pass shards of the same shape and dtype
        and the same options (compared as they take effect: ``scale=None`` and ``D ** -0.5`` agree); otherwise every
        rank raises ``ValueError`` naming what differs and each rank's value. A group of one rank runs the
        single-GPU op.
    """
    q, k, v = _autocast.cast_inputs(q, k, v)  # SDPA's autocast rule, as every attention function
    world, _ = group_size_rank(group, "ring_attention: group")
    checked, local_error = _ring_options(q, k, v, world, causal=causal, layout=layout, scale=scale, backend=backend,
                                         return_lse=return_lse, cu_seqlens=cu_seqlens, deterministic=deterministic,
                                         options=options)
    checked, mods, local_error = with_score_mods(checked, local_error, q, FN, softcap=softcap,
                                                 alibi_slopes=alibi_slopes, sinks=sinks)
    if local_error is None and rows_ordered(checked, mods):  # (shard()'s tensors cut in another layout: refused)
        local_error = cut_error(FN, {"q": q, "k": k, "v": v}, checked["layout"].value, layout)
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn=FN, options=checked, local_error=local_error,
                            host_checks=host_checks_of(options), grad_inputs=(sinks,),
                            collective_grads=collective_grads(q, k, v, checked))
    o = effective(checked)
    return run_ring(q, k, v, group, o, mods, backend, check_options(options, FN))


def run_ring(q: Tensor, k: Tensor, v: Tensor, group, o: dict, mods: ScoreMods, backend: str,
             options: ParallelOptions):
    """The ring over ``group`` of a call already checked and agreed by every rank (what :func:`ring_attention`
    runs after its check; :func:`~longattn.distributed.hybrid_attention` runs it on its ring group, having checked
    both of its groups at once): ``o`` the options as they take effect (``causal``, ``layout``, ``scale``,
    ``return_lse``, ``cu_seqlens``, ``deterministic``), ``mods`` the score modifications. Returns ``out`` or
    ``(out, lse)`` as :func:`ring_attention`."""
    world, _ = group_size_rank(group)
    if o["cu_seqlens"] is not None:
        from longattn.distributed.ring_varlen import ring_flash_varlen

        check_packed_mods(mods, FN)
        out, lse = ring_flash_varlen(q, k, v, o["cu_seqlens"], group=group, causal=o["causal"], scale=o["scale"],
                                     backend=backend, layout=o["layout"], deterministic=o["deterministic"])
        if mods.sinks is not None:  # (a batch row for add_sinks)
            out, lse = (x.squeeze(0) for x in add_sinks(out[None], lse[None], mods.sinks))
    elif world == 1 or q.shape[2] == 0:  # (no query heads: nothing to compute or send; every rank has agreed)
        from longattn.functional import flash_attention

        return flash_attention(q, k, v, causal=o["causal"], scale=o["scale"], backend=backend,
                               return_lse=o["return_lse"], deterministic=o["deterministic"], **mods.kwargs())
    else:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        ring = Ring(group, options, q.device, backward=backward_channels(k, q.dtype) if grad else None, fn=FN)
        out, lse = _RingAttention.apply(q, k, v, ring, o["causal"], o["layout"], o["scale"], backend,
                                        mods._replace(sinks=None), o["deterministic"])
        if mods.sinks is not None:
            out, lse = add_sinks(out, lse, mods.sinks)
    return (out, lse) if o["return_lse"] else out
