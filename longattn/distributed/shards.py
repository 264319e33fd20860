"""How a global sequence is cut into per-rank shards, and the process-group helpers the ring layers share.

Two layouts of a sequence of ``N`` positions over ``P`` ranks:

- ``"contiguous"``: rank ``i`` holds positions ``[i * N/P, (i + 1) * N/P)``.
- ``"zigzag"``: the sequence is cut into ``2P`` equal chunks; rank ``i`` holds chunk ``i`` followed by chunk
  ``2P - 1 - i``. Under causal attention every rank then has the same amount of work.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

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

    The inverse of :func:`shard`. All ranks must pass shards of the same shape and dtype, and the same ``layout``
    and ``dim`` (checked; a mismatch, or bad input on any rank, raises ``ValueError`` on every rank). Not
    differentiable (the result carries no gradient).
    """
    world, _ = group_size_rank(group)
    options, local_error = {}, None
    try:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        layout = check_layout(layout)
        d = _normalize_dim(x, dim)
        if layout == "zigzag" and x.shape[d] % 2:
            raise ValueError(f"the zigzag layout needs an even shard length along dim {d}, got {x.shape[d]}")
        options = {"layout": layout, "dim": Resolved(d, dim)}
    except (TypeError, ValueError) as e:
        local_error = f"unshard: {e}"
    check_same_across_ranks(group, {"x": x}, fn="unshard", options=options, local_error=local_error)
    dim = options["dim"].value
    if world == 1:
        return x.detach().clone()
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return join_shards(parts, layout, dim)


class Resolved(NamedTuple):
    """An option as it takes effect (``value``, what ranks are compared on) and as the caller gave it (``given``,
    shown in errors too): ``scale=None`` on one rank and ``scale=D ** -0.5`` on another agree."""

    value: Any
    given: Any


def effective(options: Mapping[str, Any]) -> Dict[str, Any]:
    """The values ``options`` take effect with (a :class:`Resolved` option's ``value``)."""
    return {name: o.value if isinstance(o, Resolved) else o for name, o in options.items()}


Fact = Tuple[str, Any, Any]  # (what, value compared across ranks, value as given)


def _facts(tensors: Mapping[str, Tensor], options: Mapping[str, Any]) -> List[Fact]:
    facts: List[Fact] = []
    for name, t in tensors.items():
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        dtype = t.dtype if isinstance(t, Tensor) else None
        facts += [(f"the shape of {name}", shape, shape), (f"the dtype of {name}", dtype, dtype)]
    for name, o in options.items():
        value, given = (o.value, o.given) if isinstance(o, Resolved) else (o, o)
        facts.append((f"option {name}", value, given))
    return facts


def _digest(facts: List[Fact]) -> int:
    """A 64-bit fingerprint of the compared values (``repr`` is exact and the same in every process)."""
    text = repr([(what, value) for what, value, _ in facts]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def check_same_across_ranks(
    group: Optional[dist.ProcessGroup], tensors: Mapping[str, Tensor], *, fn: str,
    options: Optional[Mapping[str, Any]] = None, local_error: Optional[str] = None,
) -> None:
    """Raise ``ValueError`` on every rank unless no rank failed and all agree on the shapes and dtypes of
    ``tensors`` and on ``options`` (name to value, or :class:`Resolved`; values compared by ``repr``).

    ``local_error`` is this rank's own validation error (or None); it is shared so that an input error on one rank
    is raised on all ranks instead of leaving the others waiting in a collective. A call adds its options to the
    dict it passes; nothing else changes. Cost: one all-gather of two integers (a failure flag and a fingerprint
    of the rest); only when some rank failed or the fingerprints differ, an ``all_gather_object`` of the values
    (every rank takes the same path: they all see the same gathered integers) to name what differs.
    """
    world, rank = group_size_rank(group)
    if world == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    facts = _facts(tensors, options or {}) if local_error is None else []
    dev = collective_device(group)
    mine = torch.tensor([int(local_error is not None), _digest(facts)], dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    summary = [tuple(e.tolist()) for e in every]
    if all(s == (0, summary[0][1]) for s in summary):
        return
    described: List[Optional[Tuple[Optional[str], List[Fact]]]] = [None] * world
    dist.all_gather_object(described, (local_error, facts), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(described) if err is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {err}" for r, err in failed)
        raise ValueError(f"{fn}: invalid input on {len(failed)} rank(s): {detail}")
    raise ValueError(
        f"{fn}: all ranks must pass shards of the same shape and dtype and the same options; "
        + "; ".join(differences([f for _, f in described]) or ["their descriptions differ"])
    )


def differences(per_rank: Sequence[Sequence[Fact]]) -> List[str]:
    """``"<what> differs across ranks: rank 0 has A, ranks 1-3 have B"`` for every fact on which ranks differ."""
    tables = [{what: (value, given) for what, value, given in facts} for facts in per_rank]
    lines = []
    for what in dict.fromkeys(what for facts in per_rank for what, _, _ in facts):
        groups: Dict[str, List[int]] = {}
        for r, table in enumerate(tables):
            groups.setdefault(repr(table[what][0]) if what in table else "<missing>", []).append(r)
        if len(groups) == 1:
            continue
        values = [tables[ranks[0]].get(what) for ranks in groups.values()]
        shown = [_show(v) for v in values]
        at = _first_difference([v[0] for v in values if v is not None])
        parts = [f"{_rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} {text}"
                 for ranks, text in zip(groups.values(), shown)]
        lines.append(f"{what} differs across ranks{at}: " + ", ".join(parts))
    return lines


def _show(value_given: Optional[Tuple[Any, Any]], limit: int = 200) -> str:
    if value_given is None:
        return "no such value"
    value, given = value_given
    text = repr(given) if repr(given) == repr(value) else f"{given!r} (= {value!r})"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _first_difference(values: List[Any]) -> str:
    """`` (first at index i)`` for long sequences of equal length, whose shown values may be cut short."""
    if not all(isinstance(v, (list, tuple)) for v in values) or len({len(v) for v in values}) != 1:
        return ""
    if len(repr(values[0])) <= 200:
        return ""
    i = next((i for i in range(len(values[0])) if len({repr(v[i]) for v in values}) > 1), None)
    if i is None:
        return ""
    return f" (first at index {i}: " + " vs ".join(repr(v[i]) for v in values) + ")"


def _rank_list(ranks: List[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``."""
    spans, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)
