"""Hybrid sequence parallelism (USP): Ulysses inside a group of ranks, ring attention across such groups.

The ``P = R U`` ranks form an ``R x U`` grid: a *Ulysses group* of ``U`` ranks (typically the GPUs of a node) and
a *ring group* of ``R`` ranks (one per node, same position in each). The sequence is cut for the ring first
(``layout`` over the ``R`` ring positions), then each ring shard contiguously over its Ulysses group
(:func:`shard_hybrid`). A call gathers each ring shard inside its Ulysses group for ``1/U`` of the heads (Ulysses'
all-to-all), runs :func:`longattn.distributed.ring_attention` over the ring group on it, and sends the output back
with the reverse all-to-all. Each rank's communication: two all-to-alls inside its Ulysses group and the ring's
``R - 1`` steps of ``1/U`` of the key/value heads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist
from torch import Tensor

from longattn import _autocast
from longattn.distributed.blocks import check_block_backend, check_packed_mods, with_score_mods
from longattn.distributed.options import ParallelOptions, check_options, host_checks_of
from longattn.distributed.ring import run_ring
from longattn.distributed.shards import (
    _normalize_dim, check_layout, check_same_across_ranks, effective, group_size_rank, gather_shards, take_shard,
    shard_layout,
)
from longattn.distributed.ulysses import ulysses_options, ulysses_run


def hybrid_groups(ring_group=None, ulysses_group=None, mesh=None,
                  fn: str = "hybrid_attention") -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(ring_group, ulysses_group)`` from the two groups, or from a 2-D ``DeviceMesh`` whose dimension 0 is the ring
    and dimension 1 Ulysses (``init_device_mesh(device, (R, U))``: Ulysses over consecutive ranks, e.g. a node)."""
    if mesh is not None:
        if ring_group is not None or ulysses_group is not None:
            raise ValueError(f"{fn}: pass either mesh or ring_group and ulysses_group, not both")
        if getattr(mesh, "ndim", None) != 2:
            raise ValueError(f"{fn}: mesh must be a 2-D torch.distributed.DeviceMesh (ring, ulysses), got "
                             f"{type(mesh).__name__} with ndim {getattr(mesh, 'ndim', None)}")
        return mesh.get_group(0), mesh.get_group(1)
    if ring_group is None or ulysses_group is None:
        raise ValueError(f"{fn}: pass ring_group and ulysses_group (process groups), or mesh (a 2-D DeviceMesh)")
    if ring_group is ulysses_group and dist.get_world_size(ring_group) > 1:
        raise ValueError(f"{fn}: ring_group and ulysses_group are the same group of "
                         f"{dist.get_world_size(ring_group)} ranks; they must be the two dimensions of an R x U grid "
                         f"of ranks (e.g. mesh=init_device_mesh(device, (R, U)))")
    return ring_group, ulysses_group


def take_hybrid_shard(x: Tensor, layout: str, ring: Tuple[int, int], ulysses: Tuple[int, int], dim: int = 1) -> Tensor:
    """The part of ``x`` along ``dim`` of the rank at ring position ``ring = (rank, size)`` and Ulysses position
    ``ulysses = (rank, size)``: its ring shard (``layout``), cut contiguously. No process group needed."""
    part = take_shard(x, layout, ring[0], ring[1], dim)
    return take_shard(part, "contiguous", ulysses[0], ulysses[1], dim)


def shard_hybrid(x: Tensor, ring_group=None, ulysses_group=None, layout: str = "zigzag", dim: int = 1, *,
                 mesh=None) -> Tensor:
    """This rank's part of the full tensor ``x`` for :func:`hybrid_attention` (every rank passes the same ``x``):
    the ``layout`` shard over the ring group, cut contiguously over the Ulysses group. Differentiable (slicing).
    ``x.shape[dim]`` must be divisible by ``R U`` (contiguous) or ``2 R U`` (zigzag)."""
    ring_group, ulysses_group = hybrid_groups(ring_group, ulysses_group, mesh, "shard_hybrid")
    layout = check_layout(layout, "shard_hybrid")
    dim = _normalize_dim(x, dim)
    ring = group_size_rank(ring_group, "ring_group")[::-1]
    uly = group_size_rank(ulysses_group, "ulysses_group")[::-1]
    parts = (2 if layout == "zigzag" else 1) * ring[1] * uly[1]
    if x.shape[dim] % parts:
        raise ValueError(f"shard_hybrid: the {layout} layout over {ring[1]} x {uly[1]} ranks needs the length along "
                         f"dim {dim} to be divisible by {parts}, got {x.shape[dim]}")
    return take_hybrid_shard(x, layout, ring, uly, dim)


def unshard_hybrid(x: Tensor, ring_group=None, ulysses_group=None, layout: str = "zigzag", dim: int = 1, *,
                   mesh=None, options: Optional[ParallelOptions] = None) -> Tensor:
    """Gather every rank's part (as :func:`shard_hybrid` cuts it) into the full tensor, on every rank (collective,
    not differentiable): :func:`longattn.distributed.unshard` over the Ulysses group, then over the ring group
    (``options``: as there)."""
    fn = "unshard_hybrid"
    ring_group, ulysses_group = hybrid_groups(ring_group, ulysses_group, mesh, fn)
    try:  # (the ring's layout compared inside the Ulysses group too: ring groups then all agree or all refuse)
        ring_layout = check_layout(layout, fn)
    except ValueError as e:
        ring_layout = e
    try:
        part = gather_shards(x, ulysses_group, "contiguous", dim, None, options, fn, group_name="Ulysses group",
                             also={"ring layout": ring_layout})
    except ValueError as e:  # refused inside this Ulysses group: the other groups must not wait in the ring's gather,
        # so the failure becomes this rank's error in the ring group's check (as hybrid_attention's checks do), and
        # every rank of the grid raises
        check_same_across_ranks(ring_group, {}, fn=fn, local_error=str(e), group_name="ring group",
                                host_checks=host_checks_of(options), differentiable=False)
        raise  # (not reached: the check raises)
    return gather_shards(part, ring_group, layout, dim, None, options, fn, group_name="ring group")


def hybrid_attention(
    q: Tensor, k: Tensor, v: Tensor, *, ring_group: Optional[dist.ProcessGroup] = None,
    ulysses_group: Optional[dist.ProcessGroup] = None, mesh=None, layout: str = "zigzag", causal: bool = False,
    scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
    cu_seqlens: Optional[Tensor] = None, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, deterministic: bool = False, options: Optional[ParallelOptions] = None,
):
    """Exact attention over a sequence sharded over an ``R x U`` grid of ranks: Ulysses inside ``ulysses_group``
    (``U`` ranks), ring attention across ``ring_group`` (``R`` ranks) (collective: every rank of the grid calls it).

    Args:
        q: ``(B, N/(R U), Hq, D)``, this rank's part as :func:`shard_hybrid` cuts it; ``Hq`` divisible by ``U``.
            Not :func:`longattn.distributed.shard`'s part, even with one ring position (``R = 1``): ``shard(x)``
            cuts zigzag, as :func:`ulysses_attention` takes it, while inside a Ulysses group this cuts
            contiguously. The tensors ``shard(x)`` returned in another cut than this call's are refused
            (``ValueError`` on every rank) where the result depends on positions (causal, ALiBi, packed batches); a
            tensor computed from one (a projection) cannot be told apart, and its causal results would be wrong.
        k, v: ``(B, N/(R U), Hk, D)``, ``Hq % Hk == 0`` (any ``Hk``: repeated as Ulysses needs, see
            :func:`longattn.distributed.ulysses.kv_repeats`).
        ring_group, ulysses_group: this rank's two groups; the ranks of a Ulysses group must share one ring position
            and those of a ring group one Ulysses position (checked). Or ``mesh``: a 2-D ``DeviceMesh``, dimension 0
            the ring, dimension 1 Ulysses.
        layout: the ring's layout, ``"zigzag"`` (default; balances causal work over the ring) or ``"contiguous"``
            (the only one with ``cu_seqlens``). Inside a Ulysses group the ring shard is cut contiguously.
        causal, scale, backend: as :func:`longattn.distributed.ring_attention`.
        return_lse: also return the log-sum-exp of this rank's rows ``(B, Hq, N/(R U))``, differentiable.
        cu_seqlens: a packed batch ``(total/(R U), H, D)`` (rows cut contiguously over the whole grid) with its
            global boundaries, as in :func:`longattn.distributed.ring_attention`.
            Host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
            version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version
            counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
            :func:`longattn.remember_host_reads`).
        softcap, alibi_slopes, sinks: logit soft-capping, ALiBi slopes ``(Hq,)`` or ``(B, Hq)`` and attention sinks
            ``(Hq,)``, as in :func:`longattn.distributed.ring_attention` (packed batches: sinks only); every rank
            passes the same values. The gradient of ``sinks`` on each rank is its share (its heads, its ring
            shard's queries): summed over the grid it is the whole gradient.
        deterministic: bitwise-identical gradients from run to run, as in
            :func:`longattn.distributed.ring_attention` (also on under PyTorch's deterministic mode).
        options: how the call runs (:class:`~longattn.distributed.ParallelOptions`), for both the ring and the
            all-to-alls; ``None``: the defaults. Its ``transport`` and ``head_chunks`` are compared across ranks.

    Returns:
        This rank's part of ``flash_attention(q_full, k_full, v_full, causal=causal)`` (of
        ``flash_attention_varlen`` with ``cu_seqlens``), differentiable in ``q``, ``k``, ``v`` (and ``sinks``).
        Options and shapes are compared across both groups; a difference, or bad input on any rank, raises
        ``ValueError`` on every rank of the grid, naming what differs and each rank's value. One backward per call
        (a second, ``retain_graph=True``, raises), as :func:`longattn.distributed.ulysses_attention`.
    """
    fn = "hybrid_attention"
    q, k, v = _autocast.cast_inputs(q, k, v)  # SDPA's autocast rule, as every attention function
    ring_group, ulysses_group = hybrid_groups(ring_group, ulysses_group, mesh)
    (r_size, r_rank), (u_size, u_rank) = (group_size_rank(ring_group, "ring_group"),
                                          group_size_rank(ulysses_group, "ulysses_group"))
    checked, local_error = ulysses_options(fn, q, k, v, u_size, layout=layout, causal=causal, scale=scale,
                                           backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens,
                                           ring_size=r_size, deterministic=deterministic, options=options)
    checked, mods, local_error = with_score_mods(checked, local_error, q, fn, softcap=softcap,
                                                 alibi_slopes=alibi_slopes, sinks=sinks)
    if local_error is None and r_size > 1:  # (the ring's blocks: a backend they cannot run, refused before any sends)
        try:
            check_block_backend(backend, q, effective(checked)["scale"], fn)
        except ValueError as e:
            local_error = str(e)
    positional = causal or alibi_slopes is not None or cu_seqlens is not None  # (the order of the rows matters)
    # shard(x)'s cut is shard_hybrid's with one Ulysses rank in its layout, or contiguous over a contiguous ring or
    # one ring position (Ulysses over consecutive ranks); any other is refused where the result would be wrong
    cut = next((c for c in map(shard_layout, (q, k, v)) if c is not None and not (
        (u_size == 1 and c == layout) or (c == "contiguous" and (layout == "contiguous" or r_size == 1)))), None)
    if local_error is None and positional and cut is not None:
        local_error = (f"{fn}: q, k and v must be this rank's parts as shard_hybrid cuts them (the {layout!r} layout "
                       f"over the ring, contiguous inside a Ulysses group); got shard(x)'s {cut!r} shard, on which "
                       "the result would be wrong")
    tensors, host_checks = {"q": q, "k": k, "v": v}, host_checks_of(options)
    # The call's one check, on each of its two groups (together they cover the grid): what the ring over the ring
    # group and the all-to-alls over the Ulysses group run is agreed here, and neither checks again. Inside a Ulysses
    # group every rank must share the ring position; inside a ring group, the Ulysses position. A failure in the
    # first check becomes this rank's error in the second, so that every rank of the grid raises.
    try:
        check_same_across_ranks(ulysses_group, tensors, fn=fn, local_error=local_error, group_name="Ulysses group",
                                options={**checked, "ring position": (r_rank, r_size)} if checked else None,
                                host_checks=host_checks, grad_inputs=(sinks,))
    except ValueError as e:
        local_error = str(e)
    check_same_across_ranks(ring_group, tensors, fn=fn, local_error=local_error, group_name="ring group",
                            options={**checked, "Ulysses position": (u_rank, u_size)} if checked else None,
                            host_checks=host_checks, grad_inputs=(sinks,))
    o, parallel = effective(checked), check_options(options, fn)
    if o["cu_seqlens"] is not None:
        check_packed_mods(mods, fn)

    def local(q, k, v, first_head, params):  # this ring shard of 1/U of the heads, around the ring (checked above)
        mine = mods._replace(sinks=params[0]).heads(first_head, q.shape[-2])
        result = run_ring(q, k, v, ring_group, o, mine, backend, parallel)
        return result if o["return_lse"] else (result, None)

    # One head group: the local call is a ring over ring_group, whose rounds are better whole.
    return ulysses_run(q, k, v, local, ulysses_group, {**o, "layout": "contiguous"}, params=(mods.sinks,), chunks=1,
                       options=parallel)
