"""Ulysses' two all-to-alls (sequence shards -> whole sequences of some heads, and back), by NCCL or copy engines.

A *route* carries one call of :class:`longattn.distributed.ulysses._Ulysses`, in head groups:

- inbound, group ``c``: each :class:`Part` ``x`` (this rank's shard, ``(B, n, H, D)``, or ``(B, H, n)`` for
  per-head rows such as a log-sum-exp gradient) gives every rank ``p`` the whole sequence of its share of the
  group's heads: :meth:`inputs` returns ``(B, N, w, D)`` (or ``(B, w, N)``);
- outbound: :meth:`give` sends group ``c``'s part of output ``j`` (``(B, N, w, D)`` or ``(B, w, N)``, the heads
  this rank computed) to the ranks owning its rows; :meth:`finish` returns every output's shard ``(B, n, H, D)``
  (or ``(B, H, n)``), head ``p * (groups * w) + c * w + i`` from rank ``p``'s group ``c``.

Rank ``p`` takes heads ``[p H / P, (p + 1) H / P)`` of every part, cut into ``groups`` groups of ``w`` heads.
:class:`NcclRoute` issues NCCL all-to-alls (any backend, any placement of the ranks; the default, also for
``"auto"``); :class:`CopyRoute`, on explicit request (``ParallelOptions(transport="copy_engine")``, decided by
:func:`longattn.distributed.transport.choose`), writes straight into the peers' memory on the copy engines
(:mod:`longattn.distributed.copy_engine`: NCCL, one host), leaving every SM to the attention kernels it overlaps.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.distributed import copy_engine, transport
from longattn.distributed.copy_engine import SLOTS, align, as_rows, nbytes
from longattn.distributed.shards import chunk_ids, global_rank


class Plan(NamedTuple):
    """Where the rows of the sequence live: rank ``p`` holds ``len(slots[p])`` pieces of ``piece`` rows, its
    ``e``-th piece at natural row ``slots[p][e]`` (one piece for the contiguous layout, two for zigzag)."""

    group: object
    world: int
    rank: int
    rows: int  # per rank
    piece: int
    slots: Tuple[Tuple[int, ...], ...]

    @staticmethod
    def of(layout: str, group, world: int, rank: int, rows: int) -> "Plan":
        ids = [chunk_ids(layout, r, world) for r in range(world)]
        piece = rows // len(ids[0])
        return Plan(group, world, rank, rows, piece, tuple(tuple(c * piece for c in i) for i in ids))


class Part(NamedTuple):
    """Group ``group`` (of ``groups``) of ``x``'s heads, inbound: ``x`` is ``(B, n, H, D)``, or ``(B, H, n)`` when
    ``per_head``."""

    x: Tensor
    group: int
    groups: int
    per_head: bool = False

    def width(self, world: int) -> int:
        return self.x.shape[1 if self.per_head else 2] // (world * self.groups)


class Out(NamedTuple):
    """Output ``j`` of a call: ``heads`` heads over the group in ``groups`` groups, shard ``(B, n, heads, dim)``
    or, when ``per_head``, ``(B, heads, n)``."""

    groups: int
    heads: int
    dim: int
    dtype: torch.dtype
    per_head: bool = False


def route_flags(groups: int, outbound: Sequence[Out]) -> int:
    """The flag slots of a copy-engine call of ``groups`` inbound head groups and these outputs (one per rank):
    "free", one per inbound group, one per output group given (:meth:`CopyRoute.give`)."""
    return 1 + groups + sum(spec.groups for spec in outbound)


def open_route(plan: Plan, inbound: Sequence[Sequence[Part]], outbound: Sequence[Out], *, fresh: bool,
               options, reserve: int = 0, then: Sequence[Out] = ()):
    """The route of one call: NCCL, or copy engines where ``options.transport`` is ``"copy_engine"``
    (:func:`longattn.distributed.transport.choose`, which raises where they cannot run; the same answer on every
    rank; ``"auto"`` picks NCCL). ``options``: the call's :class:`~longattn.distributed.ParallelOptions`.
    ``fresh``: the inputs are kept beyond the call (saved for a backward), so they may not live in a reused
    workspace. ``reserve``: copy-engine workspace bytes to hold from now on at least (the backward's,
    :func:`workspace_bytes`, so that the workspace does not grow at peak activation memory). ``then``: the
    outputs of a call of as many head groups to come (the backward's): where its flags would not fit a link, this
    call is refused already, before it runs. A call that raises after the route opened must call its ``abort()``
    (the peers are released; see :meth:`longattn.distributed.copy_engine.Link.abort`)."""
    x = inbound[0][0].x
    groups = len(inbound)
    worst = max((outbound, then), key=lambda outs: route_flags(groups, outs))
    fits = route_flags(groups, worst) <= SLOTS
    scaled = sum(1 for spec in worst if spec.groups == groups)  # (the others' groups do not grow with head_chunks)
    most = (SLOTS - 1 - sum(spec.groups for spec in worst if spec.groups != groups)) // (1 + scaled)
    limit = (f"at most {most} head groups{' with a backward' if worst is then else ''}, got {groups} "
             "(ParallelOptions.head_chunks)")
    name, link = transport.choose(options, plan.group, plan.world, plan.rank, x.device, fn="ulysses", fits=fits,
                                  limit=limit)
    if name == "copy_engine":
        return CopyRoute(plan, link, inbound, outbound, fresh, reserve)
    return NcclRoute(plan, inbound, outbound)


# ---------------------------------------------------------------------------------------------------------------
# NCCL

_WITHOUT_ALL_TO_ALL: Set[str] = set()  # process-group backends seen to refuse all-to-all (gloo before PyTorch 2.13)


def _all_to_all(outs: List[Tensor], ins: List[Tensor], plan: Plan) -> list:
    """``dist.all_to_all(outs, ins)`` on the plan's group, asynchronous: its pending works. Where the group's
    backend has no all-to-all of tensor lists (gloo up to PyTorch 2.11 raises "Backend gloo does not support
    alltoall" on every rank, before any transfer; remembered per backend, so the refusal is met once), the same
    exchange by point-to-point sends and receives, this rank's own part copied."""
    backend = str(dist.get_backend(plan.group))
    if backend not in _WITHOUT_ALL_TO_ALL:
        try:
            return [dist.all_to_all(outs, ins, group=plan.group, async_op=True)]
        except RuntimeError as err:
            if "does not support alltoall" not in str(err):
                raise
            _WITHOUT_ALL_TO_ALL.add(backend)
    outs[plan.rank].copy_(ins[plan.rank])
    peers = [(p, global_rank(plan.group, p)) for p in range(plan.world) if p != plan.rank]
    ops = ([dist.P2POp(dist.irecv, outs[p], peer, plan.group) for p, peer in peers]
           + [dist.P2POp(dist.isend, ins[p], peer, plan.group) for p, peer in peers])
    return dist.batch_isend_irecv(ops) if ops else []


def _to_sequences(send: Tensor, plan: Plan) -> Tuple[Tensor, list]:
    """``send`` ``(P, n, B, S, D)`` (for each rank, this rank's rows of the heads it takes) -> the whole sequences
    of this rank's heads ``(N, B, S, D)`` in natural order, every rank's pieces received straight into their rows
    (no reordering copy); returns the buffer and the pending works (all-to-alls, one per piece of a shard)."""
    P, L = plan.world, plan.piece
    recv = send.new_empty((P * plan.rows,) + tuple(send.shape[2:]))
    works = []
    for e in range(len(plan.slots[0])):
        outs = [recv[plan.slots[p][e]:plan.slots[p][e] + L] for p in range(P)]
        works += _all_to_all(outs, [send[p, e * L:(e + 1) * L] for p in range(P)], plan)
    return recv, works


def _to_owners(x: Tensor, plan: Plan, stage: Tensor) -> list:
    """The whole sequences ``x`` ``(B, N, w, D)`` of this rank's heads -> every rank its rows: rank ``p``'s part
    lands in ``stage[p]`` ``(n, B, w, D)`` (rows in shard order). Sends views of ``x`` where they are contiguous
    (one batch row), a packed copy otherwise; returns the pending works."""
    P, L, B = plan.world, plan.piece, x.shape[0]
    if B == 1:
        x = x.contiguous()
    works = []
    for e in range(len(plan.slots[0])):
        if B == 1:
            ins = [x[0, plan.slots[p][e]:plan.slots[p][e] + L].unsqueeze(1) for p in range(P)]
        else:
            ins = [x[:, plan.slots[p][e]:plan.slots[p][e] + L].transpose(0, 1).contiguous() for p in range(P)]
        outs = [stage[p, e * L:(e + 1) * L] for p in range(P)]
        works += _all_to_all(outs, ins, plan)
    return works


def _pack(parts: Sequence[Tuple[Tensor, int, int]], world: int) -> Tensor:
    """Shards ``(B, n, H_x, D)`` with the head group each sends, ``(x, group, groups)`` -> the send buffer ``(P, n,
    B, S, D)``: for each rank ``p``, the group's share of ``p``'s heads of every tensor, side by side (``S`` their
    sum)."""
    B, n, _, D = parts[0][0].shape
    widths = [x.shape[2] // (world * groups) for x, _, groups in parts]
    send = parts[0][0].new_empty((world, n, B, sum(widths), D))
    start = 0
    for (x, group, groups), w in zip(parts, widths):
        send[:, :, :, start:start + w] = x.reshape(B, n, world, groups, w, D)[:, :, :, group].permute(2, 1, 0, 3, 4)
        start += w
    return send


def _unpack(stage: Tensor) -> Tensor:
    """Received parts ``(groups, P, n, B, w, D)`` -> the shard ``(B, n, P * groups * w, D)``: global head ``p h +
    c w + i`` (``h = groups * w`` heads per rank)."""
    C, P, n, B, w, D = stage.shape
    return stage.permute(3, 2, 1, 0, 4, 5).reshape(B, n, P * C * w, D)


def _wait(works) -> None:
    for w in works:
        w.wait()


class NcclRoute:
    """A call's all-to-alls by NCCL (``dist.all_to_all``, asynchronous; :func:`_all_to_all`): all inbound groups
    issued at once."""

    def __init__(self, plan: Plan, inbound: Sequence[Sequence[Part]], outbound: Sequence[Out]):
        self.plan, self.outbound = plan, outbound
        P = plan.world
        self.pending = []
        for parts in inbound:  # per group: the (B, n, H, D) parts in one all-to-all, each per-head part in its own
            rows = [p for p in parts if not p.per_head]
            got = []
            if rows:
                got.append((False, [p.width(P) for p in rows],
                            _to_sequences(_pack([(p.x, p.group, p.groups) for p in rows], P), plan)))
            for p in parts:
                if p.per_head:  # (B, H, n) as (B, n, H, 1)
                    x = p.x.transpose(1, 2).unsqueeze(-1)
                    got.append((True, [p.width(P)], _to_sequences(_pack([(x, p.group, p.groups)], P), plan)))
            self.pending.append(got)
        self.stages: List[Optional[Tensor]] = [None] * len(outbound)
        self.works: list = []

    def abort(self) -> None:
        """Nothing to release (NCCL's own watchdog follows its collectives)."""

    def inputs(self, c: int) -> List[Tensor]:
        out = []
        for per_head, widths, (buf, works) in self.pending[c]:
            _wait(works)
            start = 0
            for w in widths:  # (N, B, S, D) -> (B, N, w, D) views
                x = buf[:, :, start:start + w].transpose(0, 1)
                out.append(x.squeeze(-1).transpose(1, 2) if per_head else x)
                start += w
        self.pending[c] = None
        return out

    def give(self, j: int, c: int, y: Tensor) -> None:
        spec = self.outbound[j]
        if spec.per_head:
            y = y.transpose(1, 2).unsqueeze(-1)
        if self.stages[j] is None:
            self.stages[j] = y.new_empty((spec.groups, self.plan.world, self.plan.rows, y.shape[0], y.shape[2],
                                          y.shape[3]))
        self.works += _to_owners(y, self.plan, self.stages[j][c])

    def finish(self, also: Sequence[Tensor] = ()) -> List[Tensor]:
        _wait(self.works)
        outs = []
        for spec, stage in zip(self.outbound, self.stages):
            x = _unpack(stage)
            outs.append(x.squeeze(-1).transpose(1, 2) if spec.per_head else x)
        return outs


# ---------------------------------------------------------------------------------------------------------------
# copy engines

def _rows(x: Tensor) -> Tensor:
    """``(B, L, w, D)`` -> ``(B, L, w D)`` as a view (raises rather than copy; ``L`` or ``B`` may be 0)."""
    return x.view(x.shape[0], x.shape[1], x.shape[2] * x.shape[3])


class CopyRoute:
    """A call's transfers on the copy engines: every rank writes its rows straight into the peers' workspaces
    (:class:`longattn.distributed.copy_engine.Link`), flags tell the receivers, and the kernels read the
    workspace (or, with ``fresh``, copies of it made on the receiving stream while earlier groups compute)."""

    def __init__(self, plan: Plan, link, inbound: Sequence[Sequence[Part]], outbound: Sequence[Out], fresh: bool,
                 reserve: int = 0):
        self.plan, self.link, self.outbound = plan, link, outbound
        self.keep: List[Tensor] = []  # tensors the side streams read or write: alive until the streams are done
        self.in_regions, self.out_regions, total = _layout(plan, inbound, outbound)
        groups = len(inbound)
        self.first_out_slot = 1 + groups
        self.max_gives = SLOTS - self.first_out_slot
        dev, rt = inbound[0][0].x.device, link.rt

        def allocate():
            # inputs whose rows the copy engines can read: (B, n, H, D) with (H, D) dense, (B, H, n) with n dense;
            # everything the side streams write, allocated before they wait for this stream (begin), so that no
            # block freed by later work on this stream is reused under them
            dense = [[p._replace(x=_dense(p.x, p.per_head, rt)) for p in parts] for parts in inbound]
            kept = ([[rt.empty(s, d, dev) for _, s, d in regs] for regs in self.in_regions] if fresh else None)
            return dense, kept, [rt.empty(s, d, dev) for _, s, d in self.out_regions]

        # agreed by every rank (allocations, call counters) before any transfer; the workspace grown if needed
        self.inbound, self.fresh, self.outs = link.start(max(total, reserve), allocate)
        self.keep += [p.x for parts in self.inbound for p in parts]
        self.gives = 0
        self.local_done: list = []
        try:
            for c in range(groups):
                self._send_inputs(c)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """The call raised after it started: release the peers (:meth:`Link.abort`)."""
        try:
            self.link.abort()
        finally:  # (the side streams may still read them, after a peer's flag: not joined)
            self.link.rt.retire(self.keep, (self.link.send, self.link.local, self.link.recv), joined=False)
            self.keep = []

    def _peers(self):
        P, r = self.plan.world, self.plan.rank
        return [(r + i) % P for i in range(1, P)]

    def _send_inputs(self, c: int) -> None:
        """Group ``c``'s rows of every part to every rank: the peers' on the sending stream (then a flag to each),
        this rank's own on the local stream (then an event)."""
        plan, link = self.plan, self.link
        L, me = plan.piece, plan.rank
        for p in self._peers() + [me]:
            stream = link.send if p != me else link.local
            for part, (off, shape, dtype) in zip(self.inbound[c], self.in_regions[c]):
                w = part.width(plan.world)
                h0 = (p * part.groups + part.group) * w
                dst = link.region(p, off, shape, dtype)
                for e, slot in enumerate(plan.slots[me]):
                    if part.per_head:
                        link.copy(dst[:, :, slot:slot + L], part.x[:, h0:h0 + w, e * L:(e + 1) * L], stream)
                    else:
                        link.copy(_rows(dst[:, slot:slot + L]), _rows(part.x[:, e * L:(e + 1) * L, h0:h0 + w]),
                                  stream)
            if p != me:
                link.signal(p, 1 + c)
        self.local_done.append(link.local.record_event())

    def inputs(self, c: int) -> List[Tensor]:
        link = self.link
        for p in self._peers():
            link.await_(p, 1 + c, link.recv)
        link.recv.wait_event(self.local_done[c])
        got = [link.region(self.plan.rank, off, shape, dtype) for off, shape, dtype in self.in_regions[c]]
        if self.fresh is not None:
            for f, g in zip(self.fresh[c], got):
                link.copy(as_rows(f), as_rows(g), link.recv)
            got = self.fresh[c]
        link.current().wait_stream(link.recv)
        return got

    def give(self, j: int, c: int, y: Tensor) -> None:
        spec, (off, shape, dtype) = self.outbound[j], self.out_regions[j]
        if y.dtype != dtype:
            raise RuntimeError(f"ulysses: output {j} is {y.dtype}, its route was laid out for {dtype}")
        if self.gives >= self.max_gives:
            raise RuntimeError("ulysses: too many head groups for the copy-engine route's flags")
        y = _dense(y, spec.per_head, self.link.rt)
        self.keep.append(y)
        plan, link = self.plan, self.link
        L, me = plan.piece, plan.rank
        w = y.shape[1 if spec.per_head else 2]
        h0 = (me * spec.groups + c) * w
        current = link.current()
        link.send.wait_stream(current)
        link.local.wait_stream(current)
        for r in self._peers() + [me]:
            stream = link.send if r != me else link.local
            dst = link.region(r, off, shape, dtype)
            for e, slot in enumerate(plan.slots[r]):
                if spec.per_head:
                    link.copy(dst[:, h0:h0 + w, e * L:(e + 1) * L], y[:, :, slot:slot + L], stream)
                else:
                    link.copy(_rows(dst[:, e * L:(e + 1) * L, h0:h0 + w]), _rows(y[:, slot:slot + L]), stream)
            if r != me:
                link.signal(r, self.first_out_slot + self.gives)
        self.gives += 1

    def finish(self, also: Sequence[Tensor] = ()) -> List[Tensor]:
        link = self.link
        for k in range(self.gives):
            for p in self._peers():
                link.await_(p, self.first_out_slot + k, link.recv)
        link.recv.wait_stream(link.local)
        for out, (off, shape, dtype) in zip(self.outs, self.out_regions):
            link.copy(as_rows(out), as_rows(link.region(self.plan.rank, off, shape, dtype)), link.recv)
        link.end(list(self.outs) + list(also))  # (also: the call's other results, NaN where a peer aborted)
        link.rt.retire(self.keep, (link.send, link.local))
        self.keep = []
        return self.outs


def _dense(x: Tensor, per_head: bool, runtime=None) -> Tensor:
    """``x`` with rows the copy engines can read: ``(B, n, H, D)`` with dense ``(H, D)``, ``(B, H, n)`` with dense
    ``n``, rows apart (not expanded); else a copy with the standard strides (not ``.contiguous()``, which keeps any
    stride of a dimension of size 1: a length-1 shard of a transposed tensor would keep its odd ones)."""
    if per_head:  # rows: heads
        dense = x.stride(2) == 1 and x.stride(1) >= x.shape[2]
    else:  # rows: positions, each (H, D) dense
        dense = x.stride(3) == 1 and x.stride(2) == x.shape[3] and x.stride(1) >= x.shape[2] * x.shape[3]
    if dense:
        return x
    out = (runtime or copy_engine.RUNTIME).empty(x.shape, x.dtype, x.device)
    out.copy_(x)
    return out


def _layout(plan: Plan, inbound: Sequence[Sequence[Part]], outbound: Sequence[Out]):
    """Where a copy-engine call's traffic lies in the workspace: ``(per inbound group, per part: (byte offset,
    shape, dtype); per output: the same; total bytes)``. Only shapes and dtypes are read (meta tensors do)."""
    P, n = plan.world, plan.rows
    N, B = P * n, inbound[0][0].x.shape[0]
    offset, in_regions, out_regions = 0, [], []
    for parts in inbound:
        regs = []
        for p in parts:
            w = p.width(P)
            shape = (B, w, N) if p.per_head else (B, N, w, p.x.shape[3])
            regs.append((offset, shape, p.x.dtype))
            offset = align(offset + nbytes(shape, p.x.dtype))
        in_regions.append(regs)
    for spec in outbound:
        shape = (B, spec.heads, n) if spec.per_head else (B, n, spec.heads, spec.dim)
        out_regions.append((offset, shape, spec.dtype))
        offset = align(offset + nbytes(shape, spec.dtype))
    return in_regions, out_regions, offset


def workspace_bytes(plan: Plan, inbound: Sequence[Sequence[Part]], outbound: Sequence[Out]) -> int:
    """The copy-engine workspace a call of these parts (tensors of the right shapes and dtypes, e.g. on the meta
    device) and outputs uses."""
    return _layout(plan, inbound, outbound)[2]
