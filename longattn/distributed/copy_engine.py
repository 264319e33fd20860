"""Transfers between the GPUs of one host on their copy engines: no SM is taken from the kernels they overlap.

NCCL moves data with kernels that hold SMs; beside an attention kernel that fills the GPU they slow it and run at
about half of NVLink's bandwidth (docs/kernel_notes.md). Here every rank of a process group maps the others'
memory (PyTorch's symmetric memory), and a transfer is a strided copy ``cuMemcpy2DAsync`` from local memory into a
peer's *workspace*, which the copy engines carry out. Ordering across ranks uses stream memory operations
(``cuStreamWriteValue32`` into a peer's flag, ``cuStreamWaitValue32`` on one's own), which hold no SM either.

A :class:`Link` serves one process group: a workspace grown to the largest call (allocated collectively), a flag
array, three side streams (copies to the peers, waits and copies out, the rank's own rows) and a call counter.
Every rank calls :meth:`Link.begin` in the same order with the same sizes, which is what makes the counter a shared
epoch: a flag written with the epoch of the call is the only state, so nothing is ever reset. A flag wait has no
timeout: a watchdog thread ends the process when a call's transfers wait longer than :data:`TIMEOUT_S`, and a call
that raised half-way leaves the link refusing further calls (:meth:`Link.begin`).

:func:`link` returns ``None`` where this cannot run (not NCCL, not CUDA, ranks on several hosts, no symmetric
memory, CUDA graph capture): callers fall back to NCCL collectives. Whether it runs is agreed by all ranks.
:class:`RingExchange` is the ring's neighbour exchange on a link; :mod:`longattn.distributed.all_to_all` builds
Ulysses' all-to-alls on it.
"""
from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.distributed.shards import collective_device

ALIGN = 256  # bytes: regions of the workspace start on this boundary
SLOTS = 64  # flags per source rank: [0] the workspace is free, [1 + i] the i-th signal of a call
_MEMORYTYPE_DEVICE = 2
_WAIT_GEQ = 0x0


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` of the CUDA driver API (field order and types as in ``cuda.h``)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


class _Driver:
    """The three CUDA driver calls used here, loaded from ``libcuda`` on first use."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")

        def fn(name, *args):
            f = getattr(lib, name + "_v2", None) or getattr(lib, name)
            f.restype, f.argtypes = ctypes.c_int, list(args)
            return f

        self._memcpy2d = fn("cuMemcpy2DAsync", ctypes.POINTER(_Memcpy2D), ctypes.c_void_p)
        self._write = fn("cuStreamWriteValue32", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
        self._wait = fn("cuStreamWaitValue32", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
        self._name = lib.cuGetErrorName
        self._name.restype, self._name.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, what: str, code: int) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self._name(code, ctypes.byref(text))
            name = text.value.decode() if text.value else code
            raise RuntimeError(f"copy engine transfer: {what} failed with {name}")

    def memcpy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                 stream: int) -> None:
        c = _Memcpy2D(srcMemoryType=_MEMORYTYPE_DEVICE, srcDevice=src, srcPitch=src_pitch,
                      dstMemoryType=_MEMORYTYPE_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                      WidthInBytes=width, Height=height)
        self.check("cuMemcpy2DAsync", self._memcpy2d(ctypes.byref(c), stream))

    def write(self, stream: int, address: int, value: int) -> None:
        self.check("cuStreamWriteValue32", self._write(stream, address, value, 0))  # fenced: earlier writes first

    def wait(self, stream: int, address: int, value: int) -> None:
        self.check("cuStreamWaitValue32", self._wait(stream, address, value, _WAIT_GEQ))


_DRIVER: Optional[_Driver] = None

# Seconds a rank's transfers may wait for a peer before this process ends with an error (a peer that died or stopped
# calling would otherwise hold the streams forever: a stream waiting on a flag has no timeout of its own).
TIMEOUT_S = 600.0


class _Watchdog:
    """Follows the side streams' last work of every call; when some has not completed after :data:`TIMEOUT_S`, it
    writes why to stderr and ends the process (``exit``), as NCCL's watchdog does with a collective that never
    completes. One daemon thread, started on first use, looking once a second."""

    def __init__(self, exit=os._exit, clock=time.monotonic):
        self.pending: list = []
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.exit, self.clock = exit, clock

    def track(self, events, what: str) -> None:
        with self.lock:
            self.pending.append((self.clock(), events, what))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="longattn-copy-engine-watchdog", daemon=True)
                self.thread.start()

    def check(self) -> bool:
        """Drop what completed; end the process if anything waited too long. Returns whether it did."""
        now = self.clock()
        with self.lock:
            self.pending = [p for p in self.pending if not all(e.query() for e in p[1])]
            late = [p for p in self.pending if now - p[0] > TIMEOUT_S]
        if late:
            sys.stderr.write(
                f"longattn: a copy-engine transfer of ring_attention/ulysses_attention on process group "
                f"{late[0][2]!r} has waited {now - late[0][0]:.0f} s for a peer (it died, or stopped calling the "
                f"collective); ending this process (copy_engine.TIMEOUT_S = {TIMEOUT_S:g})\n")
            sys.stderr.flush()
            self.exit(1)
            return True
        return False

    def _run(self) -> None:
        while not self.check():
            time.sleep(1.0)


_WATCHDOG = _Watchdog()


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


class CudaRuntime:
    """What the transfers ask of the machine, in one place so that a test can run the protocol (:class:`Link`,
    :class:`RingExchange`, :class:`longattn.distributed.all_to_all.CopyRoute`) on a simulated one: streams and
    events (objects with ``wait_stream``, ``record_event``, ``wait_event``; events with ``query``), the driver's
    strided copy and flag write/wait, symmetric memory, and the collectives that agree on things. This one is the
    real machine: PyTorch's CUDA streams and symmetric memory, the CUDA driver through ``ctypes``,
    ``torch.distributed``."""

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
            _driver().memcpy2d(dst, dst_pitch, src, src_pitch, width, height, stream.cuda_stream)

    def write(self, stream, address: int, value: int) -> None:
        with torch.cuda.device(stream.device):
            _driver().write(stream.cuda_stream, address, value)

    def wait(self, stream, address: int, value: int) -> None:
        with torch.cuda.device(stream.device):
            _driver().wait(stream.cuda_stream, address, value)

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

    def retire(self, tensors: Sequence[Tensor], streams: Sequence) -> None:
        """``tensors`` may go once ``streams`` have passed this point: nothing to do here (the caller's stream has
        waited for the side streams, and PyTorch's caching allocator hands their blocks only to work on it)."""


RUNTIME = CudaRuntime()


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


class Link:
    """Copy-engine transfers within one process group (see the module docstring). Not thread-safe; one per group."""

    def __init__(self, group, world: int, rank: int, device: torch.device, runtime=None):
        self.rt = rt = runtime or RUNTIME
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self._name = _group_name(group)
        self._flags = rt.symm_empty(world * SLOTS, torch.int32, device)
        self._flags.zero_()
        rt.synchronize(device)
        self._flag_handle, flag_views = rt.rendezvous(self._flags, group, world)
        self._flag_base = [t.data_ptr() for t in flag_views]
        self._buffer: Optional[Tensor] = None
        self._peers: List[Tensor] = []
        self.epoch = 0
        self.busy = False
        self.send = rt.stream(device)  # copies into the peers, flags to them
        self.recv = rt.stream(device)  # waits for the peers' flags, copies out of the workspace
        self.local = rt.stream(device)  # this rank's own rows (another copy engine than the peers')

    def current(self):
        """The caller's stream."""
        return self.rt.current(self.device)

    def copy(self, dst: Tensor, src: Tensor, stream) -> None:
        """:func:`copy_rows` on this link's machine."""
        copy_rows(dst, src, stream, self.rt)

    # -- the workspace ------------------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Grow the workspace to at least ``nbytes`` (collective: every rank asks for the same size)."""
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return
        rt = self.rt
        rt.synchronize(self.device)  # nothing may still read or write the old workspace
        rt.barrier(self.group, self.device)
        rt.synchronize(self.device)
        self._buffer = self._peers = None
        buffer = rt.symm_empty(max(nbytes, 1 << 20), torch.uint8, self.device)
        self._handle, self._peers = rt.rendezvous(buffer, self.group, self.world)
        self._buffer = buffer

    def region(self, p: int, offset: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """The workspace of rank ``p`` (this rank's own or a peer's, mapped here) at byte ``offset``, as a
        contiguous tensor of ``shape``."""
        return self._peers[p][offset:offset + nbytes(shape, dtype)].view(dtype).view(tuple(shape))

    # -- ordering -----------------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a call: the sending stream waits for the caller's stream (inputs written, this rank's previous
        readers of its workspace done), then every rank tells every other that its workspace is free. Refused while
        an earlier call has not ended (:meth:`end`): one that raised half-way leaves flags the peers' streams may
        still wait for, so the link cannot be trusted again."""
        if self.busy:
            raise RuntimeError(
                "copy engine transfers: an earlier ring_attention/ulysses_attention call on this process group did "
                "not complete (an error inside it, or a call nested in another on the same group); the ranks' "
                "transfers can no longer be matched. Set longattn.distributed.ring.TRANSPORT / ulysses.TRANSPORT "
                "to 'nccl' for the rest of this process, or restart it")
        self.busy = True
        self.epoch += 1
        for stream in (self.send, self.recv, self.local):
            stream.wait_stream(self.current())
        peers = [p for p in range(self.world) if p != self.rank]
        for p in peers:
            self.signal(p, 0)
        for p in peers:
            self.await_(p, 0, self.send)

    def end(self) -> None:
        """End a call: the caller's stream waits for the side streams, the side streams for the caller's (so that
        the next call's "workspace free" follows every read of this one, whatever stream makes it), and the
        watchdog follows the side streams' last work (a peer that never answers ends this process with an error
        after :data:`TIMEOUT_S`, as NCCL's watchdog does)."""
        current = self.current()
        _WATCHDOG.track([side.record_event() for side in (self.recv, self.send)], self._name)
        for side in (self.recv, self.send, self.local):
            current.wait_stream(side)
        for side in (self.recv, self.send, self.local):
            side.wait_stream(current)
        self.busy = False

    def signal(self, p: int, slot: int) -> None:
        """After the copies issued so far on the sending stream: set flag ``slot`` of this rank on ``p`` to this
        call's number (slot 0: this rank's workspace is free)."""
        if not 0 <= slot < SLOTS:
            raise RuntimeError(f"copy engine link: flag {slot} out of range ({SLOTS} a rank)")
        addr = self._flag_base[p] + (self.rank * SLOTS + slot) * 4
        self.rt.write(self.send, addr, self.epoch)

    def await_(self, p: int, slot: int, stream: torch.cuda.Stream) -> None:
        """``stream`` waits until ``p`` has set flag ``slot`` for this call."""
        addr = self._flag_base[self.rank] + (p * SLOTS + slot) * 4
        self.rt.wait(stream, addr, self.epoch)


# (group name, device index) -> (the group, its Link or None)
_LINKS: Dict[tuple, tuple] = {}


def link(group, world: int, rank: int, tensors_device: torch.device) -> Optional[Link]:
    """The :class:`Link` of ``group`` (created collectively on first use), or ``None`` where copy-engine transfers
    cannot run; the answer is the same on every rank (agreed by all-reduces the first time). ``None`` too while
    the stream is being captured into a CUDA graph: replays would reuse the captured calls' flag values (epochs), so
    a wait could pass on an earlier replay's flag."""
    rt = RUNTIME
    if rt.capturing():
        return None  # (every rank captures alike: the calls are collective)
    key_group = group if group is not None else dist.group.WORLD
    key = (rt.scope(), getattr(key_group, "group_name", None) or str(id(key_group)), tensors_device.index)
    entry = _LINKS.get(key)
    if entry is not None and entry[0] is key_group:
        return entry[1]
    ok = rt.agree(group, rt.possible(group, tensors_device))
    if ok:
        ok = rt.same_host(group, world)
    made: Optional[Link] = None
    if ok:
        try:
            made = Link(group, world, rank, tensors_device, rt)
        except Exception:  # noqa: BLE001 (symmetric memory unavailable: NCCL instead)
            made = None
        if not rt.agree(group, made is not None):
            made = None
    _LINKS[key] = (key_group, made)
    return made


def release(group=None) -> None:
    """Drop the copy-engine link of ``group`` (``None``: the default group; ``"all"``: every group's): its
    workspace goes back to PyTorch once nothing else holds it, and the next call on the group makes a new one
    (collectively). Call it on every rank of the group, between calls."""
    scope = RUNTIME.scope()
    if group == "all":
        for key in [k for k in _LINKS if k[0] == scope]:
            del _LINKS[key]
        return
    key_group = group if group is not None else dist.group.WORLD
    for key in [k for k, (g, _) in _LINKS.items() if g is key_group and k[0] == scope]:
        del _LINKS[key]


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
        _driver()
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

    ``channels``: name -> bytes per slot. The received tensors are views of the workspace, valid until
    :meth:`close` (copy what must outlive the call)."""

    def __init__(self, link: Link, nxt: int, prv: int, channels: Dict[str, int]):
        self.link, self.nxt, self.prv = link, nxt, prv
        self.offsets, offset = {}, 0
        for name, size in channels.items():
            self.offsets[name] = (offset, align(size))
            offset += 2 * self.offsets[name][1]
        self.count = dict.fromkeys(channels, 0)
        self.flags: Dict[tuple, int] = {}  # (channel, exchange, kind) -> flag slot, numbered as first used
        self.keep: List[Tensor] = []
        link.reserve(offset)
        link.begin()

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

    def close(self) -> None:
        """The end of the call (:meth:`Link.end`): the sent tensors may then go."""
        self.link.end()
        self.link.rt.retire(self.keep, (self.link.send,))
        self.keep = []
