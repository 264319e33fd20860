"""How a global sequence is cut into per-rank shards, and the process-group helpers the ring layers share.

Two layouts of a sequence of ``N`` positions over ``P`` ranks:

- ``"contiguous"``: rank ``i`` holds positions ``[i * N/P, (i + 1) * N/P)``.
- ``"zigzag"``: the sequence is cut into ``2P`` equal chunks; rank ``i`` holds chunk ``i`` followed by chunk
  ``2P - 1 - i``. Under causal attention every rank then has the same amount of work.

A packed batch of documents (``cu_seqlens``, ``total`` rows, ``total % P == 0``) has two layouts, given to
:func:`shard` / :func:`unshard` with ``cu_seqlens=``:

- ``"contiguous"``: the rows of the whole batch cut as above, documents crossing shard boundaries.
- ``"balanced"`` (:func:`balanced_layout`): documents kept whole and dealt out so that every rank has
  ``total / P`` rows and the same causal work (within 1%); the longest ones, where needed, cut in ``2P`` chunks
  of which rank ``i`` holds chunks ``i`` and ``2P - 1 - i``.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from longattn import _validation as V
from longattn import runner

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str, fn: str) -> str:
    """``layout``, one of :data:`LAYOUTS` (an error naming ``fn`` otherwise)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def group_size_rank(group: Optional[dist.ProcessGroup], name: str = "group") -> Tuple[int, int]:
    """``(P, rank)`` of this process in ``group`` (``None``: the default group; ``name``: the argument it came
    from, for the error). Raises if torch.distributed is off or ``group`` is not a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group first "
            "(e.g. under torchrun)"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # (an int: what dist.new_group returns on the ranks it leaves out)
        raise ValueError(f"{name} is torch.distributed.GroupMember.NON_GROUP_MEMBER: this process (global rank "
                         f"{dist.get_rank()}) is not a member of the group (dist.new_group returns that value on the "
                         f"ranks it leaves out); call this function only on the group's ranks")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        hint = (": pass mesh.get_group() (a 1-D mesh) or mesh.get_group(dim) for the dimension to split over"
                if type(group).__name__ == "DeviceMesh" else "")
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None (the default group), got "
                        f"{type(group).__name__} {group!r:.60}{hint}")
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


# Host-side twins of the process groups the checks run on (see host_group): group name -> (the group, its twin or
# None where none could be made).
_HOST_GROUPS: Dict[str, Tuple[object, Optional[object]]] = {}


def _group_key(group: Optional[dist.ProcessGroup]) -> Tuple[object, str]:
    """``(the group, its name)`` by which the host twins and the check channels are kept (None: the world)."""
    key = group if group is not None else dist.group.WORLD
    return key, getattr(key, "group_name", None) or str(id(key))


def host_group(group: Optional[dist.ProcessGroup], enabled: bool = True):
    """A gloo process group of the same ranks as ``group`` (a ``ProcessGroupGloo``, used through its own
    ``allgather``), made on first use by its members alone (the call that asks is collective over ``group``), or
    ``None`` where ``group`` already runs on the host (gloo), ``enabled`` is False (``ParallelOptions.host_checks``),
    or no twin could be made (the checks then exchange on ``group`` itself). The checks exchange on the host because
    an all-gather on the GPU stream makes the host wait for every kernel queued before it (the GPU then idles while
    the call is launched); a gloo twin of the group does not. Kept per group; a group that replaced one of the same
    name gets its own."""
    if not enabled or collective_device(group).type == "cpu":
        return None
    key, name = _group_key(group)
    entry = _HOST_GROUPS.get(name)
    if entry is None or entry[0] is not key:
        entry = (key, _host_twin(key))
        _HOST_GROUPS[name] = entry
    return entry[1]


def _host_twin(group) -> Optional[object]:
    """A ``ProcessGroupGloo`` over ``group``'s ranks on the default store, under a prefix the members agree on
    through ``group`` (a random number broadcast once: its own, whatever groups each rank made before, and never
    one a destroyed group used); ``None`` on every rank if any rank could not make it."""
    from datetime import timedelta

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = collective_device(group)
    token = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)
    dist.broadcast(token, src=global_rank(group, 0), group=group)
    twin = None
    try:
        store = dist.PrefixStore(f"longattn/host_check/{int(token.item())}/",
                                 dist.distributed_c10d._get_default_store())
        try:  # the group's own timeout, where PyTorch tells it
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            timeout = timedelta(minutes=10)
        twin = dist.ProcessGroupGloo(store, rank, world, timeout)
    except (AttributeError, RuntimeError, ValueError, TypeError):  # no gloo in this build, no default store
        twin = None
    ok = torch.tensor([1 if twin is not None else 0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return twin if ok.item() else None


def chunk_ids(layout: str, rank: int, world: int) -> List[int]:
    """The global chunk numbers rank ``rank`` holds, in order (chunks of ``N/P`` for contiguous, ``N/2P`` zigzag)."""
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world - 1 - rank]


def check_rank(rank, world, fn: str) -> Tuple[int, int]:
    """``(rank, world)`` as ints: ``world`` an int >= 1 and ``rank`` an int in ``[0, world)`` (bools refused);
    anything else is a ``TypeError`` or ``ValueError`` naming ``fn``."""
    for name, x in (("world", world), ("rank", rank)):
        if not V._is_int(x):
            raise TypeError(f"{fn}: {name} must be an int, got {type(x).__name__} {x!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{fn}: world must be >= 1 and rank in [0, world), got rank={rank}, world={world}")
    return int(rank), int(world)


def local_positions(n_local: int, layout: str, rank: int, world: int, device=None) -> Tensor:
    """Global positions (int64 ``(n_local,)``) of the rows of shard ``rank`` of ``world`` (``rank`` in
    ``[0, world)``; anything else is an error, not the positions of a rank that does not exist)."""
    fn = "local_positions"
    layout = check_layout(layout, fn)
    rank, world = check_rank(rank, world, fn)
    if not V._is_int(n_local) or n_local < 0:
        raise ValueError(f"{fn}: n_local must be an int >= 0 (the shard's length), got {n_local!r}")
    ids = chunk_ids(layout, rank, world)
    if n_local % len(ids):
        raise ValueError(f"{fn}: the {layout} layout needs an even shard length, got {n_local}")
    c = n_local // len(ids)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def _normalize_dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor with {x.dim()} dims")
    return dim % x.dim()


def take_shard(x: Tensor, layout: str, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (a new contiguous tensor; ``x.shape[dim]`` divisible by the
    layout's number of chunks); :func:`shard` without a process group."""
    rank, world = check_rank(rank, world, "take_shard")
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


# --- packed batches ----------------------------------------------------------------------------------------------

PACKED_LAYOUTS = ("balanced", "contiguous")
BALANCE = 0.01  # the balanced layout cuts documents until no rank has more than 1% above the mean causal work


def check_packed_layout(layout: str, fn: str, rows_hint: bool = False) -> str:
    """``layout`` if it is a packed batch's layout, else ``ValueError`` naming ``fn`` and the layouts;
    ``rows_hint``: where ``layout`` is ``"zigzag"``, say how to cut a packed batch's rows in it (:func:`shard` and
    :func:`unshard`: Ulysses takes such shards)."""
    if not isinstance(layout, str) or layout not in PACKED_LAYOUTS:
        hint = (" (ulysses_attention's zigzag shards of a packed batch are its rows cut as a sequence's: pass no "
                "cu_seqlens here, e.g. shard(x, layout='zigzag', dim=0))" if rows_hint and layout == "zigzag" else "")
        raise ValueError(f"{fn}: a packed batch (cu_seqlens) takes layout {PACKED_LAYOUTS[0]!r} or "
                         f"{PACKED_LAYOUTS[1]!r}, got {layout!r}{hint}")
    return layout


def packed_boundaries(cu_seqlens, world: int, fn: str, total: Optional[int] = None) -> Tuple[int, ...]:
    """The boundaries of a packed batch, ``cu_seqlens`` checked (a 1-D int32/int64 tensor starting at 0,
    non-decreasing, ending at ``total`` when given) and its length divisible by ``world``, the number of ranks."""
    if total is None:  # the batch's length is cu_seqlens' last value (check_cu_seqlens names what else is wrong)
        ok = isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 0
        total = int(cu_seqlens[-1]) if ok and not cu_seqlens.dtype.is_floating_point else 0
    cu = V.check_cu_seqlens(cu_seqlens, total, "cu_seqlens", fn)
    if total % world:
        raise ValueError(f"{fn}: a packed batch split over {world} ranks needs a length divisible by {world}, got "
                         f"{total} rows (append a padding document)")
    return tuple(cu)


@functools.lru_cache(maxsize=16)
def zigzag_bounds(cu: Tuple[int, ...], world: int) -> Tensor:
    """Where documents with boundaries ``cu`` are cut in ``2P`` chunks, rank ``i`` taking chunks ``i`` and
    ``2P - 1 - i`` (the balanced layout's cut documents): ``(batch, 2P + 1)`` int64 (CPU, cached: read only), the
    chunks' boundaries counted from the document's first row.

    A document of ``L`` rows has chunks of ``L // 2P`` rows. Its ``L % 2P`` spare rows go one each to the ranks in
    turn, the turn running on from one document to the next (the first spare row to rank 0); a rank's first spare
    row of a document lengthens its first chunk (``i``), its second one its second chunk (``2P - 1 - i``). So the
    ranks' rows differ by at most one, any length is cut without padding, and a chunk may be empty.
    """
    lengths = torch.tensor(cu, dtype=torch.int64).diff()
    base, spare = lengths[:, None] // (2 * world), lengths[:, None] % (2 * world)
    before = torch.cumsum(spare, 0) - spare  # spare rows handed out before each document
    first = (torch.arange(world) - before) % world  # the first of its spare rows each rank gets (if there are as many)
    got = torch.where(spare > first, 1 + (spare - 1 - first) // world, 0)  # 0, 1 or 2 spare rows per rank
    sizes = torch.cat([base + (got >= 1), (base + (got >= 2)).flip(1)], dim=1)  # chunk 2P-1-i is rank i's second
    return torch.cat([torch.zeros_like(lengths)[:, None], sizes.cumsum(1)], dim=1)


def causal_pairs(offset: int, rows: int) -> int:
    """The query-key pairs of rows ``[offset, offset + rows)`` of a document under a causal mask."""
    return rows * offset + rows * (rows + 1) // 2


class Balanced(NamedTuple):
    """The balanced layout of a packed batch: per rank, ``whole`` the documents it holds whole (batch order) and
    ``parts`` its ``(document, first global row, rows)`` runs of the documents cut across ranks (by first row);
    ``cut``: how many of the longest documents were cut in ``2P`` chunks; ``work``: each rank's causal pairs."""

    whole: Tuple[Tuple[int, ...], ...]
    parts: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    cut: int
    work: Tuple[int, ...]


def _assign(cu: Tuple[int, ...], longest_first: List[int], cut: int, world: int) -> Balanced:
    """The ``cut`` longest documents in ``2P`` chunks (:func:`zigzag_bounds`), then the others whole, longest
    first, each to the rank with the least work among those with room for it; a document no rank has room for fills
    the ranks with the most room, in position order."""
    n = cu[-1] // world
    rows, work = [0] * world, [0] * world
    whole: List[List[int]] = [[] for _ in range(world)]
    parts: List[List[Tuple[int, int, int]]] = [[] for _ in range(world)]
    zigzag = sorted(longest_first[:cut])
    lengths = [cu[d + 1] - cu[d] for d in zigzag]
    bounds = zigzag_bounds(tuple(itertools.accumulate(lengths, initial=0)), world).tolist()
    for d, b in zip(zigzag, bounds):
        for r in range(world):
            for c in (r, 2 * world - 1 - r):
                if b[c + 1] > b[c]:
                    parts[r].append((d, cu[d] + b[c], b[c + 1] - b[c]))
                    rows[r] += b[c + 1] - b[c]
                    work[r] += causal_pairs(b[c], b[c + 1] - b[c])
    for d in longest_first[cut:]:
        length = cu[d + 1] - cu[d]
        room = [r for r in range(world) if n - rows[r] >= length]
        if room:
            r = min(room, key=lambda r: (work[r], r))
            whole[r].append(d)
            rows[r] += length
            work[r] += causal_pairs(0, length)
            continue
        done = 0
        for r in sorted(range(world), key=lambda r: (rows[r], r)):  # the most room first
            take = min(n - rows[r], length - done)
            if take > 0:
                parts[r].append((d, cu[d] + done, take))
                rows[r] += take
                work[r] += causal_pairs(done, take)
                done += take
    return Balanced(tuple(tuple(sorted(w)) for w in whole), tuple(tuple(sorted(p, key=lambda x: x[1])) for p in parts),
                    cut, tuple(work))


@functools.lru_cache(maxsize=16)
def balanced_layout(cu: Tuple[int, ...], world: int) -> Balanced:
    """The balanced layout of a packed batch with boundaries ``cu`` over ``world`` ranks (cached).

    Documents are kept whole where that balances the work: the longest ones are cut in ``2P`` chunks, rank ``i``
    taking chunks ``i`` and ``2P - 1 - i`` (which gives every rank the same causal work on them, whatever their
    lengths: :func:`zigzag_bounds`), the others go whole, longest first, to the rank with the least causal work
    among those with room for them, and one that no rank has room for is cut in runs filling the ranks with the most
    room. The number of documents cut in chunks is the least of 0, 1, 2, 4, 8, ... (or all) that leaves no rank
    more than ``BALANCE`` (1%) above the mean causal work (if none does, as when the documents are a few rows long,
    the one of these with the least work on its busiest rank). Every rank holds ``total / P`` rows: its whole
    documents (batch order), then its runs of the cut ones (position order).
    """
    longest_first = sorted((d for d in range(len(cu) - 1) if cu[d + 1] > cu[d]), key=lambda d: (cu[d] - cu[d + 1], d))
    best, cut = None, 0
    while True:
        layout = _assign(cu, longest_first, cut, world)
        if best is None or max(layout.work) < max(best.work):
            best = layout
        if cut == len(longest_first) or max(layout.work) * world <= (1 + BALANCE) * sum(layout.work):
            return best
        cut = min(len(longest_first), max(1, 2 * cut))


def row_ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """The rows ``starts[t] + [0, lengths[t])`` for every ``t`` (1-D int64), one range after the other."""
    ends = torch.cumsum(lengths, 0)
    total = int(ends[-1]) if len(ends) else 0
    return torch.repeat_interleave(starts - (ends - lengths), lengths, output_size=total) + torch.arange(total)


def packed_runs(cu: Tuple[int, ...], layout: str, rank: int, world: int) -> List[Tuple[int, int]]:
    """The runs of one document's consecutive rows that make up rank ``rank``'s shard of a packed batch, in its
    order: ``(first global row, rows)``."""
    if layout == "contiguous":
        n = cu[-1] // world
        lo, hi = rank * n, (rank + 1) * n
        return [(max(a, lo), min(b, hi) - max(a, lo)) for a, b in zip(cu, cu[1:]) if min(b, hi) > max(a, lo)]
    mine = balanced_layout(cu, world)
    return [(cu[d], cu[d + 1] - cu[d]) for d in mine.whole[rank]] + [(g, m) for _, g, m in mine.parts[rank]]


def packed_rows(cu: Tuple[int, ...], layout: str, rank: int, world: int) -> Tensor:
    """The global rows (int64, CPU) that rank ``rank`` holds of a packed batch with boundaries ``cu``, in order."""
    if layout == "contiguous":
        n = cu[-1] // world
        return torch.arange(rank * n, (rank + 1) * n)
    runs = torch.tensor(packed_runs(cu, layout, rank, world), dtype=torch.int64).reshape(-1, 2)
    return row_ranges(runs[:, 0], runs[:, 1])


@functools.lru_cache(maxsize=16)
def packed_order(cu: Tuple[int, ...], layout: str, world: int) -> Tensor:
    """Where each global row of a packed batch is in the ranks' shards laid end to end, rank 0's first (int64, CPU,
    cached: read only): the inverse of :func:`packed_rows` concatenated over the ranks."""
    rows = torch.cat([packed_rows(cu, layout, r, world) for r in range(world)])
    where = torch.empty_like(rows)
    where[rows] = torch.arange(len(rows))
    return where


def local_cu_seqlens(cu_seqlens: Tensor, layout: str, rank: int, world: int) -> Tensor:
    """The boundaries of the runs of one document's consecutive rows that make up rank ``rank``'s shard of a packed
    batch (``shard(x, layout=layout, cu_seqlens=cu_seqlens)``): int32 ``(runs + 1,)`` on ``cu_seqlens``' device, run
    ``j`` being rows ``[out[j], out[j + 1])`` of the shard; a local ``cu_seqlens`` for per-document operations on
    the shard.

    ``cu_seqlens`` is the whole batch's (``(batch + 1,)``, its length divisible by ``world``). Contiguous layout: the
    documents' parts inside the shard, in order. Balanced layout: the documents the rank holds whole, in the batch's
    order, then its runs of the documents cut across ranks (a document cut in ``2P`` chunks gives each rank two runs,
    chunks ``rank`` and ``2P - 1 - rank``).
    """
    fn = "local_cu_seqlens"
    layout = check_packed_layout(layout, fn)
    rank, world = check_rank(rank, world, fn)
    runs = packed_runs(packed_boundaries(cu_seqlens, world, fn), layout, rank, world)
    bounds = list(itertools.accumulate((m for _, m in runs), initial=0))
    return torch.tensor(bounds, dtype=torch.int32, device=cu_seqlens.device)


def default_layout(layout: Optional[str], packed: bool) -> str:
    """``layout``, or when None the default of :func:`shard`, :func:`unshard` and
    :func:`~longattn.distributed.ring_attention`: ``"contiguous"`` for a packed batch, else ``"zigzag"``."""
    if layout is None:
        return "contiguous" if packed else "zigzag"
    return layout


# The layout each tensor shard() returned over more than one rank was cut in (weak keys): "zigzag", "contiguous" (also
# a packed batch's contiguous rows: the same cut) or "balanced". The functions read their shards in one layout (their
# ``layout`` argument, or the cut they take) and refuse by name the very tensors shard() cut in another, where the data
# alone could not tell the cuts apart (:func:`cut_error`). A tensor computed from a shard (a projection, a view) is not
# recorded.
_SHARD_LAYOUTS = WeakTensorKeyDictionary()


def shard_layout(t) -> Optional[str]:
    """The layout :func:`shard` cut ``t`` in, where ``t`` is a tensor it returned over more than one rank; else None
    (also while tracing, where nothing is looked up)."""
    if not isinstance(t, Tensor) or torch.compiler.is_compiling():
        return None
    return _SHARD_LAYOUTS.get(t)


def cut_error(fn: str, tensors: Mapping[str, Any], layout: str, given: Optional[str]) -> Optional[str]:
    """The error of a call that reads its shards ``tensors`` (name to tensor) in ``layout`` (``given``: the
    ``layout`` argument, None for the default) where one of them is a tensor :func:`shard` cut in another layout (the
    result would be wrong, and the data cannot tell), else None. Callers ask only where the result depends on the
    order of the rows (causal, ALiBi, a packed batch's documents, dilated segments)."""
    for name, t in tensors.items():
        cut = shard_layout(t)
        if cut is not None and cut != layout:
            said = "layout=None, the default" if given is None else f"layout={given!r}"
            return (f"{fn}: {name} is a tensor shard() cut in the {cut!r} layout, but this call reads its shards in "
                    f"the {layout!r} layout ({said}); read in another layout than they were cut in, the result would "
                    f"be wrong: pass layout={cut!r}, or shard the tensors with layout={layout!r}")
    return None


def shard(x: Tensor, group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None, dim: int = 1, *,
          cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """This rank's part of the full tensor ``x`` (every rank passes the same ``x``), along ``dim``.

    ``layout``: ``"zigzag"`` (the default) or ``"contiguous"``; ``x.shape[dim]`` must be divisible by ``2P``
    (zigzag) or ``P`` (contiguous). Returns a new contiguous tensor of length ``x.shape[dim] / P`` along ``dim``.
    Differentiable (it is slicing).

    ``cu_seqlens``: ``x`` is a packed batch along ``dim`` (e.g. ``(total, H, D)`` with ``dim=0``, or ``(1, total)``
    token ids with ``dim=1``) whose documents have these boundaries (``(batch + 1,)``, ending at ``total``, which
    ``P`` must divide); ``layout`` is then ``"contiguous"`` (the default, as ``ring_attention``'s for packed
    batches: the rows of the whole batch cut in ``P``, as without ``cu_seqlens``) or ``"balanced"``
    (:func:`balanced_layout`: documents kept whole where that balances the causal work, the longest cut in ``2P``
    chunks; any lengths, no padding), as ``ring_attention(..., cu_seqlens=cu_seqlens, layout="balanced")`` takes
    them. :func:`local_cu_seqlens` gives the documents' runs in the shard.

    The tensor returned over more than one rank is remembered with its layout: the attention functions refuse it
    where they would read it in another (:func:`cut_error`), which nothing in its data could tell.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"shard: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"shard: dim must be an int, got {dim!r}")
    try:
        dim = _normalize_dim(x, dim)
        world, rank = group_size_rank(group, "shard: group")
        n = x.shape[dim]
        layout = default_layout(layout, cu_seqlens is not None)
        if cu_seqlens is not None:
            layout = check_packed_layout(layout, "shard", rows_hint=True)
            cu = packed_boundaries(cu_seqlens, world, "shard", total=n)
        else:
            layout = check_layout(layout, "shard")
    except ValueError as e:  # the shared checks' messages, named for this function
        message = str(e) if str(e).startswith("shard") else f"shard: {e}"
        raise ValueError(message + _packed_dim_hint(message, dim)) from None
    if cu_seqlens is not None:
        if layout == "contiguous":
            part = take_shard(x, layout, rank, world, dim)
        else:
            part = x.index_select(dim, packed_rows(cu, layout, rank, world).to(x.device))
    else:
        parts = 2 * world if layout == "zigzag" else world
        if n % parts:
            raise ValueError(
                f"shard: the {layout} layout over {world} ranks needs the length along dim {dim} to be divisible by "
                f"{parts}, got {n}"
            )
        part = take_shard(x, layout, rank, world, dim)
    if world > 1 and not torch.compiler.is_compiling():
        _SHARD_LAYOUTS[part] = layout
    return part


def _packed_dim_hint(message: str, dim: int) -> str:
    """Where ``cu_seqlens`` did not end at ``x``'s length along ``dim``: which length that is (a packed
    ``(total, heads, head_dim)`` tensor is cut along ``dim=0``, not the default 1)."""
    if "must end at the packed length" not in message:
        return ""
    return f" (the packed length is x's size along dim={dim}; a packed (total, heads, head_dim) tensor needs dim=0)"


def unshard(x: Tensor, group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None, dim: int = 1, *,
            cu_seqlens: Optional[Tensor] = None, options=None) -> Tensor:
    """Gather every rank's shard ``x`` and return the full tensor in global order (on every rank).

    The inverse of :func:`shard`, with the same ``layout`` (default: ``"zigzag"``, for a packed batch
    ``"contiguous"``) and, for a packed batch, the same ``cu_seqlens``. All ranks must pass shards of the same shape
    and dtype, and the same ``layout``, ``dim`` and ``cu_seqlens`` values (checked; a mismatch, or bad input on any
    rank, raises ``ValueError`` on every rank; so does a tensor :func:`shard` returned, gathered in another layout than
    it was cut in). Not differentiable (the result carries no gradient). ``options``: a
    :class:`~longattn.distributed.ParallelOptions` (here its ``host_checks``: how the check exchanges), or None.
    """
    return gather_shards(x, group, layout, dim, cu_seqlens, options, "unshard")


def gather_shards(x: Tensor, group: Optional[dist.ProcessGroup], layout: Optional[str], dim: int,
                  cu_seqlens: Optional[Tensor], options, fn: str, group_name: str = "group",
                  also: Optional[Mapping[str, Any]] = None) -> Tensor:
    """:func:`unshard` for the public function ``fn``, which its errors name (``group_name``: what they call the
    group, as :func:`check_same_across_ranks`). ``also``: more options of the caller, compared across the ranks
    with these (name to value; an ``Exception`` value is that option's error on this rank)."""
    from longattn.distributed.options import check_options, host_checks_of

    world, _ = group_size_rank(group, f"{fn}: group")
    checked, local_error = {}, None
    given, layout = layout, default_layout(layout, cu_seqlens is not None)
    try:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_options(options, fn)
        d = _normalize_dim(x, dim)
        cu = None
        if cu_seqlens is not None:
            layout = check_packed_layout(layout, fn, rows_hint=True)
            cu = packed_boundaries(cu_seqlens, world, fn, total=world * x.shape[d])
        elif check_layout(layout, fn) == "zigzag" and x.shape[d] % 2:
            raise ValueError(f"the zigzag layout needs an even shard length along dim {d}, got {x.shape[d]}")
        miscut = cut_error(fn, {"x": x}, layout, given)  # (shard()'s own part, gathered in another layout)
        if miscut:
            raise ValueError(miscut)
        checked = {"layout": layout, "dim": Resolved(d, dim), "cu_seqlens": cu}
        for name, value in (also or {}).items():
            if isinstance(value, Exception):
                raise value
            checked[name] = value
    except (TypeError, ValueError) as e:
        local_error = str(e) if str(e).startswith(f"{fn}: ") else f"{fn}: {e}"  # (cu_seqlens' checks name it)
        local_error += _packed_dim_hint(local_error, dim)
    check_same_across_ranks(group, {"x": x}, fn=fn, options=checked, local_error=local_error, group_name=group_name,
                            host_checks=host_checks_of(options), differentiable=False)  # (the result: no gradient)
    dim, cu = checked["dim"].value, checked["cu_seqlens"]
    if world == 1:
        return x.detach().clone()
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    if cu is not None and layout == "balanced":
        return torch.cat(parts, dim=dim).index_select(dim, packed_order(cu, layout, world).to(x.device))
    return join_shards(parts, "contiguous" if cu is not None else layout, dim)


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


def _backward_fact(inputs: Sequence[Any]) -> Fact:
    """Whether this rank's call will have a backward (grad mode on and one of ``inputs`` requiring gradients): the
    backward's collectives run only where it does, so ranks that differ would leave some waiting in them."""
    runs = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs)
    return ("whether the call has a backward (grad mode on and an input requiring gradients)", runs, runs)


def _collective_backward_fact(inputs: Mapping[str, Any]) -> Fact:
    """Whether this rank's backward will run the call's collectives: grad mode on and one of ``inputs`` (name to
    tensor) requiring gradients, where those are fewer than the call's differentiable inputs (the ring's: not its
    sinks, whose gradient is local; the packed contiguous ring's: its keys and values, whose fetched rows' gradients
    travel back). A rank whose call has a backward without them would skip the collectives its peers wait in."""
    runs = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs.values())
    what = (f"whether the call's backward runs collectives (grad mode on and one of {', '.join(inputs)} requiring "
            "gradients)")
    return (what, runs, runs)


def _digest(facts: List[Fact]) -> int:
    """A 64-bit fingerprint of the compared values (``repr`` is exact and the same in every process)."""
    text = repr([(what, value) for what, value, _ in facts]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


# Fingerprints of the compared values already computed (:func:`_fingerprint`), by their exact key: bounded, cleared
# when full (a model's calls repeat a handful of signatures).
_FINGERPRINTS: Dict[tuple, int] = {}
_FINGERPRINTS_MAX = 256
_SCALARS = frozenset((str, bool, int, type(None), torch.dtype))


def _exact_key(facts: List[Fact]) -> Optional[tuple]:
    """A hashable key of the compared values, equal for two lists of facts only where their ``repr`` is (each
    value's type in it: ``1``, ``1.0`` and ``True`` differ; ``0.0`` and ``-0.0`` too), or None where a value is of a
    kind this cannot key cheaply and exactly (NaN, sequences of anything but ints, anything else): its fingerprint
    is then computed as always."""
    key = []
    for what, value, _ in facts:
        kind = type(value)
        if kind in _SCALARS:
            key.append((what, kind, value))
        elif kind is float and value == value:  # (a zero by its sign: 0.0 and -0.0 are equal, their reprs not)
            key.append((what, kind, value if value else value.hex()))
        elif kind in (tuple, list) and all(type(x) is int for x in value):
            key.append((what, kind, tuple(value)))
        else:
            return None
    return tuple(key)


def _fingerprint(facts: List[Fact]) -> int:
    """:func:`_digest` of ``facts``, kept per signature (:func:`_exact_key`) where it has one: a repeated call's
    values are not written out and hashed again."""
    key = _exact_key(facts)
    if key is None:
        return _digest(facts)
    found = _FINGERPRINTS.get(key)
    if found is None:
        if len(_FINGERPRINTS) >= _FINGERPRINTS_MAX:
            _FINGERPRINTS.clear()
        found = _FINGERPRINTS[key] = _digest(facts)
    return found


# Every host agreement of the distributed calls is one fixed-size record: its purpose, the count of its values, the
# values. Two ranks in different agreements (one left a call that raised half-way, its peers went on) then exchange
# records of the same size, and each sees which agreement the others are in, instead of the collective library
# failing on a size mismatch (gloo ends the process) or the ranks pairing unrelated numbers.
PURPOSES = {
    "check": "checking a new call's shapes and options",
    "start": "starting a copy-engine call's transfers",
    "grow": "growing the copy-engine workspace",
    "release": "releasing its copy-engine transfers (copy_engine.release)",
    "map": "mapping its peers' copy-engine workspace (after the rendezvous)",
}
RECORD_VALUES = 4


class OutOfStep(RuntimeError):
    """The ranks of a group are in different agreements: some rank left a call that raised after it started while
    its peers went on. ``purposes``: each rank's purpose (a key of :data:`PURPOSES`), in rank order."""

    def __init__(self, message: str, purposes: List[str]):
        super().__init__(message)
        self.purposes = purposes


def _record(purpose: str, values: Sequence[int]) -> List[int]:
    if purpose not in PURPOSES or len(values) > RECORD_VALUES:
        raise ValueError(f"gather_ints: purpose {purpose!r} and at most {RECORD_VALUES} values, got {len(values)}")
    code = list(PURPOSES).index(purpose)
    return [code, len(values), *values] + [0] * (RECORD_VALUES - len(values))


def read_records(records: Sequence[Sequence[int]], purpose: str, group_label: str = "the group") -> List[tuple]:
    """Every rank's values from the gathered :func:`_record` rows; :class:`OutOfStep` (naming each rank's
    agreement) where some rank is in another agreement than ``purpose``."""
    names = list(PURPOSES)
    purposes = [names[r[0]] if 0 <= r[0] < len(names) else f"unknown ({r[0]})" for r in records]
    if any(p != purpose for p in purposes):
        where = "; ".join(f"rank {r} is {PURPOSES.get(p, p)}" for r, p in enumerate(purposes))
        raise OutOfStep(
            f"the ranks of {group_label} are out of step: {where}. A call raised on some rank after it started while "
            "its peers went on (their results of that call are NaN where they used its transfers). Call "
            "longattn.distributed.copy_engine.release(group) on every rank (release(\"all\") where several groups "
            "use the copy engines; it brings the ranks back into step), or restart the processes", purposes)
    return [tuple(r[2:2 + r[1]]) for r in records]


class Agreement:
    """A host agreement under way (:func:`start_gather_ints`): :meth:`done` says, without waiting, whether every
    rank's record is in; :meth:`result` waits for them and reads them as :func:`gather_ints` does."""

    def __init__(self, work, every: List[Tensor], purpose: str, label: str):
        self.work, self.every, self.purpose, self.label = work, every, purpose, label

    def done(self) -> bool:
        return self.work.is_completed()

    def result(self) -> List[tuple]:
        self.work.wait()
        return read_records([e.tolist() for e in self.every], self.purpose, self.label)


def start_gather_ints(group: Optional[dist.ProcessGroup], world: int, values: Sequence[int],
                      host_checks: bool = True, purpose: str = "check", label: str = "the group") -> Agreement:
    """:func:`gather_ints` issued without waiting for it (so that a rank may be in the agreements of several groups
    at once: ``copy_engine.release``)."""
    host = host_group(group, host_checks)
    mine = torch.tensor(_record(purpose, values), dtype=torch.int64,
                        device="cpu" if host is not None else collective_device(group))
    every = [torch.empty_like(mine) for _ in range(world)]
    if host is not None:
        work = host.allgather([every], [mine])
    else:
        work = dist.all_gather(every, mine, group=group, async_op=True)
    return Agreement(work, every, purpose, label)


def gather_ints(group: Optional[dist.ProcessGroup], world: int, values: Sequence[int],
                host_checks: bool = True, purpose: str = "check", label: str = "the group") -> List[tuple]:
    """Every rank's ``values`` (at most :data:`RECORD_VALUES` int64s), in rank order: on the group's gloo twin
    where there is one and ``host_checks`` (:func:`host_group`: the GPU queue keeps running), else on the group
    itself. Collective. ``purpose`` (a key of :data:`PURPOSES`) names the agreement: where another rank is in
    another one, every rank involved raises :class:`OutOfStep` naming them (``label``: the group, for it)."""
    return start_gather_ints(group, world, values, host_checks, purpose, label).result()


# Whether each group's cross-rank checks exchange on its gloo twin (host_group): group name -> (the group, the
# value), agreed by the group's members on their first check (_agreed_host_checks).
_CHECK_CHANNELS: Dict[str, Tuple[object, bool]] = {}


def _agreed_host_checks(group: Optional[dist.ProcessGroup], host_checks: bool, world: int, where: str,
                        failed: bool = False) -> bool:
    """Where the checks of ``group`` exchange (:func:`gather_ints`' ``host_checks``), the same on every member
    whatever each passes: on the group's first check (an NCCL group: on the CPU's gloo groups the twin is never
    used), its members gather their ``ParallelOptions.host_checks`` on the group itself, once, and where they differ
    every rank raises ``ValueError`` naming them (ranks exchanging on different groups would wait for each other: a
    hang); later checks keep the agreed channel, and :func:`check_same_across_ranks` compares ``host_checks`` with
    the call's other options, moving the group to a new value only once every rank passes it. ``failed``: this
    rank has an input error of its own (its ``host_checks`` may be the default, standing in for options it could
    not read): where the values differ and some rank failed, this check exchanges on the group itself, nothing is
    kept, and the ranks' own errors are reported."""
    if collective_device(group).type == "cpu":
        return host_checks
    return _agree_host_checks(group, host_checks, world, where, failed)


def _agree_host_checks(group: Optional[dist.ProcessGroup], host_checks: bool, world: int, where: str,
                       failed: bool = False) -> bool:
    """:func:`_agreed_host_checks` on any group (the gather on the group's own device)."""
    key, name = _group_key(group)
    entry = _CHECK_CHANNELS.get(name)
    if entry is None or entry[0] is not key:
        mine = torch.tensor([int(host_checks), int(failed)], dtype=torch.int64, device=collective_device(group))
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        rows = torch.stack(every).tolist()
        flags = [bool(r[0]) for r in rows]
        if len(set(flags)) > 1 and any(r[1] for r in rows):
            return False  # (every rank: the group itself, this once; the input errors are what they report)
        if len(set(flags)) > 1:
            ranks = [global_rank(group, r) for r in range(world)]
            by_value = {v: [ranks[r] for r, f in enumerate(flags) if f == v] for v in (True, False)}
            said = [f"{_rank_list(rs)} {'passes' if len(rs) == 1 else 'pass'} {v}" for v, rs in by_value.items()]
            raise ValueError(f"option options.host_checks differs across ranks{where}: {', '.join(said)} "
                             "(ParallelOptions.host_checks picks where the ranks compare their calls: it must be the "
                             "same on every rank)")
        entry = _CHECK_CHANNELS[name] = (key, flags[0])
    return entry[1]


def _keep_host_checks(group: Optional[dist.ProcessGroup], host_checks: bool) -> None:
    """After a check every rank agreed on (``host_checks`` among its options): the group's channel from now on."""
    key, name = _group_key(group)
    entry = _CHECK_CHANNELS.get(name)
    if entry is not None and entry[0] is key and entry[1] != host_checks:
        _CHECK_CHANNELS[name] = (key, host_checks)


def check_same_across_ranks(
    group: Optional[dist.ProcessGroup], tensors: Mapping[str, Tensor], *, fn: str,
    options: Optional[Mapping[str, Any]] = None, local_error: Optional[str] = None, group_name: str = "group",
    host_checks: bool = True, grad_inputs: Sequence[Any] = (), differentiable: bool = True,
    collective_grads: Optional[Mapping[str, Any]] = None,
) -> None:
    """Raise ``ValueError`` on every rank unless no rank failed and all agree on the shapes and dtypes of
    ``tensors`` and on ``options`` (name to value, or :class:`Resolved`; values compared by ``repr``).

    Also compared: whether the call will have a backward (grad mode on and an input requiring gradients: one of
    ``tensors``, or of ``grad_inputs``, the call's other differentiable inputs such as the sinks), since only ranks
    whose call has one run the backward's collectives. ``differentiable`` False: the call has no backward (its
    result carries no gradient, as :func:`unshard`'s), and nothing of it is compared. ``collective_grads`` (name to
    input): where only some inputs' gradients make the backward run collectives, whether one of those requires
    gradients is compared too (a rank whose backward runs without them would leave its peers waiting).

    ``local_error`` is this rank's own validation error (or None); it is shared so that an input error on one rank
    is raised on all ranks instead of leaving the others waiting in a collective. A call adds its options to the
    dict it passes; nothing else changes. Cost: one all-gather of two integers (a failure flag and a fingerprint
    of the rest), on the host where it can (:func:`host_group`: the GPU keeps running what is queued); only when
    some rank failed or the fingerprints differ, an ``all_gather_object`` of the values (every rank takes the same
    path: they all see the same gathered integers) to name what differs.

    Errors name ranks by their global rank; for a group other than the world they also say which group, as
    ``"the <group_name> of global ranks [2, 3]"`` (``group_name``: e.g. ``"Ulysses group"``). ``host_checks``:
    ``ParallelOptions.host_checks`` (:func:`gather_ints`), compared as ``options.host_checks``; the exchange runs
    where the group's members agreed on their first check (:func:`_agreed_host_checks`), so that ranks passing
    different values get this error rather than a hang.

    It runs on every call: a rank that skipped it on a cache of its own would turn a mismatch on a later call into a
    hang (the ranks cannot agree to skip without communicating). The fingerprint of a call's values is kept per
    signature (:func:`_fingerprint`), so a repeated call costs the all-gather and a dictionary look-up.
    Under :func:`longattn.explain` it raises before any communication (collective calls are not planned).
    """
    runner.refuse_planning(fn)
    world, rank = group_size_rank(group)
    if world == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    ranks = [global_rank(group, r) for r in range(world)]
    where = _group_words(group, ranks, group_name)
    channel = _agreed_host_checks(group, host_checks, world, where, local_error is not None)
    facts = []
    if local_error is None:
        facts = [("the function called", fn, fn)] + _facts(tensors, {**(options or {}),
                                                                     "options.host_checks": host_checks})
        if differentiable:
            facts.append(_backward_fact(list(tensors.values()) + list(grad_inputs)))
        if differentiable and collective_grads is not None:
            facts.append(_collective_backward_fact(collective_grads))
    summary = gather_ints(group, world, (int(local_error is not None), _fingerprint(facts)), channel)
    if all(s == (0, summary[0][1]) for s in summary):
        _keep_host_checks(group, host_checks)
        return
    described: List[Optional[Tuple[Optional[str], List[Fact]]]] = [None] * world
    dist.all_gather_object(described, (local_error, facts), group=group)
    failed = [(ranks[r], err) for r, (err, _) in enumerate(described) if err is not None]
    if failed:
        by_error: Dict[str, List[int]] = {}
        for r, err in failed:  # the same error on several ranks once, with its ranks ("ranks 0-3: ...")
            by_error.setdefault(err, []).append(r)
        detail = "; ".join(f"{_rank_list(rs)}: {err}" for err, rs in by_error.items())
        raise ValueError(f"{fn}: invalid input on {len(failed)} rank(s){where}: {detail}")
    raise ValueError(
        f"{fn}: all ranks{where} must pass shards of the same shape and dtype and the same options; "
        + "; ".join(differences([f for _, f in described], ranks) or ["their descriptions differ"])
    )


def _group_words(group: Optional[dist.ProcessGroup], ranks: List[int], group_name: str) -> str:
    """``""`` for the world (whose ranks are the global ones), else ``" of the <group_name> of global ranks [...]"``."""
    if ranks == list(range(dist.get_world_size())):
        return ""
    return f" of the {group_name} of global ranks {ranks}"


def differences(per_rank: Sequence[Sequence[Fact]], ranks: Optional[Sequence[int]] = None) -> List[str]:
    """``"<what> differs across ranks: rank 0 has A, ranks 1-3 have B"`` for every fact on which ranks differ;
    entry ``i`` of ``per_rank`` is rank ``ranks[i]``'s (the global rank; by default ``i``)."""
    names = list(range(len(per_rank))) if ranks is None else list(ranks)
    tables = {r: {what: (value, given) for what, value, given in facts} for r, facts in zip(names, per_rank)}
    lines = []
    for what in dict.fromkeys(what for facts in per_rank for what, _, _ in facts):
        groups: Dict[str, List[int]] = {}
        for r, table in tables.items():
            groups.setdefault(repr(table[what][0]) if what in table else "<missing>", []).append(r)
        if len(groups) == 1:
            continue
        values = [tables[same[0]].get(what) for same in groups.values()]
        shown = [_show(v) for v in values]
        at = _first_difference([v[0] for v in values if v is not None])
        parts = [f"{_rank_list(same)} {'has' if len(same) == 1 else 'have'} {text}"
                 for same, text in zip(groups.values(), shown)]
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
