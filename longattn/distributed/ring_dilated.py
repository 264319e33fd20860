"""LongNet's distributed dilated attention over a sequence split contiguously across the ranks of a group.

Rank ``i`` holds positions ``[i * n, (i + 1) * n)`` (``n = N / P``). Each branch ``(w, r)`` of the dilated
attention (segments of ``w`` positions, every ``r``-th row from a per-head offset) is one of:

- *local*: ``w`` divides ``n`` (segments never cross a rank boundary); the branch runs on the shard alone. When
  every branch is local, the call is exactly :func:`longattn.dilated_attention` on the shard (fused kernels, no
  communication at all).
- *spanning*: ``w`` is a multiple of ``n`` (or at least ``N``); a segment covers ``m = w / n`` whole shards. Every
  rank selects its dilated rows of keys and values (``n / r`` per head, so ``n % r == 0`` is required) and they
  are all-gathered over the group; each rank keeps those of the ranks of its own segment (causal: of the ranks up
  to its own) and attends its selected queries to them.

Branches merge by log-sum-exp exactly as in :func:`longattn.dilated_attention`. The backward feeds every branch
the final output and log-sum-exp (and the gradient of the latter); the key/value gradients of a spanning branch go
back to their owners with one all-to-all (a reduce-scatter that also works on gloo).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn import _autocast, ops, runner
from longattn._autograd import refuse_batched_gradients_across_ranks, refuse_second_derivative
from longattn.distributed.shards import (Resolved, check_same_across_ranks, effective, group_size_rank,
                                        shard_layout)
from longattn.call import accumulator_dtype, check_head_split, flash_call, head_groups
from longattn.distributed.blocks import check_block_backend, merge_into, packed_cu_seqlens
from longattn.distributed.options import ParallelOptions, check_options, host_checks_of
from longattn.distributed.ring_varlen import index_add

Group = Tuple[int, slice]  # (row offset inside the window, query heads)


@dataclass(frozen=True)
class Branch:
    """One branch as this rank computes it.

    Rows are selected inside windows of ``window`` rows of the shard (the segment for a local branch, the whole
    shard for a spanning one): rows ``o, o + rate, ...`` of each window for the heads of each group ``(o, heads)``.
    A spanning branch attends to the rows of group ranks ``key_ranks``.
    """

    index: int
    window: int
    rate: int
    groups: Tuple[Group, ...]
    key_ranks: Optional[Tuple[int, ...]] = None  # None: local

    @property
    def local(self) -> bool:
        return self.key_ranks is None


def _head_groups(i: int, rate: int, n_heads: int, n_branches: int, head_split: bool) -> Tuple[Group, ...]:
    if head_split:
        heads = head_groups(n_heads, n_branches)[i]
        return ((i % rate, slice(heads.start, heads.stop)),) if len(heads) else ()
    return tuple((o, slice(o, n_heads, rate)) for o in range(min(rate, n_heads)))


_ULYSSES_HINT = ("; ulysses_dilated_attention takes any segment lengths and rates (where the group size divides "
                 "the query heads)")


def plan_branches(n: int, world: int, rank: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                  n_heads: int, causal: bool, head_split: bool) -> List[Branch]:
    """The branches for shard length ``n`` on rank ``rank`` of ``world``; raises ``ValueError`` if one cannot run."""
    total = n * world
    branches = []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        groups = _head_groups(i, r, n_heads, len(segment_lengths), head_split)
        if not groups:
            continue
        w = min(w, max(total, 1))
        if n % w == 0:
            branches.append(Branch(i, w, r, groups))
        elif w % n == 0:
            if n % r:
                raise ValueError(
                    f"ring_dilated_attention: branch {i} (segment {segment_lengths[i]}, rate {r}) spans several "
                    f"ranks, which needs the shard length {n} to be divisible by the dilation rate {r}{_ULYSSES_HINT}"
                )
            m = w // n
            first = (rank // m) * m
            last = rank if causal else min(first + m, world) - 1
            branches.append(Branch(i, n, r, groups, tuple(range(first, last + 1))))
        else:
            raise ValueError(
                f"ring_dilated_attention: segment length {segment_lengths[i]} must divide the shard length {n} or "
                f"be a multiple of it (the sequence is split into {world} shards of {n}){_ULYSSES_HINT}"
            )
    return branches


def _buckets(branch: Branch) -> List[Tuple[int, Tuple[Group, ...]]]:
    """The branch's head groups bucketed by their number of rows per window (one attention call per bucket)."""
    by_rows = {}
    for o, hs in branch.groups:
        by_rows.setdefault(len(range(o, branch.window, branch.rate)), []).append((o, hs))
    return [(rows, tuple(g)) for rows, g in by_rows.items() if rows > 0]


def _n_heads(hs: slice, total: int) -> int:
    return len(range(total)[hs])


def _kv_heads(hs: slice, hq: int, hk: int, device) -> Tensor:
    return torch.arange(hq, device=device)[hs] // (hq // hk)


def _select(x: Tensor, branch: Branch, groups, hq: int) -> Tensor:
    """Selected rows ``(B * windows, rows, heads of groups, D)``; for keys/values the heads are mapped to Hk."""
    B, n, H, D = x.shape
    xv = x.view(B, n // branch.window, branch.window, H, D)
    parts = []
    for o, hs in groups:
        rows = xv[:, :, o::branch.rate]
        parts.append(rows[:, :, :, hs] if H == hq else rows.index_select(3, _kv_heads(hs, hq, H, x.device)))
    sel = torch.cat(parts, dim=3)
    return sel.reshape(B * sel.shape[1], sel.shape[2], sel.shape[3], D)


def _select_lse(lse: Tensor, branch: Branch, groups) -> Tensor:
    """Selected log-sum-exps ``(B * windows, heads, rows)``."""
    B, H, n = lse.shape
    lv = lse.view(B, H, n // branch.window, branch.window)
    sel = torch.cat([lv[:, hs, :, o::branch.rate] for o, hs in groups], dim=1)  # (B, heads, windows, rows)
    return sel.permute(0, 2, 1, 3).reshape(-1, sel.shape[1], sel.shape[3]).contiguous()


def _head_slices(groups, hq: int):
    """``(offset, query heads, slice of the bucket's head axis)`` for each group of a bucket."""
    h0 = 0
    for o, hs in groups:
        nh = _n_heads(hs, hq)
        yield o, hs, slice(h0, h0 + nh)
        h0 += nh


def _as_windows(x: Tensor, branch: Branch) -> Tensor:
    B, n = x.shape[:2]
    return x.view(B, n // branch.window, branch.window, *x.shape[2:])


def _gather_keys(ks: Tensor, vs: Tensor, branch: Branch, group) -> Tuple[Tensor, Tensor]:
    """All-gather the selected keys/values; concatenate those of ``branch.key_ranks`` along the rows."""
    world, _ = group_size_rank(group)
    mine = torch.stack([ks, vs]).contiguous()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    kv = torch.cat([parts[j] for j in branch.key_ranks], dim=2)
    del parts
    return kv[0], kv[1]


def _return_key_grads(dk: Tensor, dv: Tensor, branch: Branch, group) -> Tuple[Tensor, Tensor]:
    """Send each rank its rows of the gathered key/value gradients and sum what arrives (in their dtype)."""
    world, _ = group_size_rank(group)
    rows = dk.shape[1] // len(branch.key_ranks)
    send = torch.zeros((world, 2) + tuple(dk.shape[:1]) + (rows,) + tuple(dk.shape[2:]), dtype=dk.dtype,
                       device=dk.device)
    for i, j in enumerate(branch.key_ranks):
        send[j, 0] = dk[:, i * rows:(i + 1) * rows]
        send[j, 1] = dv[:, i * rows:(i + 1) * rows]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    total = recv.sum(0)
    return total[0], total[1]


def _forward(q, k, v, branches: List[Branch], group, causal: bool, scale: float, backend: str):
    B, n, H, D = q.shape
    out = torch.zeros((B, n, H, D), dtype=accumulator_dtype(q.dtype), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    for br in branches:
        out_w = _as_windows(out, br)
        lse_w = lse.view(B, H, n // br.window, br.window)
        for rows, groups in _buckets(br):
            qs, ks, vs = (_select(x, br, groups, H) for x in (q, k, v))
            if not br.local:
                ks, vs = _gather_keys(ks, vs, br, group)
            o, lse_b = ops.attention_forward(qs, ks, vs, causal=causal, scale=scale, backend=backend,
                                             out_dtype=out.dtype)
            windows = n // br.window  # (not -1: a batch of 0 rows would leave it ambiguous)
            o = o.view(B, windows, rows, o.shape[2], D)
            lse_b = lse_b.view(B, windows, lse_b.shape[1], rows).permute(0, 1, 3, 2)  # (B, windows, rows, heads)
            for off, hs, hb in _head_slices(groups, H):
                merge_into(out_w[:, :, off::br.rate, hs], lse_w[:, hs, :, off::br.rate].permute(0, 2, 3, 1),
                       o[:, :, :, hb], lse_b[..., hb])
    return out.to(q.dtype), lse


def _backward(do, q, k, v, out, lse, branches: List[Branch], group, causal: bool, scale: float, backend: str,
              deterministic: bool = False, dlse: Optional[Tensor] = None):
    """The gradients of the branches from the final ``out`` and ``lse`` and the gradients ``do`` and ``dlse`` (or
    None) of both: each branch's share is that of attention over its keys with the merged result (as the ring's)."""
    B, n, H, D = q.shape
    Hk = k.shape[2]
    call = replace(flash_call(scale, causal), deterministic=deterministic)
    dq = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    dk = torch.zeros(k.shape, dtype=accumulator_dtype(q.dtype), device=k.device)
    dv = torch.zeros(v.shape, dtype=accumulator_dtype(q.dtype), device=v.device)
    for br in branches:
        dq_w, dk_w, dv_w = (_as_windows(t, br) for t in (dq, dk, dv))
        for rows, groups in _buckets(br):
            qs, ks, vs, dos, os_ = (_select(x, br, groups, H) for x in (q, k, v, do, out))
            ls = _select_lse(lse, br, groups)
            dls = None if dlse is None else _select_lse(dlse, br, groups)
            if not br.local:
                ks, vs = _gather_keys(ks, vs, br, group)
            dqs, dks, dvs = runner.backward(dos, qs, ks, vs, os_, ls, call, backend=backend,
                                            fn="ring_dilated_attention", grad_dtype=accumulator_dtype(q.dtype),
                                            dlse=dls)
            if not br.local:
                dks, dvs = _return_key_grads(dks, dvs, br, group)
            shape = (B, n // br.window, rows, dqs.shape[2], D)  # (not -1: ambiguous for a batch of 0 rows)
            dqs, dks, dvs = dqs.view(shape), dks.reshape(shape), dvs.reshape(shape)

            for off, hs, hb in _head_slices(groups, H):
                dq_w[:, :, off::br.rate, hs] += dqs[:, :, :, hb]
                for acc_w, sel in ((dk_w, dks), (dv_w, dvs)):
                    target = acc_w[:, :, off::br.rate]
                    if Hk == H:
                        target[:, :, :, hs] += sel[:, :, :, hb]
                    else:
                        index_add(target, 3, _kv_heads(hs, H, Hk, q.device), sel[:, :, :, hb].to(target.dtype),
                                  deterministic)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingDilated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, branches, group, causal, scale, backend, deterministic):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _forward(q, k, v, branches, group, causal, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (branches, group, causal, scale, backend, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        refuse_second_derivative("ring_dilated_attention")
        refuse_batched_gradients_across_ranks("ring_dilated_attention", do, dlse)
        q, k, v, out, lse = ctx.saved_tensors
        do = torch.zeros_like(out) if do is None else do
        dlse = None if dlse is None else dlse.to(lse.dtype).contiguous()
        dq, dk, dv = _backward(do.contiguous(), q, k, v, out, lse, *ctx.cfg, dlse=dlse)
        return dq, dk, dv, None, None, None, None, None, None


def _dilated_options(q: Tensor, k: Tensor, v: Tensor, world: int, *, segment_lengths, dilation_rates, causal,
                     head_split, scale, backend, return_lse, cu_seqlens,
                     deterministic=False, options=None) -> Tuple[dict, Optional[str]]:
    """This rank's call checked: ``(its options as they take effect, None)``, or ``({}, the error message)``.

    Every option of :func:`ring_dilated_attention` is in the dict, and all ranks must agree on it
    (:func:`check_same_across_ranks`): a new option is added there.
    """
    from longattn import _validation as V

    fn = "ring_dilated_attention"
    try:
        parallel = check_options(options, fn)
        if parallel.transport == "copy_engine" and world > 1:  # (asked for explicitly: never ignored silently)
            raise ValueError(f"{fn}: ParallelOptions.transport='copy_engine' has no path here: the branches' keys "
                             "travel by the group's all-gathers and all-to-alls, which the copy engines do not carry; "
                             "use 'auto' or 'nccl', or ulysses_dilated_attention, whose all-to-alls they carry")
        causal, head_split, return_lse = (V.check_flag(x, name, fn) for name, x in (
            ("causal", causal), ("head_split", head_split), ("return_lse", return_lse)))
        if cu_seqlens is None:
            cu = None
            V.check_attention_inputs(q, k, v, fn=fn, self_attention=True)
        else:
            cu = packed_cu_seqlens(q, k, v, cu_seqlens, world, fn)
        segs, rates = V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
        check_head_split(head_split, q.shape[-2], len(segs), fn)
        V.check_backend(backend, fn)
        scale_used = V.check_scale(scale, q.shape[-1], fn=fn)
        deterministic_used = V.check_deterministic(deterministic, fn)
        check_block_backend(backend, q, scale_used, fn)
    except (TypeError, ValueError) as e:
        return {}, str(e)
    return {"segment_lengths": segs, "dilation_rates": rates, "causal": causal, "head_split": head_split,
            "scale": Resolved(scale_used, scale), "backend": backend, "return_lse": return_lse, "cu_seqlens": cu,
            "deterministic": Resolved(deterministic_used, deterministic)}, None


def ring_dilated_attention(
    q: Tensor, k: Tensor, v: Tensor, *, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
    group: Optional[dist.ProcessGroup] = None, causal: bool = False, head_split: bool = False,
    scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, deterministic: bool = False, options: Optional[ParallelOptions] = None,
):
    """LongNet dilated attention over a sequence split contiguously across ``group`` (collective call).

    Same semantics as :func:`longattn.dilated_attention` on the full sequence (``N = P * n``), of which this rank
    gets rows ``[rank * n, (rank + 1) * n)``.

    Args:
        q: ``(B, n, Hq, D)``, this rank's contiguous shard (``shard(x, layout="contiguous")``; not ``shard(x)``,
            whose default is the zigzag layout: the tensors ``shard(x)`` returned are refused, ``ValueError`` on
            every rank, but a tensor computed from one cannot be told apart, and its results would be wrong).
        k, v: ``(B, n, Hk, D)`` with ``Hq % Hk == 0``.
        segment_lengths, dilation_rates, causal, head_split, scale: as :func:`longattn.dilated_attention`. Every
            segment length must divide ``n`` (the branch runs locally, no communication) or be a multiple of ``n``
            (or at least ``N``); then ``n`` must be divisible by that branch's dilation rate.
        group: process group (default: the world). backend: per-branch kernels (``"auto"``, ``"triton"``,
            ``"torch"``).
        return_lse: also return the merged log-sum-exp ``(B, Hq, n)``, float32 (float64 for float64 inputs),
            differentiable.
        cu_seqlens: a packed variable-length batch (see :func:`longattn.distributed.ring_attention`): q, k, v
            ``(total/P, H, D)`` are this rank's contiguous rows, ``cu_seqlens`` the global boundaries, and the
            result is this rank's rows of :func:`longattn.dilated_attention_varlen` on the gathered batch (any
            segment lengths; see :mod:`longattn.distributed.ring_varlen` for the rows a rank fetches).
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).
        deterministic: bitwise-identical gradients from run to run, as in :func:`longattn.dilated_attention`: the
            branches' backward calls are deterministic ones and the gradients of grouped key/value heads are summed
            in a fixed order. Also on under PyTorch's deterministic mode; compared across ranks as it takes effect.
        options: :class:`~longattn.distributed.ParallelOptions` (here only ``host_checks``, how the option check
            exchanges, takes effect; ``transport="copy_engine"`` raises ``ValueError`` over several ranks: no
            transfer of this function runs on the copy engines); ``None``: the defaults.

    Returns:
        ``(B, n, Hq, D)``, differentiable in ``q``, ``k``, ``v``. Mismatched shapes, dtypes or options across ranks
        (options compared as they take effect), or an unsupported split, raise ``ValueError`` on every rank, naming
        what differs. A group of one rank runs the single-GPU op.

    Memory per rank: when every branch is local, that of :func:`longattn.dilated_attention` on the shard. Otherwise
    O(n) saved for the backward plus float32 accumulators, and a spanning branch of rate ``r`` transiently holds
    the gathered selected keys and values of the whole group, ``2 * N / r`` rows per head.
    """
    return _ring_dilated_attention(
        q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates, group=group, causal=causal,
        head_split=head_split, scale=scale, backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens,
        deterministic=deterministic, options=options)


def _ring_dilated_attention(q, k, v, *, segment_lengths, dilation_rates, group, causal, head_split, scale, backend,
                            return_lse, cu_seqlens, deterministic, options, also_compared=None):
    """:func:`ring_dilated_attention`; ``also_compared``: more options (name to value) that all ranks must agree on,
    compared in the same check (those of a module around the call that change its result, such as
    :class:`RingMultiheadDilatedAttention`'s rotary embedding)."""
    world, rank = group_size_rank(group, "ring_dilated_attention: group")
    q, k, v = _autocast.cast_inputs(q, k, v)  # SDPA's autocast rule, as every attention function
    checked, local_error = _dilated_options(
        q, k, v, world, segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=causal,
        head_split=head_split, scale=scale, backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens,
        deterministic=deterministic, options=options)
    o = effective(checked)
    branches = None
    if local_error is None and cu_seqlens is None:
        try:
            branches = plan_branches(q.shape[1], world, rank, o["segment_lengths"], o["dilation_rates"], q.shape[2],
                                     o["causal"], o["head_split"])
        except ValueError as e:
            local_error = str(e)
    cut = next((c for c in map(shard_layout, (q, k, v)) if c not in (None, "contiguous")), None)
    if local_error is None and cut is not None:
        default = " (shard(x)'s default)" if cut == "zigzag" else ""
        local_error = ("ring_dilated_attention: q, k and v must be this rank's contiguous shard (shard(x, "
                       f"layout='contiguous')); got a tensor shard() cut in the {cut!r} layout{default}, on which the "
                       "result would be wrong")
    if also_compared and local_error is None:
        checked = {**checked, **also_compared}
    check_same_across_ranks(group, {"q": q, "k": k, "v": v}, fn="ring_dilated_attention", options=checked,
                            local_error=local_error, host_checks=host_checks_of(options))
    kw = dict(segment_lengths=o["segment_lengths"], dilation_rates=o["dilation_rates"], causal=o["causal"],
              head_split=o["head_split"], scale=o["scale"], backend=backend, deterministic=o["deterministic"])
    if o["cu_seqlens"] is not None:
        from longattn.distributed.ring_varlen import ring_dilated_varlen

        out, lse = ring_dilated_varlen(q, k, v, o["cu_seqlens"], group=group, **kw)
    elif world == 1 or all(b.local for b in branches):
        # No segment crosses a rank boundary: the shard's dilated attention is exactly the single-GPU op.
        from longattn.functional import dilated_attention

        return dilated_attention(q, k, v, return_lse=o["return_lse"], **kw)
    else:
        out, lse = _RingDilated.apply(q, k, v, branches, group, o["causal"], o["scale"], backend,
                                      o["deterministic"])
    return (out, lse) if o["return_lse"] else out
