"""A simulated machine for the copy-engine transfers (:class:`longattn.distributed.copy_engine.CudaRuntime`'s
interface), on the CPU, with threads as ranks.

- Memory is host memory: "device" tensors are CPU tensors, a pointer is a real address, and the strided copies
  are ``ctypes.memmove`` row by row. Symmetric memory is a list of buffers every rank of a group sees; a copy must
  lie wholly inside one live symmetric buffer on one side (the workspace it reads or writes), else it is recorded
  as an error instead of being made.
- Every stream (the caller's "current" stream too) is a queue worked by a thread of its own, in order; a random
  sleep before each operation (``jitter``, now and then 30 times longer) varies the interleavings. Flag writes store the value, flag waits block
  their stream until the driver's condition holds (32-bit: ``(int32)(*addr - value) >= 0``, as the driver compares;
  64-bit: ``*addr >= value``). Events are set when their stream reaches them.
- Collectives (agree, barrier, rendezvous) are exchanges between the rank threads.
- Nothing blocks forever: any wait (a stream's, or the host's) longer than ``limit`` seconds raises :class:`Hang`
  (recorded for a stream); :meth:`Machine.kill` makes a rank's streams and host stop (a dead peer), ``frozen``
  ranks' streams only (a GPU that hangs).
- ``retire`` holds what it is given until the streams pass (as ``record_stream`` would); where the caller says its
  stream has joined the streams (the real runtime then does nothing: the caching allocator hands the memory only to
  later work on the caller's stream), the caller's stream must have waited for every copy, flag write and flag wait
  queued on them, else an error is recorded (the memory would go to a new tensor while a stream still reads it).

Failures are injected by name (:meth:`Machine.inject`): ``"symm_empty"``, ``"empty"`` (a call's own buffers),
``"rendezvous"`` (before its exchange), ``"mapping"`` (the rendezvous, after its exchange: the peers went through
it), ``"write"``, ``"wait"``, ``"memcpy"`` raise the given exception on the given ranks.
"""
from __future__ import annotations

import contextlib
import ctypes
import queue
import random
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from longattn.distributed import poison, shards


class Hang(RuntimeError):
    """A wait that went on past the machine's limit: in a real run, a hang."""


class Killed(RuntimeError):
    """The rank was killed (its streams and host calls stop)."""


class Group:
    """A process group of the simulated machine (every rank thread holds the same object)."""

    def __init__(self, world: int, name: str = "fake", timeout_s: float = 1800.0):
        self.world, self.group_name, self.timeout_s = world, name, timeout_s

    def size(self) -> int:
        return self.world


class Event:
    def __init__(self, machine: "Machine", rank: int):
        self.machine, self.rank, self.flag = machine, rank, threading.Event()

    def set(self) -> None:
        self.flag.set()
        self.machine.notify()

    def query(self) -> bool:
        return self.flag.is_set()

    def synchronize(self) -> None:
        self.machine.block(self.rank, self.query, "the host waiting for an event")


class Stream:
    """A queue of operations worked in order by a thread."""

    def __init__(self, machine: "Machine", rank: int, name: str):
        self.machine, self.rank, self.name = machine, rank, name
        self.device = torch.device("cpu")
        self.q: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self.dead = False
        self.work = 0  # copies, flag writes and flag waits queued so far (the host's count)
        self.joined: Dict["Stream", int] = {}  # stream -> its work this stream waited for (wait_stream)
        self.thread = threading.Thread(target=self._work, name=f"fake-stream-r{rank}-{name}", daemon=True)
        self.thread.start()

    def put(self, op: Callable[[], None]) -> None:
        self.q.put(op)

    def _work(self) -> None:
        m = self.machine
        while True:
            op = self.q.get()
            if op is None:
                return
            if self.dead or self.rank in m.killed or self.rank in m.frozen:
                continue  # (a dead stream drops what follows; its events never fire)
            if m.jitter:  # (now and then a long delay: one stream far behind the others)
                time.sleep(m.rng.random() * m.jitter * (30 if m.rng.random() < 0.05 else 1))
            try:
                op()
            except Killed:
                self.dead = True
            except Exception as e:  # noqa: BLE001 (recorded: the test fails on it)
                self.dead = True
                m.errors.append(f"rank {self.rank} stream {self.name}: {type(e).__name__}: {e}")
                m.notify()

    def record_event(self) -> Event:
        ev = Event(self.machine, self.rank)
        self.put(ev.set)
        return ev

    def wait_event(self, ev: Event) -> None:
        self.put(lambda: self.machine.block(self.rank, ev.query, f"stream {self.name} waiting for an event"))

    def wait_stream(self, other: "Stream") -> None:
        self.joined[other] = other.work
        self.wait_event(other.record_event())


class Machine:
    """The simulated machine; also the runtime of every rank thread (``copy_engine.RUNTIME``), which it tells
    apart by the calling thread (:meth:`as_rank`)."""

    def __init__(self, world: int, *, jitter: float = 0.0, seed: int = 0, limit: float = 20.0):
        self.world, self.jitter, self.limit = world, jitter, limit
        self.rng = random.Random(seed)
        self.cond = threading.Condition()
        self.local = threading.local()
        self.buffers: List[tuple] = []  # (start, end, tensor, rank) of live symmetric buffers
        self.errors: List[str] = []
        self.killed: set = set()
        self.frozen: set = set()  # ranks whose streams stop (a GPU that hangs) while their host goes on
        self.stopped = False
        self.streams: Dict[int, List[Stream]] = {r: [] for r in range(world)}
        self.currents: Dict[int, Stream] = {}
        self.exchanges: Dict[tuple, dict] = {}
        self.seq: Dict[tuple, int] = {}
        self.injected: Dict[str, tuple] = {}
        self.count: Dict[tuple, int] = {}  # (what, rank) -> calls
        self.possible_on = set(range(world))
        self.group_timeouts: Dict[str, float] = {}

    # -- ranks ------------------------------------------------------------------------------------------------
    def as_rank(self, rank: int) -> None:
        """Make the calling thread rank ``rank``."""
        self.local.rank = rank

    @property
    def rank(self) -> int:
        return self.local.rank

    def kill(self, rank: int) -> None:
        """Rank ``rank`` dies: its streams stop, its pending and later host calls raise :class:`Killed`."""
        self.killed.add(rank)
        self.notify()

    def stop(self) -> None:
        """End every stream thread and wait (test teardown)."""
        self.stopped = True
        self.notify()
        for streams in self.streams.values():
            for s in streams:
                s.put(None)
        for streams in self.streams.values():
            for s in streams:
                s.thread.join(timeout=5)

    def inject(self, what: str, ranks, exc: Exception, times: int = 1) -> None:
        """The next ``times`` calls of ``what`` on any of ``ranks`` raise ``exc``."""
        self.injected[what] = (set(ranks), exc, [times])

    def _maybe_fail(self, what: str) -> None:
        self.count[(what, self.rank)] = self.count.get((what, self.rank), 0) + 1
        got = self.injected.get(what)
        if got is not None and self.rank in got[0] and got[2][0] > 0:
            got[2][0] -= 1
            raise got[1]

    def calls(self, what: str, rank: int) -> int:
        return self.count.get((what, rank), 0)

    # -- waiting ----------------------------------------------------------------------------------------------
    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def block(self, rank: int, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()``; :class:`Killed` if the rank dies or the machine stops, :class:`Hang` after
        :attr:`limit` seconds."""
        deadline = time.monotonic() + self.limit
        with self.cond:
            while not ready():
                if rank in self.killed or self.stopped:
                    raise Killed(f"rank {rank}: {what}")
                if time.monotonic() > deadline:
                    raise Hang(f"rank {rank}: {what}: nothing after {self.limit:g} s")
                self.cond.wait(0.02)

    # -- the runtime's interface -----------------------------------------------------------------------------
    def scope(self):
        return self.rank

    def possible(self, group, device) -> bool:
        return self.rank in self.possible_on

    def capturing(self) -> bool:
        return False

    def stream(self, device) -> Stream:
        s = Stream(self, self.rank, f"side{len(self.streams[self.rank])}")
        self.streams[self.rank].append(s)
        return s

    def current(self, device=None) -> Stream:
        r = self.rank
        if r not in self.currents:
            self.currents[r] = Stream(self, r, "current")
            self.streams[r].append(self.currents[r])
        return self.currents[r]

    def synchronize(self, device=None) -> None:
        if self.rank in self.killed:
            raise Killed(f"rank {self.rank}")
        self.current()
        for s in list(self.streams[self.rank]):
            s.record_event().synchronize()

    def launch(self, fn: Callable[[], None]) -> None:
        """A "kernel" on this rank's current stream (tests)."""
        self.current().put(fn)

    def poison(self, flags: torch.Tensor, mark: int, outputs) -> None:
        self.launch(lambda: poison.poison(flags, mark, outputs))

    def _symmetric(self, start: int, length: int) -> bool:
        return any(a <= start and start + length <= b for a, b, _, _ in self.buffers)

    def memcpy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                 stream: Stream) -> None:
        self._maybe_fail("memcpy")
        if width > dst_pitch or width > src_pitch:
            raise ValueError("memcpy2d: width beyond a pitch")

        def run():
            span_d, span_s = (height - 1) * dst_pitch + width, (height - 1) * src_pitch + width
            if not (self._symmetric(dst, span_d) or self._symmetric(src, span_s)):
                raise RuntimeError(f"a copy outside the symmetric memory: dst {dst:#x}+{span_d}, src {src:#x}+"
                                   f"{span_s}")
            for i in range(height):
                ctypes.memmove(dst + i * dst_pitch, src + i * src_pitch, width)
        stream.work += 1
        stream.put(run)

    def write(self, stream: Stream, address: int, value: int, bits: int = 32) -> None:
        self._maybe_fail("write")

        def run():
            if not self._symmetric(address, bits // 8):
                raise RuntimeError(f"a flag write outside the symmetric memory: {address:#x}")
            cell = (ctypes.c_uint32 if bits == 32 else ctypes.c_uint64).from_address(address)
            cell.value = value & ((1 << bits) - 1)
            self.notify()
        stream.work += 1
        stream.put(run)

    def wait(self, stream: Stream, address: int, value: int, bits: int = 32) -> None:
        self._maybe_fail("wait")
        rank = self.rank

        def ready() -> bool:
            if bits == 32:
                now = ctypes.c_uint32.from_address(address).value
                return ctypes.c_int32((now - value) & 0xFFFFFFFF).value >= 0
            return ctypes.c_uint64.from_address(address).value >= value
        stream.work += 1
        stream.put(lambda: self.block(rank, ready, f"stream {stream.name} waiting for flag {address:#x} >= {value}"))

    def symm_empty(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        self._maybe_fail("symm_empty")
        t = torch.zeros(numel, dtype=dtype)
        start = t.data_ptr()
        with self.cond:
            self.buffers.append((start, start + t.numel() * t.element_size(), t, self.rank))
        return t

    def free(self, t: torch.Tensor) -> None:
        """A symmetric buffer goes (later copies into it are errors)."""
        with self.cond:
            self.buffers = [b for b in self.buffers if b[2] is not t]

    def exchange(self, group: Group, value, what: str) -> list:
        """Every rank's ``value`` (a collective on ``group``), in rank order."""
        return self._collect(self._post(group, value, what), group, what)

    def _post(self, group: Group, value, what: str) -> dict:
        """This rank's part of the next collective on ``group`` (no wait); the collective's slot."""
        r, name = self.rank, group.group_name
        with self.cond:
            n = self.seq[(r, name)] = self.seq.get((r, name), 0) + 1
            slot = self.exchanges.setdefault((name, n), {})
            slot[r] = (what, value)
            self.cond.notify_all()
        return slot

    def _collect(self, slot: dict, group: Group, what: str, rank: Optional[int] = None) -> list:
        """Wait for every rank's part of the collective ``slot``."""
        self.block(self.rank if rank is None else rank, lambda: len(slot) == group.world,
                   f"the host in a collective ({what})")
        kinds = {w for w, _ in slot.values()}
        if len(kinds) > 1:
            raise RuntimeError(f"mismatched collectives: {sorted(kinds)}")
        return [slot[i][1] for i in range(group.world)]

    def rendezvous(self, buffer: torch.Tensor, group: Group, world: int) -> tuple:
        self._maybe_fail("rendezvous")
        self.count[("rendezvous-done", self.rank)] = self.calls("rendezvous-done", self.rank) + 1
        buffers = self.exchange(group, buffer, "rendezvous")
        self._maybe_fail("mapping")
        return None, buffers

    def agree(self, group: Group, ok: bool) -> bool:
        return all(self.exchange(group, bool(ok), "agree"))

    def barrier(self, group: Group, device=None) -> None:
        self.exchange(group, None, "barrier")

    def same_host(self, group: Group, world: int) -> bool:
        return True

    def retire(self, tensors, streams, joined: bool = True) -> None:
        held = list(tensors)
        current = self.current()
        late = [s.name for s in streams if held and s.work and current.joined.get(s, 0) < s.work]
        if joined and late:
            self.errors.append(f"rank {self.rank}: tensors retired as if the caller's stream had waited for "
                               f"{late}, which may still read them: the caching allocator would hand them out")
        for s in streams:
            s.put(lambda held=held: None)

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        self._maybe_fail("empty")
        return torch.empty(tuple(shape), dtype=dtype)

    def gather(self, group: Group, world: int, values, purpose: str) -> list:
        """As the real one: fixed-size records (any two gathers pair), each rank's purpose checked."""
        return self.start_gather(group, world, values, purpose).result()

    def start_gather(self, group: Group, world: int, values, purpose: str) -> "Agreement":
        """:meth:`gather` posted without waiting."""
        return Agreement(self, group, self._post(group, tuple(shards._record(purpose, values)), "gather"), purpose)

    def group_timeout(self, group: Group) -> float:
        return group.timeout_s


class Agreement:
    """A gather under way (:meth:`Machine.start_gather`): ``done()`` without waiting, ``result()``."""

    def __init__(self, machine: Machine, group: Group, slot: dict, purpose: str):
        self.machine, self.group, self.slot, self.purpose = machine, group, slot, purpose
        self.rank = machine.rank

    def done(self) -> bool:
        m = self.machine
        return len(self.slot) == self.group.world or self.rank in m.killed or m.stopped

    def result(self) -> list:
        records = self.machine._collect(self.slot, self.group, "gather", self.rank)
        return shards.read_records(records, self.purpose, f"process group {self.group.group_name!r}")


def run_ranks(machine: Machine, fn: Callable[[int], object], timeout: float = 60.0) -> List[object]:
    """``fn(rank)`` on a thread per rank of ``machine``; returns each rank's result or the exception it raised.
    Raises ``AssertionError`` if a rank is still running after ``timeout`` seconds (a hang) or a stream recorded an
    error."""
    results: List[object] = [None] * machine.world

    def body(r: int) -> None:
        machine.as_rank(r)
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 (returned to the test)
            results[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(machine.world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        machine.stop()
        raise AssertionError(f"ranks {alive} hung (after {timeout:g} s); results: {results}")
    return results


@contextlib.contextmanager
def machines(monkeypatch, **defaults):
    """``make(world, **kw)``: simulated machines, each installed in turn as the transfers' runtime
    (``copy_engine.RUNTIME``, with no links kept from before), ``defaults`` under each one's own keywords; every one
    made is stopped on the way out."""
    from longattn.distributed import copy_engine

    made = []

    def make(world: int, **kw) -> "Machine":
        m = Machine(world, **{**defaults, **kw})
        monkeypatch.setattr(copy_engine, "RUNTIME", m)
        monkeypatch.setattr(copy_engine, "_LINKS", {})
        made.append(m)
        return m
    try:
        yield make
    finally:
        for m in made:
            m.stop()
