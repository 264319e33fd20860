"""How a global sequence is cut into per-rank shards, and the process-group helpers the ring layers share.

Two layouts of a sequence of ``N`` positions over ``P`` ranks:

- ``"contiguous"``: rank ``i`` holds positions ``[i * N/P, (i + 1) * N/P)``.
- ``"zigzag"``: the sequence is cut into ``2P`` equal chunks; rank ``i`` holds chunk ``i`` followed by chunk
  ``2P - 1 - i``. Under causal attention every rank then has the same amount of work.
"""
from __future__ import annotations

import zlib
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def group_size_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """``(P, rank)`` of this process in ``group`` (``None``: the default group). Raises if torch.distributed is off."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group first "
            "(e.g. under torchrun)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (the peer number point-to-point operations take)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where small bookkeeping tensors must live for collectives on ``group`` (CUDA for NCCL, else CPU)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def chunk_ids(layout: str, rank: int, world: int) -> List[int]:
    """The global chunk numbers rank ``rank`` holds, in order (chunks of ``N/P`` for contiguous, ``N/2P`` zigzag)."""
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world - 1 - rank]


def local_positions(n_local: int, layout: str, rank: int, world: int, device=None) -> Tensor:
    """Global positions (int64 ``(n_local,)``) of the rows of this rank's shard."""
    layout = check_layout(layout)
    ids = chunk_ids(layout, rank, world)
    if n_local % len(ids):
        raise ValueError(f"the {layout} layout needs an even shard length, got {n_local}")
    c = n_local // len(ids)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def _normalize_dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor with {x.dim()} dims")
    return dim % x.dim()


def take_shard(x: Tensor, layout: str, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (a new contiguous tensor; ``x.shape[dim]`` divisible by the
    layout's number of chunks); :func:`shard` without a process group."""
    chunks = x.chunk(2 * world if layout == "zigzag" else world, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(layout, rank, world)], dim=dim).contiguous()


def join_shards(parts: Sequence[Tensor], layout: str, dim: int = 1) -> Tensor:
    """The full tensor from every rank's shard (in rank order): the inverse of :func:`take_shard`."""
    world = len(parts)
    if layout == "contiguous":
        return torch.cat(list(parts), dim=dim)
    chunks = [None] * (2 * world)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * world - 1 - r] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def shard(x: Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's part of the full tensor ``x`` (every rank passes the same ``x``), along ``dim``.

    ``x.shape[dim]`` must be divisible by ``P`` (contiguous) or ``2P`` (zigzag). Returns a new contiguous tensor of
    length ``x.shape[dim] / P`` along ``dim``. Differentiable (it is slicing).
    """
    layout = check_layout(layout)
    dim = _normalize_dim(x, dim)
    world, rank = group_size_rank(group)
    n = x.shape[dim]
    parts = 2 * world if layout == "zigzag" else world
    if n % parts:
        raise ValueError(
            f"shard: the {layout} layout over {world} ranks needs the length along dim {dim} to be divisible by "
            f"{parts}, got {n}"
        )
    return take_shard(x, layout, rank, world, dim)


def unshard(x: Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """Gather every rank's shard ``x`` and return the full tensor in global order (on every rank).

    The inverse of :func:`shard`. All ranks must pass shards of the same shape (checked; a mismatch raises
    ``ValueError`` on every rank). Not differentiable (the result carries no gradient).
    """
    layout = check_layout(layout)
    dim = _normalize_dim(x, dim)
    world, _ = group_size_rank(group)
    check_same_across_ranks(group, [x], fn="unshard", extra=(LAYOUTS.index(layout), dim))
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"unshard: the zigzag layout needs an even shard length along dim {dim}, got {x.shape[dim]}")
    if world == 1:
        return x.detach().clone()
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return join_shards(parts, layout, dim)


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _signature(tensors: Sequence[Tensor], extra: Sequence[int], max_dims: int = 6) -> List[int]:
    sig: List[int] = []
    for t in tensors:
        dims = list(t.shape)[:max_dims]
        sig += [t.dim()] + dims + [-1] * (max_dims - len(dims))
        sig.append(_DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99)
    return sig + [int(e) for e in extra]


def config_code(*values) -> int:
    """A small integer fingerprint of configuration values (to compare them across ranks)."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def check_same_across_ranks(
    group: Optional[dist.ProcessGroup], tensors: Sequence[Tensor], *, fn: str, extra: Sequence[int] = (),
    local_error: Optional[str] = None,
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks agree (shapes, dtypes and ``extra``) and none failed.

    ``local_error`` is this rank's own validation error (or None); it is shared so that an input error on one rank
    is raised on all ranks instead of leaving the others waiting in a collective. One small all-gather.
    """
    world, rank = group_size_rank(group)
    if world == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    sig = [0 if local_error is None else 1] + _signature(tensors, extra)
    dev = collective_device(group)
    mine = torch.tensor(sig, dtype=torch.int64, device=dev)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(sig)], dtype=torch.int64, device=dev), group=group)
    if any(int(n.item()) != len(sig) for n in lengths):
        raise ValueError(f"{fn}: ranks passed different numbers of tensors or configurations")
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every_list = [e.tolist() for e in every]
    failed = [r for r, s in enumerate(every_list) if s[0]]
    if failed:
        messages: List[Optional[str]] = [None] * world
        dist.all_gather_object(messages, local_error, group=group)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise ValueError(f"{fn}: invalid input on {len(failed)} rank(s): {detail}")
    if any(s != every_list[0] for s in every_list):
        shapes = []
        for r, s in enumerate(every_list):
            shapes.append(f"rank {r}: {_describe(s[1:], len(tensors))}")
        raise ValueError(
            f"{fn}: all ranks must pass shards of the same shape and dtype and the same options; got "
            + "; ".join(shapes)
        )


def _describe(sig: List[int], n_tensors: int, max_dims: int = 6) -> str:
    out, pos = [], 0
    for _ in range(n_tensors):
        nd = sig[pos]
        dims = sig[pos + 1: pos + 1 + min(nd, max_dims)]
        code = sig[pos + 1 + max_dims]
        dtype = str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "other"
        out.append(f"{tuple(dims)} {dtype}")
        pos += max_dims + 2
    extra = sig[pos:]
    return ", ".join(out) + (f" options {extra}" if extra else "")
