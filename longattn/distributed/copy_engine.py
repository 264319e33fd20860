"""Transfers between the GPUs of one host on their copy engines: no SM is taken from the kernels they overlap.

NCCL moves data with kernels that hold SMs; beside an attention kernel that fills the GPU they slow it and run at
about half of NVLink's bandwidth (docs/kernel_notes.md). Here every rank of a process group maps the others'
memory (PyTorch's symmetric memory), and a transfer is a strided copy ``cuMemcpy2DAsync`` from local memory into a
peer's *workspace*, which the copy engines carry out. Ordering across ranks uses stream memory operations
(``cuStreamWriteValue64`` into a peer's flag, ``cuStreamWaitValue64`` on one's own), which hold no SM either.

Not the default: ``ParallelOptions.transport = "auto"`` picks NCCL (:mod:`longattn.distributed.transport`); these
transfers run when chosen explicitly (``"copy_engine"``), until their checks on 2 and 4 GPUs are done.

A :class:`Link` serves one process group: a workspace (allocated collectively, grown geometrically, reserved for a
forward and its backward at the forward), a flag array, side streams (copies to the peers, waits and copies out,
the rank's own rows, a spare one for a failed call's flags) and a call counter. Every rank starts each call in the
same order with the same sizes (:meth:`Link.start`, agreed across ranks before any transfer: allocations, counters,
no earlier failure), which is what makes the counter a shared epoch: a flag written with the epoch of the call is
the only state, so nothing is ever reset (64-bit flags: no wrap). A flag wait has no timeout: a watchdog thread
follows every wait from when its stream reaches it and ends the process when one lasts longer than the group's
timeout (the call's ``ParallelOptions.copy_engine_timeout_s`` overrides it); a call that raised after it started
releases its peers (:meth:`Link.abort`) and leaves the link refusing further calls on every rank until
:func:`release`.

:func:`link` returns ``None`` where this cannot run (not NCCL, not CUDA, ranks on several hosts, no symmetric
memory, a probe of flag writes, waits and peer copies that fails, CUDA graph capture): callers fall back to NCCL
collectives or, where chosen explicitly, raise. Whether it runs is agreed by all ranks. :class:`RingExchange` is the
ring's neighbour exchange on a link; :mod:`longattn.distributed.all_to_all` builds Ulysses' all-to-alls on it. The
machine is reached through :data:`RUNTIME` (:class:`CudaRuntime`), which tests replace with a simulated one.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.distributed import cuda_driver
from longattn.distributed.poison import poison
from longattn.distributed.shards import OutOfStep, collective_device, start_gather_ints

ALIGN = 256  # bytes: regions of the workspace start on this boundary
SLOTS = 64  # flags per source rank: [0] the workspace is free, [1 + i] the i-th signal of a call
ABORTED = 1 << 40  # added to the call's number in what an aborting rank writes: abort cells (end reads), flag slots


class _Wait:
    """One flag wait the watchdog follows: events recorded on its stream just before and just after it."""

    __slots__ = ("before", "after", "what", "timeout", "reached", "error")

    def __init__(self, before, after, what: str, timeout: float):
        self.before, self.after, self.what, self.timeout, self.reached = before, after, what, timeout, None
        self.error: Optional[BaseException] = None  # what its events' query raised, if it did


class _Watchdog:
    """Follows every flag wait from the moment it is queued (a call is followed from its start, so a host that
    blocks on the GPU half-way through a call is covered too). A wait is timed from when its stream reaches it (the
    event before it completes, as first seen), not from when the host queued it; one that lasts longer than its
    timeout (the call's ``ParallelOptions.copy_engine_timeout_s``, default the group's) makes the watchdog write why
    to stderr and end the process (``exit``), as NCCL's watchdog does with a collective that never completes. One
    daemon thread, started on first use (again if it ever ended), looking every ``period`` seconds. A wait whose
    events cannot be queried (the query raises: a sticky CUDA error) is timed from the first such query and ends
    the process past its timeout like any other, the error in the message; the others are followed as before."""

    def __init__(self, exit=os._exit, clock=time.monotonic, period: float = 1.0):
        self.pending: List[_Wait] = []
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.exit, self.clock, self.period = exit, clock, period

    def track(self, before, after, what: str, timeout: float) -> None:
        """Follow a wait between events ``before`` and ``after`` (objects with ``query()``)."""
        with self.lock:
            self.pending.append(_Wait(before, after, what, timeout))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="longattn-copy-engine-watchdog", daemon=True)
                self.thread.start()

    def check(self) -> bool:
        """Drop what completed; end the process if a wait lasted too long. Returns whether it did."""
        with self.lock:  # (the clock read after what it times was seen: never a time from before it)
            pending = []
            for w in self.pending:
                try:
                    if w.after.query():
                        continue
                    if w.reached is None and w.before.query():
                        w.reached = self.clock()
                except Exception as e:  # noqa: BLE001 (the thread must live on: it follows the other waits too)
                    w.error = e
                    if w.reached is None:
                        w.reached = self.clock()
                pending.append(w)
            self.pending = pending
            now = self.clock()
            late = [w for w in pending if w.reached is not None and now - w.reached > w.timeout]
        if late:
            w = late[0]
            sys.stderr.write(
                f"longattn: a copy-engine transfer of ring_attention/ulysses_attention on process group {w.what!r} "
                f"has waited {now - w.reached:.0f} s for a peer (it died, or stopped calling the collective); ending "
                f"this process (timeout {w.timeout:g} s: the group's, or ParallelOptions.copy_engine_timeout_s)"
                + ("" if w.error is None else f"; its stream could not be queried: {w.error}") + "\n")
            sys.stderr.flush()
            self.exit(1)
            return True
        return False

    def _run(self) -> None:
        while not self.check():
            time.sleep(self.period)


_WATCHDOG = _Watchdog()


class CudaRuntime:
    """What the transfers ask of the machine, in one place so that a test can run the protocol (:class:`Link`,
    :class:`RingExchange`, :class:`longattn.distributed.all_to_all.CopyRoute`) on a simulated one: streams and
    events (objects with ``wait_stream``, ``record_event``, ``wait_event``; events with ``query``), the driver's
    strided copy and flag write/wait, symmetric memory, and the collectives that agree on things. This one is the
    real machine: PyTorch's CUDA streams and symmetric memory, the CUDA driver through cuda-python's bindings
    (:mod:`longattn.distributed.cuda_driver`), ``torch.distributed``."""

    def scope(self):
        """What distinguishes this process's links from another rank's in the same process (none here)."""
        return None

    def possible(self, group, device: torch.device) -> bool:
        """Whether this rank could run transfers on ``group`` for tensors on ``device`` (not agreed)."""
        return _local_possible(group, device)

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def stream(self, device: torch.device):
        return torch.cuda.Stream(device)

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def memcpy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream) -> None:
        with torch.cuda.device(stream.device):
            cuda_driver.load().memcpy2d(dst, dst_pitch, src, src_pitch, width, height, stream.cuda_stream)

    def write(self, stream, address: int, value: int, bits: int = 64) -> None:
        _sixty_four(bits)
        with torch.cuda.device(stream.device):
            cuda_driver.load().write(stream.cuda_stream, address, value)

    def wait(self, stream, address: int, value: int, bits: int = 64) -> None:
        _sixty_four(bits)
        with torch.cuda.device(stream.device):
            cuda_driver.load().wait(stream.cuda_stream, address, value)

    def symm_empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        import torch.distributed._symmetric_memory as symm
        return symm.empty(numel, dtype=dtype, device=device)

    def rendezvous(self, buffer: Tensor, group, world: int) -> tuple:
        """``(handle, [rank p's buffer mapped here, for every p])`` (collective)."""
        import torch.distributed._symmetric_memory as symm
        name = _group_name(group)
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None and not getattr(symm, "is_symm_mem_enabled_for_group", lambda n: False)(name):
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(name)
        handle = symm.rendezvous(buffer, name)
        return handle, [handle.get_buffer(p, (buffer.numel(),), buffer.dtype) for p in range(world)]

    def agree(self, group, ok: bool) -> bool:
        return _agree(group, ok)

    def barrier(self, group, device: torch.device) -> None:
        dist.barrier(group=group, device_ids=[device.index])

    def same_host(self, group, world: int) -> bool:
        hosts: List[Optional[str]] = [None] * world
        dist.all_gather_object(hosts, _host_id(), group=group)
        return len(set(hosts)) == 1

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A tensor the call allocates (where an out-of-memory error may come from)."""
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def poison(self, flags: Tensor, mark: int, outputs: Sequence[Tensor]) -> None:
        """On the caller's stream: ``outputs`` set to NaN where a flag of ``flags`` holds ``mark``
        (:func:`longattn.distributed.poison.poison`)."""
        poison(flags, mark, outputs)

    def gather(self, group, world: int, values: Sequence[int], purpose: str) -> List[tuple]:
        """Every rank's ``values`` (small integers), in rank order: on the host where the option checks exchange
        (:func:`longattn.distributed.shards.host_group`, the GPU keeps running), else on the group. ``purpose``: the
        agreement (:data:`longattn.distributed.shards.PURPOSES`); :class:`~longattn.distributed.shards.OutOfStep`
        where a rank is in another."""
        return self.start_gather(group, world, values, purpose).result()

    def start_gather(self, group, world: int, values: Sequence[int], purpose: str):
        """:meth:`gather` issued without waiting: an object with ``done()`` (every record in, no wait) and
        ``result()`` (:meth:`gather`'s answer, waiting for it)."""
        return start_gather_ints(group, world, values, purpose=purpose, label=f"process group {_group_name(group)!r}")

    def group_timeout(self, group) -> float:
        """The process group's timeout in seconds (NCCL's default where it cannot be read)."""
        pg = group if group is not None else dist.group.WORLD
        try:
            return pg._get_backend(torch.device("cuda")).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 (no such attribute in this PyTorch)
            return dist.distributed_c10d.default_pg_nccl_timeout.total_seconds()

    def retire(self, tensors: Sequence[Tensor], streams: Sequence, joined: bool = True) -> None:
        """``tensors`` may go once ``streams`` have passed this point. ``joined``: the caller's stream has waited
        for ``streams`` (a call's end): nothing to do, PyTorch's caching allocator hands their blocks only to later
        work on the caller's stream. Not joined (an abort: the streams may still be waiting for a peer before they
        read them): each tensor is recorded on each stream, so that its block is not handed to a new tensor while
        a copy still reads it."""
        if not joined:
            for t in tensors:
                for stream in streams:
                    t.record_stream(stream)


RUNTIME = CudaRuntime()


def _sixty_four(bits: int) -> None:
    if bits != 64:
        raise ValueError(f"copy engine transfers: the driver's flags here are 64-bit, asked for {bits}")


def _group_name(group) -> str:
    return getattr(group if group is not None else dist.group.WORLD, "group_name")


def copy_rows(dst: Tensor, src: Tensor, stream, runtime=None) -> None:
    """``dst.copy_(src)`` on ``stream``'s copy engine, for views ``(..., rows, cols)`` whose last dimension is
    contiguous (any row and outer strides; outer dimensions are looped over). ``dst`` may be a view of a peer's
    memory (:meth:`Link.region`). ``runtime``: the machine (default :data:`RUNTIME`)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_rows: shapes/dtypes differ: {tuple(dst.shape)} {dst.dtype} <- "
                         f"{tuple(src.shape)} {src.dtype}")
    if dst.numel() == 0:
        return
    if dst.dim() < 2:
        dst, src = dst.reshape(1, -1), src.reshape(1, -1)
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError("copy_rows: the last dimension must be contiguous")
    esz, (rows, cols) = dst.element_size(), dst.shape[-2:]
    for t in (dst, src):
        if rows > 1 and t.stride(-2) < cols:
            raise ValueError(f"copy_rows: rows overlap (row stride {t.stride(-2)} < {cols} elements)")
    rt = runtime or RUNTIME
    for idx in _indices(dst.shape[:-2]):
        dd, ss = dst[idx], src[idx]
        rt.memcpy2d(dd.data_ptr(), (dd.stride(0) if rows > 1 else cols) * esz, ss.data_ptr(),
                    (ss.stride(0) if rows > 1 else cols) * esz, cols * esz, rows, stream)


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def align(n: int) -> int:
    """``n`` bytes rounded up to :data:`ALIGN` (where the next workspace region may start)."""
    return -(-n // ALIGN) * ALIGN


def as_rows(x: Tensor) -> Tensor:
    """A contiguous tensor as few, long rows for :func:`copy_rows`: one row up to 1 GiB (the fastest copy), else
    rows of its last dimensions (pitches stay under the driver's 2 GiB limit)."""
    if x.numel() * x.element_size() <= 1 << 30 or x.dim() < 2:
        return x.view(1, -1)
    cols = 1
    for d in reversed(x.shape):
        if (cols * d) * x.element_size() > 1 << 30:
            break
        cols *= d
    return x.view(-1, cols)


def _indices(shape) -> List[tuple]:
    out = [()]
    for n in shape:
        out = [i + (j,) for i in out for j in range(n)]
    return out


FLAG_BITS = 64
_FLAG_BYTES = FLAG_BITS // 8
_PROBE = 0x5EED_0000_0001  # a value the probe writes (no call number reaches it)


class Link:
    """Copy-engine transfers within one process group (see the module docstring). Not thread-safe; one per group.

    A call: :meth:`start` (agreed by every rank before any transfer: what it allocates, the call counters, no
    earlier call failed; the workspace grown if needed), then transfers, then :meth:`end`, or :meth:`abort` where
    the call raised after it started (it releases the peers and marks the link failed: every rank's next call
    raises, until :func:`release`). ``timeout_s``: seconds a flag wait may last once its stream reached it, before
    the process ends with an error (a peer that died or stopped calling would otherwise hold the streams forever: a
    stream waiting on a flag has no timeout of its own); None: the process group's own timeout
    (``init_process_group(timeout=...)``, which the docs tell users to raise for long checkpoints).

    The order that keeps it free of deadlocks: a rank queues every flag write its peers wait for at a step before
    its own waits of that step (:meth:`RingExchange.exchange` frees, then waits). Whatever the host does after
    queuing a wait may block it until the device is idle (a kernel's first launch in the process does, with
    CUDA_MODULE_LOADING=EAGER too: measured on an H200, tools/probe_stream_flags.py), so a wait whose write this
    host would queue only afterwards never ends; a write a peer queued earlier always arrives, and the rank
    furthest behind always moves on."""

    def __init__(self, group, world: int, rank: int, device: torch.device, runtime=None,
                 timeout_s: Optional[float] = None):
        self.rt = rt = runtime or RUNTIME
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self._name = _group_name(group)
        # flags: SLOTS per source rank, then one probe cell per source rank, then one abort cell per source rank
        self._flags = rt.symm_empty(world * (SLOTS + 2), torch.int64, device)
        self._flags.zero_()
        rt.synchronize(device)
        self._buffer: Optional[Tensor] = None
        self._peers: List[Tensor] = []
        self.epoch = 0
        self.busy = False
        self.failed = False  # a call raised after it started here (abort)
        self._earlier: list = []  # events: where the side streams stood when the call in progress began
        self.send = rt.stream(device)  # copies into the peers, flags to them
        self.recv = rt.stream(device)  # waits for the peers' flags, copies out of the workspace
        self.local = rt.stream(device)  # this rank's own rows (another copy engine than the peers')
        self.spare = rt.stream(device)  # a failed call's last flags (behind nothing that may wait for a peer)
        self.group_timeout = rt.group_timeout(group)
        self.timeout = timeout_s if timeout_s is not None else self.group_timeout

    def connect(self) -> None:
        """The collective half of making the link: the flags' rendezvous (the caller agreed that every rank
        allocated them), then a probe: a flag written and waited for on this rank's own stream, and a one-cell
        copy into every peer's flags, checked after a barrier. Raises where any of it fails here."""
        rt = self.rt
        self._flag_handle, views = rt.rendezvous(self._flags, self.group, self.world)
        self._flag_base = [t.data_ptr() for t in views]
        own = self._flag_base[self.rank] + self.world * SLOTS * _FLAG_BYTES
        cell = own + self.rank * _FLAG_BYTES
        rt.write(self.send, cell, _PROBE, FLAG_BITS)
        rt.wait(self.send, cell, _PROBE, FLAG_BITS)
        for p in range(self.world):
            if p != self.rank:
                rt.memcpy2d(self._flag_base[p] + self.world * SLOTS * _FLAG_BYTES + self.rank * _FLAG_BYTES,
                            _FLAG_BYTES, cell, _FLAG_BYTES, _FLAG_BYTES, 1, self.send)
        rt.synchronize(self.device)

    def probed(self) -> bool:
        """After every rank's :meth:`connect` and a barrier: whether every peer's probe cell arrived here."""
        cells = self._flags[self.world * SLOTS:self.world * (SLOTS + 1)].tolist()
        return all(v == _PROBE for v in cells)

    def current(self):
        """The caller's stream."""
        return self.rt.current(self.device)

    def copy(self, dst: Tensor, src: Tensor, stream) -> None:
        """:func:`copy_rows` on this link's machine."""
        copy_rows(dst, src, stream, self.rt)

    # -- the workspace ------------------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Grow the workspace to at least ``nbytes`` (collective: every rank asks for the same size): to twice its
        size at least, so that calls growing a little at a time (a packed batch's new maxima) rarely grow it. The
        allocation is agreed before the rendezvous: where it fails on any rank, every rank raises
        ``torch.OutOfMemoryError`` naming the ranks, and none is left in the rendezvous. The rendezvous is agreed
        too: where it raised on some rank after its peers came through it (mapping their memory, say), every rank
        raises the same ``RuntimeError`` naming the ranks at once, rather than the peers starting the call and
        waiting for that rank's flags until the watchdog ends them; the next call makes the workspace again. A
        link without one makes one whatever ``nbytes`` (0 for a call of empty shards: its regions, empty, are
        views of it too)."""
        have = 0 if self._buffer is None else self._buffer.numel()
        if self._buffer is not None and have >= nbytes:
            return
        rt = self.rt
        rt.synchronize(self.device)  # nothing may still read or write the old workspace
        rt.barrier(self.group, self.device)
        rt.synchronize(self.device)
        self._buffer = self._peers = None
        self._handle = None
        size = max(nbytes, 2 * have, 1 << 20)
        buffer, error = None, None
        try:
            buffer = rt.symm_empty(size, torch.uint8, self.device)
        except Exception as e:  # noqa: BLE001 (out of memory: agreed below)
            error = e
        failed = [r for r, (ok,) in enumerate(rt.gather(self.group, self.world, (int(buffer is not None),), "grow"))
                  if not ok]
        if failed:
            raise torch.OutOfMemoryError(
                f"copy engine transfers: the workspace of process group {self._name!r} could not grow to {size} bytes "
                f"on {_ranks(failed)} (out of memory); every rank raises this") from error
        handle = peers = None
        try:
            handle, peers = rt.rendezvous(buffer, self.group, self.world)
        except Exception as e:  # noqa: BLE001 (agreed below)
            error = e
        failed = [r for r, (ok,) in enumerate(rt.gather(self.group, self.world, (int(peers is not None),), "map"))
                  if not ok]
        if failed:
            raise RuntimeError(
                f"copy engine transfers: the rendezvous of the workspace of process group {self._name!r} failed on "
                f"{_ranks(failed)}; no rank started the call (every rank raises this), and the next call makes the "
                "workspace again") from error
        self._handle, self._peers = handle, peers
        self._buffer = buffer

    def region(self, p: int, offset: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """The workspace of rank ``p`` (this rank's own or a peer's, mapped here) at byte ``offset``, as a
        contiguous tensor of ``shape``."""
        return self._peers[p][offset:offset + nbytes(shape, dtype)].view(dtype).view(tuple(shape))

    # -- a call -------------------------------------------------------------------------------------------------
    def start(self, nbytes: int, allocate=lambda: None):
        """Start a call whose transfers use ``nbytes`` of workspace: ``allocate()`` (what the call allocates,
        returned) runs first, then every rank agrees (one small all-gather, on the host where it can) that it
        succeeded everywhere, that the ranks' call counters match and that no earlier call failed; only then is the
        workspace grown (agreed too) and the call begun (:meth:`begin`). Every rank raises the same error where
        any rank failed, so no rank is left a call behind its peers."""
        if self.busy:
            raise RuntimeError(
                f"copy engine transfers: a ring_attention/ulysses_attention call on process group {self._name!r} "
                "started inside another on the same group (a nested call); that cannot be matched across ranks")
        error: Optional[BaseException] = None
        made = None
        try:
            made = allocate()
        except Exception as e:  # noqa: BLE001 (agreed below)
            error = e
        code = 0 if error is None else (1 if _out_of_memory(error) else 2)
        try:
            states = self.rt.gather(self.group, self.world, (self.epoch, int(self.failed), code), "start")
        except OutOfStep:  # a peer left an earlier call half-way: this link's transfers cannot be matched any more
            self.failed = True
            raise
        broken = [r for r, (_, failed, _) in enumerate(states) if failed]
        if broken or len({e for e, _, _ in states}) > 1:
            raise RuntimeError(self._refusal(broken, states)) from error
        bad = [r for r, (_, _, c) in enumerate(states) if c]
        if bad:
            oom = all(states[r][2] == 1 for r in bad)
            kind = torch.OutOfMemoryError if oom else RuntimeError
            raise kind(f"copy engine transfers on process group {self._name!r}: "
                       f"{'out of memory' if oom else 'an error'} on {_ranks(bad)} while the call allocated "
                       f"its buffers; no rank started it (every rank raises this)") from error
        del error
        self.reserve(nbytes)
        try:
            self.begin()
        except BaseException:  # (a driver call refused half-way: the peers are released, as for any failed call)
            self.abort()
            raise
        return made

    def _refusal(self, broken: List[int], states: List[tuple]) -> str:
        why = (f"an earlier call failed on {_ranks(broken)} after it started (an error inside it)" if broken
               else "the ranks' call counters differ (" + ", ".join(f"rank {r}: {s[0]}" for r, s in
                                                                     enumerate(states)) + ")")
        return (f"copy engine transfers on process group {self._name!r}: {why}; the ranks' transfers can no longer "
                "be matched. Call longattn.distributed.copy_engine.release(group) on every rank (it waits for the "
                "transfers still queued; the next call makes a new link), or restart the processes")

    def begin(self) -> None:
        """Begin a call (:meth:`start` calls it, agreed): the side streams wait for the caller's stream (inputs
        written, this rank's previous readers of its workspace done), then every rank tells every other that its
        workspace is free."""
        self.busy = True
        self.epoch += 1
        # where the side streams stand before this call: an abort's flags wait for it (below)
        self._earlier = [stream.record_event() for stream in (self.send, self.recv, self.local)]
        for stream in (self.send, self.recv, self.local):
            stream.wait_stream(self.current())
        peers = [p for p in range(self.world) if p != self.rank]
        for p in peers:
            self.signal(p, 0)
        for p in peers:
            self.await_(p, 0, self.send)

    def end(self, outputs: Sequence[Tensor] = ()) -> None:
        """End a call: the caller's stream waits for the side streams, the side streams for the caller's (so that
        the next call's "workspace free" follows every read of this one, whatever stream makes it). ``outputs``:
        the call's results on this rank, set to NaN on the device (no host wait) where a peer aborted this call
        (:meth:`abort`): what its transfers delivered is not to be trusted, and a NaN is not a silent answer."""
        current = self.current()
        for side in (self.recv, self.send, self.local):
            current.wait_stream(side)
        for side in (self.recv, self.send, self.local):
            side.wait_stream(current)
        outputs = [t for t in outputs if t is not None and t.is_floating_point()]
        if outputs:  # (the number an aborting peer writes into its abort cell here, first)
            self.rt.poison(self._flags[self.world * (SLOTS + 1):], self.epoch + ABORTED, outputs)
        self.busy = False

    def abort(self) -> None:
        """After an error inside a started call (call it in the ``except``/``finally`` of the call): once this
        rank's side streams have done what earlier calls queued on them (so that no flag of this call overtakes a
        copy or flag of an earlier one, which a peer still in that call would take for its own), a spare stream
        writes every peer's abort cell with this call's number plus :data:`ABORTED`, then every flag slot of the
        call with the same number, so no peer's stream waits forever for this rank. The abort cells are written
        first, to every peer, not only to those that wait for this rank: a peer that receives data forwarded from
        this rank's neighbour (the ring) finds the mark there by the time the forwarded data arrives, and the
        peers' :meth:`end` sets their results of this call to NaN. The link is marked failed, so every rank's next
        call raises until :func:`release`. Nothing where no call is on. The link is marked first: where the driver
        refuses the writes (a sticky CUDA error, often what made the call fail), they raise here, the peers are not
        released (the watchdog ends them), and every rank's next call still raises the same refusal."""
        if not self.busy:
            return
        self.busy = False
        self.failed = True
        for event in self._earlier:
            self.spare.wait_event(event)
        peers = [p for p in range(self.world) if p != self.rank]
        mark = self.epoch + ABORTED
        for p in peers:
            self.rt.write(self.spare, self._abort_addr(p), mark, FLAG_BITS)
        for p in peers:
            for slot in range(SLOTS):
                self.rt.write(self.spare, self._flag_addr(p, slot), mark, FLAG_BITS)

    def _abort_addr(self, p: int) -> int:
        return self._flag_base[p] + (self.world * (SLOTS + 1) + self.rank) * _FLAG_BYTES

    def _flag_addr(self, p: int, slot: int) -> int:
        return self._flag_base[p] + (self.rank * SLOTS + slot) * _FLAG_BYTES

    def signal(self, p: int, slot: int) -> None:
        """After the copies issued so far on the sending stream: set flag ``slot`` of this rank on ``p`` to this
        call's number (slot 0: this rank's workspace is free)."""
        if not 0 <= slot < SLOTS:
            raise RuntimeError(f"copy engine link: flag {slot} out of range ({SLOTS} a rank)")
        self.rt.write(self.send, self._flag_addr(p, slot), self.epoch, FLAG_BITS)

    def await_(self, p: int, slot: int, stream) -> None:
        """``stream`` waits until ``p`` has set flag ``slot`` for this call; the watchdog follows the wait from
        when the stream reaches it."""
        addr = self._flag_base[self.rank] + (p * SLOTS + slot) * _FLAG_BYTES
        before = stream.record_event()
        self.rt.wait(stream, addr, self.epoch, FLAG_BITS)
        _WATCHDOG.track(before, stream.record_event(), self._name, self.timeout)

    def drain(self) -> None:
        """Wait (on the host) for everything this link queued."""
        self.rt.synchronize(self.device)


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _ranks(ranks: Sequence[int]) -> str:
    """``"rank 3"``, ``"ranks 1, 2"``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


# (scope, group name, device index) -> (the group, its Link or None)
_LINKS: Dict[tuple, tuple] = {}


def link(group, world: int, rank: int, tensors_device: torch.device,
         timeout_s: Optional[float] = None) -> Optional[Link]:
    """The :class:`Link` of ``group`` (created collectively on first use), or ``None`` where copy-engine transfers
    cannot run; the answer is the same on every rank (agreed at each step the first time: whether each rank can,
    the host, the allocation, the rendezvous and a probe of flag writes, waits and peer copies). ``None`` too while
    the stream is being captured into a CUDA graph: replays would reuse the captured calls' flag values (epochs), so
    a wait could pass on an earlier replay's flag. ``timeout_s``: the flag waits' timeout from this call on
    (``ParallelOptions.copy_engine_timeout_s``; None: the group's), see :class:`Link`."""
    rt = RUNTIME
    if rt.capturing():
        return None  # (every rank captures alike: the calls are collective)
    key_group = group if group is not None else dist.group.WORLD
    key = (rt.scope(), getattr(key_group, "group_name", None) or str(id(key_group)), tensors_device.index)
    entry = _LINKS.get(key)
    if entry is not None and entry[0] is key_group:
        return _timed(entry[1], timeout_s)
    if entry is not None and entry[1] is not None:
        # a group of the same name (destroyed and made again) replaces the one the link served: what the old link
        # queued is done before the first collective below, so that once every rank has passed it, no stream still
        # copies into or out of the old link's memory, which goes when the new entry replaces it
        entry[1].drain()
    made = _make_link(rt, group, world, rank, tensors_device)
    _LINKS[key] = (key_group, made)
    if made is not None and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        import warnings
        warnings.warn("longattn copy-engine transfers with CUDA_DEVICE_MAX_CONNECTIONS=1 (as Megatron sets it): every "
                      "stream shares one hardware queue, so the transfers no longer overlap the kernels and their "
                      "flag waits can deadlock against another library's collectives queued in another order; use "
                      "ParallelOptions(transport='nccl') (the default)", RuntimeWarning, stacklevel=3)
    return _timed(made, timeout_s)


def _timed(made: Optional[Link], timeout_s: Optional[float]) -> Optional[Link]:
    """``made`` timing its flag waits with ``timeout_s`` from now on (None: the group's timeout)."""
    if made is not None:
        made.timeout = timeout_s if timeout_s is not None else made.group_timeout
    return made


def _make_link(rt, group, world: int, rank: int, device: torch.device) -> Optional[Link]:
    """A new link, every step agreed (no rank left in a collective the others skipped), or None everywhere."""
    if not rt.agree(group, rt.possible(group, device)) or not rt.same_host(group, world):
        return None
    made: Optional[Link] = None
    try:
        made = Link(group, world, rank, device, rt)
    except Exception:  # noqa: BLE001 (symmetric memory unavailable here: NCCL instead, agreed)
        made = None
    if not rt.agree(group, made is not None):
        return None
    try:
        made.connect()
        ok = True
    except Exception:  # noqa: BLE001 (no stream memory operations, no peer copies: NCCL instead, agreed)
        ok = False
    if not rt.agree(group, ok):
        return None
    rt.barrier(group, device)  # (every rank's probe copies are done)
    if not rt.agree(group, made.probed()):
        return None
    return made


def release(group=None) -> None:
    """Drop the copy-engine link of ``group`` (``None``: the default group; ``"all"``: every group's) after waiting
    for what it queued (a failed call's peers finish theirs): its workspace goes back to PyTorch once nothing else
    holds it, and the next call on the group makes a new one (collectively). Call it on every rank of the group,
    between calls; it is also the way back after a call that raised on some rank after it started: it brings the
    ranks into step again (a peer still inside that call, or starting another, raises
    :class:`~longattn.distributed.shards.OutOfStep` there, and once it calls ``release`` too, all go on). The
    groups' agreements are in flight together, so that with several groups (``"all"``) a peer that went on to a
    call on another group than the failed one meets this rank's release there, and raises."""
    scope = RUNTIME.scope()
    if group == "all":
        keys = [k for k in _LINKS if k[0] == scope]
    else:
        key_group = group if group is not None else dist.group.WORLD
        keys = [k for k, (g, _) in _LINKS.items() if g is key_group and k[0] == scope]
    links = [made for made in (_LINKS.pop(key)[1] for key in keys) if made is not None]
    for made in links:
        made.drain()
    _into_step(links)


def _into_step(links: Sequence[Link]) -> None:
    """The ``"release"`` agreement of every one of ``links``' groups, all in flight at once (a rank waiting in one
    group's agreement while its peer waits in another's would wait for ever), each repeated while some rank is
    still in another agreement of its group (it raises there and comes to its own release), for at most the
    groups' timeout."""
    if not links:
        return
    deadline = time.monotonic() + max(made.group_timeout for made in links)
    pending = {i: made.rt.start_gather(made.group, made.world, (), "release") for i, made in enumerate(links)}
    while pending:
        waiting = True
        for i, agreement in list(pending.items()):
            if not agreement.done() and time.monotonic() <= deadline:
                continue
            waiting = False
            try:
                agreement.result()
                del pending[i]
            except OutOfStep:
                if time.monotonic() > deadline:
                    raise
                made = links[i]
                pending[i] = made.rt.start_gather(made.group, made.world, (), "release")
        if waiting:
            time.sleep(1e-3)


def _agree(group, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (an all-reduce of a flag)."""
    flag = torch.tensor([1 if ok else 0], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _host_id() -> str:
    """This machine: the host name and the kernel's boot id (two machines can share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.environ.get('LONGATTN_HOST_ID') or socket.gethostname()}/{boot}"


def _local_possible(group, device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if "nccl" not in str(dist.get_backend(group)).lower():
        return False
    try:
        import torch.distributed._symmetric_memory as symm
        cuda_driver.load()
    except Exception:  # noqa: BLE001 (no symmetric memory in this PyTorch, no CUDA driver library)
        return False
    return hasattr(symm, "empty") and hasattr(symm, "rendezvous")


class _Arrival:
    """The pending receipt of one ring exchange: :meth:`wait` makes the caller's stream wait for it."""

    def __init__(self, link: Link, src: int, slot: int):
        self.link, self.src, self.slot = link, src, slot

    def wait(self) -> None:
        self.link.await_(self.src, self.slot, self.link.recv)
        self.link.current().wait_stream(self.link.recv)


class RingExchange:
    """One call's exchanges with the ring's neighbours over a :class:`Link`: each :meth:`exchange` on a channel
    sends a tensor to the next rank's workspace and receives the previous rank's into this rank's, two slots per
    channel (the block in hand, the one arriving). The ``j``-th exchange of a channel reuses the slot of the
    ``j - 2``-th, so it waits for the next rank to free it: a rank frees its slot ``j - 2`` once what its stream
    did with it (the compute on it, issued before exchange ``j``, and forwarding it, at ``j - 1``) is done.

    ``channels``: name -> bytes per slot; ``reserve``: workspace bytes to hold now at least (a later pass's, so
    that the workspace does not grow then). The received tensors are views of the workspace, valid until
    :meth:`close` (copy what must outlive the call). A pass that raises after it started must :meth:`abort`."""

    def __init__(self, link: Link, nxt: int, prv: int, channels: Dict[str, int], reserve: int = 0):
        self.link, self.nxt, self.prv = link, nxt, prv
        self.offsets, offset = {}, 0
        for name, size in channels.items():
            self.offsets[name] = (offset, align(size))
            offset += 2 * self.offsets[name][1]
        self.count = dict.fromkeys(channels, 0)
        self.flags: Dict[tuple, int] = {}  # (channel, exchange, kind) -> flag slot, numbered as first used
        self.keep: List[Tensor] = []
        link.start(max(offset, reserve))

    @staticmethod
    def workspace(channels: Dict[str, int]) -> int:
        """The workspace bytes of a pass with ``channels``."""
        return sum(2 * align(size) for size in channels.values())

    def _flag(self, key) -> int:
        if key not in self.flags:
            self.flags[key] = 1 + len(self.flags)
            if self.flags[key] >= SLOTS:
                raise RuntimeError(f"copy engine ring: more than {SLOTS - 1} flags in one call")
        return self.flags[key]

    def exchange(self, channel: str, send: Tensor):
        """Send ``send`` (contiguous) to the next rank; returns ``(received, arrival)``: the previous rank's
        tensor of the same shape and dtype (a workspace view) and its pending receipt (``arrival.wait()``)."""
        link, j = self.link, self.count[channel]
        self.count[channel] += 1
        base, size = self.offsets[channel]
        if send.numel() * send.element_size() > size:
            raise RuntimeError(f"copy engine ring: {channel} message larger than its slot")
        send = send.contiguous()
        self.keep.append(send)
        offset = base + (j % 2) * size
        link.send.wait_stream(link.current())
        if j >= 2:  # (freed before waiting for the next rank's: no rank's wait depends on its own)
            link.signal(self.prv, self._flag((channel, j - 2, "free")))
            link.await_(self.nxt, self._flag((channel, j - 2, "free")), link.send)
        dst = link.region(self.nxt, offset, send.shape, send.dtype)
        link.copy(as_rows(dst), as_rows(send), link.send)
        link.signal(self.nxt, self._flag((channel, j, "data")))
        recv = link.region(self.link.rank, offset, send.shape, send.dtype)
        return recv, [_Arrival(link, self.prv, self._flag((channel, j, "data")))]

    def close(self, outputs: Sequence[Tensor] = ()) -> None:
        """The end of the call (:meth:`Link.end`, which sets ``outputs`` to NaN where a peer aborted it): the sent
        tensors may then go."""
        self.link.end(outputs)
        self.link.rt.retire(self.keep, (self.link.send,))
        self.keep = []

    def abort(self) -> None:
        """The pass raised after it started: release the peers (:meth:`Link.abort`)."""
        try:
            self.link.abort()
        finally:  # (the sending stream may still copy them, after a peer's flag: not joined)
            self.link.rt.retire(self.keep, (self.link.send,), joined=False)
            self.keep = []
