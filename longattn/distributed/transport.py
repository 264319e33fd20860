"""How a sequence-parallel call's blocks travel: the one decision between NCCL and the copy engines, and the ring's
transfers.

:func:`choose` turns :attr:`ParallelOptions.transport <longattn.distributed.options.ParallelOptions.transport>`,
the group and the tensors' device into ``"nccl"`` or ``"copy_engine"`` (with the copy-engine
:class:`~longattn.distributed.copy_engine.Link` it runs on): ``"auto"`` (the default) picks NCCL, as ``"nccl"``
does; ``"copy_engine"`` is an explicit choice until its checks on 2 and 4 GPUs are done (``"auto"`` will then pick
it where it can run), and raises where it cannot run. The ring (:class:`Ring`) and Ulysses' all-to-alls
(:func:`longattn.distributed.all_to_all.open_route`) both ask it. A new transport goes here: a name in
:data:`TRANSPORTS` (defined with the options, which validate it), a branch of :func:`choose`, and its exchange in
:class:`Ring` and a route in ``all_to_all``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.distributed import copy_engine
from longattn.distributed.options import TRANSPORTS
from longattn.distributed.shards import global_rank, group_size_rank

if TYPE_CHECKING:
    from longattn.distributed.options import ParallelOptions

__all__ = ["TRANSPORTS", "requested", "choose", "Ring"]


def requested(transport: str) -> str:
    """The transport asked for (one of :data:`TRANSPORTS`), ``"auto"`` resolved: ``"nccl"`` or ``"copy_engine"``
    (``"auto"`` is NCCL today)."""
    if transport not in TRANSPORTS:  # (ParallelOptions refuses it first)
        raise ValueError(f"ParallelOptions.transport must be one of {TRANSPORTS}, got {transport!r}")
    return "copy_engine" if transport == "copy_engine" else "nccl"


def choose(options: "ParallelOptions", group, world: int, rank: int, device: Optional[torch.device], *, fn: str,
           fits: bool = True, limit: str = "") -> Tuple[str, Optional["copy_engine.Link"]]:
    """``("nccl", None)`` or ``("copy_engine", the group's link)`` for ``options.transport`` (the same answer on
    every rank: the options are compared across ranks and the link is agreed). ``fits``: whether the call's flags fit
    a link (``limit`` says what the limit is, for the error). Where the copy engines were asked for and cannot run,
    ``RuntimeError`` naming ``fn`` (after the link's collective attempt where the call fits, as every rank makes it).
    The link times its flag waits with ``options.copy_engine_timeout_s`` (None: the group's timeout)."""
    if requested(options.transport) == "nccl":
        return "nccl", None
    made = None
    if fits and device is not None:
        made = copy_engine.link(group, world, rank, device, timeout_s=options.copy_engine_timeout_s)
    if made is not None:
        return "copy_engine", made
    asked = f"{fn}: ParallelOptions.transport='copy_engine'"
    if not fits:
        raise RuntimeError(f"{asked} takes {limit}; use 'auto' or 'nccl'")
    if device is None or device.type != "cuda":
        raise RuntimeError(f"{asked} needs CUDA tensors (got {'no' if device is None else device.type} tensors): "
                           "copy-engine transfers cannot run here; use 'auto' or 'nccl'")
    raise RuntimeError(f"{asked} but copy-engine transfers cannot run on this group (they need NCCL, CUDA tensors, "
                       "every rank on one host, PyTorch's symmetric memory, and no CUDA graph capture); use 'auto' "
                       "or 'nccl'")


def _start_exchange(send: Tensor, recv: Tensor, to: int, frm: int, group) -> List:
    ops_ = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return dist.batch_isend_irecv(ops_)


class Ring:
    """The ring of a process group as seen from this rank, and how its blocks travel (:func:`choose`: the group's
    ``isend``/``irecv``, or the copy engines straight into the next rank's memory). ``backward``: the channels of
    the backward pass to come (its copy-engine workspace is reserved at once). ``fn``: the calling function, for
    errors."""

    def __init__(self, group, options: "ParallelOptions", device: Optional[torch.device] = None,
                 backward: Optional[dict] = None, fn: str = "ring_attention"):
        self.group = group
        self.world, self.rank = group_size_rank(group)
        self.next = global_rank(group, (self.rank + 1) % self.world)
        self.prev = global_rank(group, (self.rank - 1) % self.world)
        limit = (copy_engine.SLOTS - 2) // 4
        _, self.link = choose(options, group, self.world, self.rank, device, fn=fn,
                              fits=4 * self.world + 2 <= copy_engine.SLOTS,
                              limit=f"at most {limit} ranks, got {self.world}")
        self._pass = None
        self.backward = backward

    def open(self, channels: dict) -> None:
        """Start a pass (the forward or the backward) whose messages are at most ``channels[name]`` bytes.
        Collective and agreed (:meth:`longattn.distributed.copy_engine.Link.start`): opened before the pass
        allocates anything; a pass that raises after it must :meth:`abort`."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        # (a captured graph would replay one pass's flag values)
        if self.link is not None and not capturing:
            reserve = copy_engine.RingExchange.workspace(self.backward) if self.backward else 0
            self._pass = copy_engine.RingExchange(self.link, (self.rank + 1) % self.world,
                                                  (self.rank - 1) % self.world, channels, reserve)

    def abort(self) -> None:
        """The pass raised: release the peers (copy engines; nothing to do with NCCL)."""
        if self._pass is not None:
            self._pass.abort()
            self._pass = None

    def exchange(self, send: Tensor, channel: str = "kv") -> Tuple[Tensor, List]:
        """Start sending ``send`` to the next rank and receiving a tensor like it from the previous one (with the
        copy engines: a view of the workspace, valid until :meth:`close`)."""
        if self._pass is not None:
            return self._pass.exchange(channel, send)
        recv = torch.empty_like(send)
        return recv, _start_exchange(send, recv, self.next, self.prev, self.group)

    def in_workspace(self) -> bool:
        """Whether this pass's received tensors are views of the copy-engine workspace (valid until :meth:`close`)."""
        return self._pass is not None

    def close(self, *outputs: Tensor) -> None:
        """The pass is done; ``outputs``: this rank's results of it, NaN where a peer aborted the pass (copy
        engines: :meth:`~longattn.distributed.copy_engine.Link.end`)."""
        if self._pass is not None:
            self._pass.close(outputs)
            self._pass = None
