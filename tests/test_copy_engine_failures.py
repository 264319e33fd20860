"""Failures of the copy-engine transfers on the simulated machine (``tests/_fake_cuda.py``): out of memory before
and during a call, an exception half-way, a dead peer, link creation failing on one rank or unsupported, flags
after 2^31 calls, the workspace's growth, the watchdog's clock and timeout, the refusal's advice, odd strides, and
``CUDA_DEVICE_MAX_CONNECTIONS=1``. Every test has a hard time limit: a hang fails it."""
from __future__ import annotations

import time
import warnings

import pytest
import torch

from _fake_cuda import Group, machines, run_ranks
from longattn.distributed import all_to_all, copy_engine, shards
from test_copy_engine_protocol import COPY_ENGINES, CPU, _ok, ring_pass, ulysses_call


@pytest.fixture
def machine_for(monkeypatch):
    """As in the protocol test, with every wait limited to 4 s (a failure must not hang the test)."""
    with machines(monkeypatch, limit=4.0) as make:
        yield make


def _oom() -> Exception:
    return torch.OutOfMemoryError("simulated: CUDA out of memory")


class _Boom(RuntimeError):
    pass


# -- a call that fails on one rank --------------------------------------------------------------------------------

def test_out_of_memory_before_a_call_fails_it_on_every_rank_and_the_next_call_is_right(machine_for):
    """Out of memory on one rank while the call allocates (before any transfer): every rank raises the same
    ``OutOfMemoryError`` (none started the call), and a training loop that skips the batch on every rank goes on
    with calls whose bytes are right (the ranks' call counters stayed together)."""
    world = 3
    m = machine_for(world, jitter=1e-4)
    group = Group(world)
    m.inject("empty", [1], _oom())

    def rank_fn(rank):
        try:
            ulysses_call(m, group, rank, world, layout="contiguous", groups=1, fresh=True, seed=1)
            first = "ran"
        except torch.OutOfMemoryError as e:
            first = str(e)
        for seed in (2, 3):
            ulysses_call(m, group, rank, world, layout="zigzag", groups=2, fresh=False, seed=seed)
        return first

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert len(set(results)) == 1 and "out of memory on rank 1" in results[0], results


def _route_call(m, group, rank: int, world: int):
    """One Ulysses-like call on the copy engines (the "attention": x -> 2x) in which rank 1 raises ``_Boom`` after
    the call started (between receiving and giving) and aborts; the others' output, once their streams are done
    (nothing waits for rank 1 forever)."""
    x = torch.randn(2, 2, world, 4, dtype=torch.float64)
    plan = all_to_all.Plan.of("contiguous", group, world, rank, 2)
    route = all_to_all.open_route(plan, [[all_to_all.Part(x, 0, 1)]], [all_to_all.Out(1, world, 4, x.dtype)],
                                  fresh=False, options=COPY_ENGINES)
    try:
        (xs,) = route.inputs(0)
        if rank == 1:
            raise _Boom("the attention kernel failed")
        y = torch.empty(xs.shape, dtype=xs.dtype)
        m.launch(lambda: y.copy_(2 * xs))
        route.give(0, 0, y)
        (out,) = route.finish()
    except BaseException:
        route.abort()
        raise
    m.synchronize()
    return out


def test_an_exception_half_way_releases_the_peers_and_every_rank_then_refuses_until_release(machine_for):
    """An exception on one rank after the call started (between receiving and giving): its peers are released
    (no stream hangs), the next call raises the same ``RuntimeError`` on every rank, naming the rank and
    ``release()`` (not a TRANSPORT setting, which cannot help), and after ``release()`` on every rank calls are
    right again."""
    world = 3
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def rank_fn(rank):
        try:
            _route_call(m, group, rank, world)
        except _Boom:
            pass
        with pytest.raises(RuntimeError) as refused:
            ulysses_call(m, group, rank, world, layout="contiguous", groups=1, fresh=False, seed=5)
        copy_engine.release(group)
        ulysses_call(m, group, rank, world, layout="contiguous", groups=1, fresh=False, seed=6)
        return str(refused.value)

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert len(set(results)) == 1, results
    assert "rank 1" in results[0] and "release(" in results[0] and "'nccl'" not in results[0], results[0]


def test_a_forward_that_fails_on_one_rank_poisons_the_peers_results_and_release_brings_the_ranks_into_step(
        machine_for):
    """A training step's failure as it happens: rank 1 raises inside a call after it started (its forward) and
    goes to ``release()``; its peers finish that call (their outputs NaN: what rank 1 delivered is not to be
    trusted, and no host waits on the GPU to say so), then start the next call (their backward) and raise
    ``OutOfStep`` naming where each rank is, instead of pairing their agreement with rank 1's (gloo ended the
    process on the sizes' mismatch); after their own ``release()`` every rank is in step and calls are right."""
    world = 3
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def rank_fn(rank):
        events = []
        try:
            out = _route_call(m, group, rank, world)
            events.append("nan" if bool(out.isnan().all()) else "finite")
            _route_call(m, group, rank, world)  # the "backward": its agreement meets rank 1's release
            events.append("second call ran")
        except _Boom:
            events.append("raised")
        except shards.OutOfStep as e:
            events.append(f"out of step: {e.purposes}")
            assert "release(" in str(e), e
        copy_engine.release(group)
        ulysses_call(m, group, rank, world, layout="contiguous", groups=1, fresh=False, seed=7)
        return events

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert results[1] == ["raised"], results
    for r in (0, 2):
        assert results[r][0] == "nan", results
        assert results[r][1].startswith("out of step") and "release" in results[r][1], results


def test_an_abort_never_overtakes_an_earlier_call_a_peer_is_still_in(machine_for):
    """Rank 1's GPU is still in call N (a long kernel before its send) when its host aborts call N + 1: the abort's
    flags wait for what the side streams hold of call N, so rank 0's call N receives rank 1's block (the flags
    wait "greater or equal", and an abort written at once released call N early: rank 0 read zeros, no NaN)."""
    world, n = 2, 8
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def exchanged(ex, kv):  # one exchange, what arrived copied out "on the GPU", the call closed
        got = torch.zeros(n, dtype=torch.float64)
        incoming, works = ex.exchange("kv", kv)
        for w in works:
            w.wait()
        m.launch(lambda: got.copy_(incoming))
        ex.close([got])
        return got

    def rank_fn(rank):
        link = copy_engine.link(group, world, rank, CPU)
        ex = copy_engine.RingExchange(link, (rank + 1) % world, (rank - 1) % world, {"kv": 8 * n})
        if rank == 1:
            m.launch(lambda: time.sleep(0.5))  # rank 1's GPU behind its host
        kv = torch.full((n,), 10.0 + rank, dtype=torch.float64)
        got = exchanged(ex, kv)
        ex2 = copy_engine.RingExchange(link, (rank + 1) % world, (rank - 1) % world, {"kv": 8 * n})
        if rank == 1:  # call N + 1 fails on the host right after it started
            ex2.abort()
        else:
            exchanged(ex2, kv)
        m.synchronize()
        return got.clone()

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert torch.equal(results[0], torch.full((n,), 11.0, dtype=torch.float64)), results[0]


def test_a_ring_rank_two_hops_from_an_abort_gets_nan_not_relayed_garbage(machine_for, monkeypatch):
    """Rank 0 fails before its first send; rank 1 is released by its flags and relays what its workspace held to
    rank 2, under valid flags. Rank 0's abort marks every peer's abort cell before any flag slot, so rank 2's
    result of the call is NaN however slowly rank 0's host issues its writes (it was finite garbage)."""
    world, n = 4, 8
    m = machine_for(world, jitter=1e-4)
    group = Group(world)
    real_write = m.write

    def slow_write(stream, address, value, bits=32):  # each of the abort's writes a little host time
        if value >= copy_engine.ABORTED:
            time.sleep(0.002)
        return real_write(stream, address, value, bits)

    monkeypatch.setattr(m, "write", slow_write)

    def rank_fn(rank):
        link = copy_engine.link(group, world, rank, CPU)
        ex = copy_engine.RingExchange(link, (rank + 1) % world, (rank - 1) % world, {"kv": 8 * n})
        kv = torch.full((n,), float(rank), dtype=torch.float64)
        seen = torch.zeros(world, n, dtype=torch.float64)
        try:
            for step in range(world):
                if rank == 0 and step == 0:
                    raise _Boom("a kernel failed before the first send")
                incoming, works = ex.exchange("kv", kv) if step < world - 1 else (None, [])
                m.launch(lambda kv=kv, step=step: seen[step].copy_(kv))
                for w in works:
                    w.wait()
                if incoming is not None:
                    kv = incoming
            ex.close([seen])
        except _Boom:
            ex.abort()
            m.synchronize()
            return None
        m.synchronize()
        return seen.clone()

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    for r in (1, 2, 3):
        assert bool(results[r].isnan().all()), (r, results[r])


def test_agreement_records_are_one_size_and_name_each_ranks_agreement():
    """Every host agreement is the same number of integers whatever it carries, so ranks in different agreements
    pair without the collective library failing; reading them names each rank's."""
    sizes = {len(shards._record(p, v)) for p in shards.PURPOSES for v in ((), (1,), (1, 2, 3))}
    assert len(sizes) == 1
    rows = [shards._record("start", (5, 0, 0)), shards._record("check", (0, 123))]
    assert shards.read_records([shards._record("check", (1, 2))] * 2, "check") == [(1, 2), (1, 2)]
    with pytest.raises(shards.OutOfStep) as e:
        shards.read_records(rows, "start", "process group 'g'")
    assert e.value.purposes == ["start", "check"]
    assert "rank 0 is starting a copy-engine call" in str(e.value) and "rank 1 is checking" in str(e.value)
    assert "'g'" in str(e.value)
    with pytest.raises(ValueError, match="at most"):
        shards._record("check", (1, 2, 3, 4, 5))


def _ring_exchange(group, world: int, rank: int):
    """This rank's ring exchange of one 64-byte buffer ``"kv"`` on the group's link."""
    link = copy_engine.link(group, world, rank, CPU)
    return copy_engine.RingExchange(link, (rank + 1) % world, (rank - 1) % world, {"kv": 64})


def test_a_ring_pass_that_fails_half_way_releases_its_peers(machine_for):
    """The ring: one rank fails after its first exchange and aborts; the others finish their pass (no hang) and
    every rank then refuses the next pass until ``release()``."""
    world = 4
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def rank_fn(rank):
        ex = _ring_exchange(group, world, rank)
        try:
            for step in range(world - 1):
                incoming, works = ex.exchange("kv", torch.full((8,), float(rank), dtype=torch.float64))
                if rank == 2:
                    raise _Boom("a kernel failed")
                for w in works:
                    w.wait()
            ex.close()
        except _Boom:
            ex.abort()
        m.synchronize()
        with pytest.raises(RuntimeError, match="rank 2"):
            ring_pass(m, copy_engine.link(group, world, rank, CPU), rank, world, 5, 0)
        copy_engine.release(group)
        ring_pass(m, copy_engine.link(group, world, rank, CPU), rank, world, 5, 1)

    _ok(run_ranks(m, rank_fn, timeout=30), m)


def test_an_abort_the_driver_refuses_still_fails_the_link_so_every_rank_refuses_the_next_call(machine_for):
    """A call that fails on rank 1 because its GPU is in a sticky error state: the abort's flag writes raise too (its
    peers are not released; the watchdog ends them). The link is failed all the same: rank 1's next call takes part
    in the agreement and every rank raises the same refusal naming it (not "a nested call" on rank 1 while its peers
    wait in the agreement for a rank that never comes)."""
    world = 3
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def rank_fn(rank):
        ex = _ring_exchange(group, world, rank)
        try:
            if rank == 1:
                m.inject("write", [1], RuntimeError("simulated: CUDA_ERROR_ILLEGAL_ADDRESS"), times=10 ** 6)
                raise _Boom("a kernel failed")
            incoming, works = ex.exchange("kv", torch.full((8,), float(rank), dtype=torch.float64))
            for w in works:
                w.wait()
            ex.close()
        except _Boom:
            with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS"):
                ex.abort()
            m.injected.clear()
        with pytest.raises(RuntimeError) as refused:
            ring_pass(m, copy_engine.link(group, world, rank, CPU), rank, world, 5, 1)
        return str(refused.value)

    results = run_ranks(m, rank_fn, timeout=30)
    assert all(isinstance(r, str) for r in results), results
    assert len(set(results)) == 1 and "rank 1" in results[0] and "release(" in results[0], results


# -- flags ---------------------------------------------------------------------------------------------------------

def test_a_flag_left_unwritten_for_2_31_calls_does_not_look_written(machine_for):
    """A flag slot not written for 2^31 calls (all zero here, the call counter past 2^31) must not let a wait pass
    before its signal: the late rank's block is received, not what the workspace held."""
    world = 2
    m = machine_for(world)
    group = Group(world)

    def rank_fn(rank):
        link = copy_engine.link(group, world, rank, CPU)
        link.epoch = 2 ** 31 + 3
        if rank == 1:
            time.sleep(0.3)  # (rank 0's waits come first)
        ring_pass(m, link, rank, world, 6, 0)

    _ok(run_ranks(m, rank_fn, timeout=30), m)


# -- the workspace -----------------------------------------------------------------------------------------------

def test_the_workspace_grows_geometrically_and_is_reserved_for_the_backward_at_the_first_call(machine_for):
    """Calls whose sizes grow a little each time (a varlen batch's new maxima) rendezvous a few times, not at each
    new maximum; a forward told the backward's size (``reserve``) grows no more at the backward."""
    world = 2
    m = machine_for(world)
    group = Group(world)

    def rank_fn(rank):
        link = copy_engine.link(group, world, rank, CPU)
        base = m.calls("rendezvous-done", rank)
        for i in range(12):
            n = (1 << 17) + 2000 * i  # 1 MiB of float64 and more, 1.5% a call
            ring_pass(m, link, rank, world, n, i)
        grown = m.calls("rendezvous-done", rank) - base
        x = torch.randn(1, 4, world, 8, dtype=torch.float64)
        plan = all_to_all.Plan.of("contiguous", group, world, rank, 4)
        big = 64 << 20
        route = all_to_all.open_route(plan, [[all_to_all.Part(x, 0, 1)]], [all_to_all.Out(1, world, 8, x.dtype)],
                                      fresh=False, options=COPY_ENGINES, reserve=big)
        route.inputs(0)
        route.give(0, 0, torch.zeros(1, 4 * world, 1, 8, dtype=torch.float64))
        route.finish()
        before = m.calls("rendezvous-done", rank)
        ex = copy_engine.RingExchange(link, (rank + 1) % world, (rank - 1) % world, {"kv": big // 4})
        ex.close()
        m.synchronize()
        return grown, m.calls("rendezvous-done", rank) - before

    results = _ok(run_ranks(m, rank_fn, timeout=60), m)
    for grown, at_backward in results:
        assert grown <= 2 and at_backward == 0, results


def test_workspace_growth_failing_on_one_rank_fails_on_every_rank(machine_for):
    """Out of memory growing the workspace on one rank: every rank raises ``OutOfMemoryError`` (none waits in the
    rendezvous), and the next call works."""
    world = 3
    m = machine_for(world)
    group = Group(world)

    def rank_fn(rank):
        link = copy_engine.link(group, world, rank, CPU)
        m.inject("symm_empty", [2], _oom()) if rank == 2 else None
        with pytest.raises(torch.OutOfMemoryError, match="rank 2"):
            ring_pass(m, link, rank, world, 1 << 18, 0)
        ring_pass(m, copy_engine.link(group, world, rank, CPU), rank, world, 1 << 18, 1)

    _ok(run_ranks(m, rank_fn, timeout=30), m)


# -- link creation -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what, ranks", [("symm_empty", [1]), ("rendezvous", [0, 1, 2]), ("wait", [0, 1, 2]),
                                         ("write", [2]), ("memcpy", [1])])
def test_link_creation_is_agreed_and_probed(machine_for, what, ranks):
    """A failure while making the link on some ranks (symmetric memory, the rendezvous), or stream memory
    operations or peer copies that do not work (found by a probe when the link is made): no rank waits for the
    others, and every rank gets ``None`` (NCCL instead)."""
    world = 3
    m = machine_for(world)
    group = Group(world)
    m.inject(what, ranks, RuntimeError(f"simulated: {what} not supported"), times=99)
    got = _ok(run_ranks(m, lambda rank: copy_engine.link(group, world, rank, CPU), timeout=30), m)
    assert got == [None] * world


def test_max_connections_one_warns(machine_for, monkeypatch):
    """With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one hardware queue (no overlap, and flag waits can
    deadlock against another library's collectives): making a link warns."""
    world = 2
    m = machine_for(world)
    group = Group(world)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _ok(run_ranks(m, lambda rank: copy_engine.link(group, world, rank, CPU), timeout=30), m)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message) for w in seen)


# -- strides -------------------------------------------------------------------------------------------------------

def test_dense_makes_rows_the_copy_engines_read_whatever_the_strides():
    """A length-1 shard of a transposed per-head tensor keeps odd strides through ``.contiguous()``; the dense copy
    must have the standard ones."""
    d_lse = torch.randn(2, 1, 4).transpose(1, 2)  # (B, H, n=1), stride of n: 4
    assert d_lse.is_contiguous() and d_lse.stride(2) != 1
    dense = all_to_all._dense(d_lse, True)
    assert dense.stride() == (4, 1, 1) and torch.equal(dense, d_lse)
    x = torch.randn(2, 3, 4, 1).transpose(2, 3)  # (B, n, H=1, D): the stride of H is not D
    dense = all_to_all._dense(x, False)
    assert dense.stride(2) == x.shape[3] and torch.equal(dense, x)


def test_a_shard_of_one_row_with_a_transposed_lse_gradient_travels(machine_for):
    world = 2
    m = machine_for(world)
    group = Group(world)

    def rank_fn(rank):
        lse = torch.randn(1, 1, world, dtype=torch.float64).transpose(1, 2)  # (B, H, n=1)
        plan = all_to_all.Plan.of("contiguous", group, world, rank, 1)
        route = all_to_all.open_route(plan, [[all_to_all.Part(lse, 0, 1, per_head=True)]],
                                      [all_to_all.Out(1, world, 1, lse.dtype, per_head=True)], fresh=False,
                                      options=COPY_ENGINES)
        (got,) = route.inputs(0)
        y = torch.empty(got.shape, dtype=got.dtype)
        m.launch(lambda: y.copy_(got))
        route.give(0, 0, y)
        (out,) = route.finish()
        m.synchronize()
        assert torch.equal(out, lse)

    _ok(run_ranks(m, rank_fn, timeout=30), m)


# -- the watchdog ----------------------------------------------------------------------------------------------

class _Ev:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def test_the_watchdogs_clock_starts_when_the_gpu_reaches_the_wait_and_its_limit_is_the_groups(monkeypatch):
    """A wait queued behind long work is not timed until the stream reaches it; then it may last the group's
    timeout (here 2 hours), not a fixed 600 s; past it, the process ends."""
    now, exits = [0.0], []
    dog = copy_engine._Watchdog(exit=exits.append, clock=lambda: now[0], period=3600.0)
    before, after = _Ev(), _Ev()
    dog.track(before, after, "group-7", 7200.0)
    now[0] = 10000.0
    assert not dog.check() and not exits  # (the stream has not reached the wait)
    before.done = True
    assert not dog.check()
    now[0] += 601.0
    assert not dog.check() and not exits
    now[0] += 7000.0
    assert dog.check() and exits == [1]
    after.done = True
    exits.clear()
    assert not dog.check() and not exits and not dog.pending


def test_the_watchdog_follows_a_call_from_its_start(machine_for, monkeypatch):
    """A peer dies after the call started, and this rank's host then blocks on the GPU (a ``tolist()`` of ALiBi
    slopes inside a hybrid call, say) before the call's end: the watchdog ends the process all the same."""
    world = 2
    m = machine_for(world, limit=8.0)
    group = Group(world, timeout_s=0.5)
    fired = []

    def end(code):
        fired.append(code)
        m.stop()
    monkeypatch.setattr(copy_engine, "_WATCHDOG", copy_engine._Watchdog(exit=end, period=0.05))

    def rank_fn(rank):
        x = torch.randn(1, 2, world, 4, dtype=torch.float64)
        plan = all_to_all.Plan.of("contiguous", group, world, rank, 2)
        copy_engine.link(group, world, rank, CPU).reserve(1 << 20)  # (no growth in the call)
        if rank == 1:
            m.frozen.add(1)  # (its GPU stops: nothing it queues from now on runs)
        route = all_to_all.open_route(plan, [[all_to_all.Part(x, 0, 1)]], [all_to_all.Out(1, world, 4, x.dtype)],
                                      fresh=False, options=COPY_ENGINES)
        if rank == 1:
            return "dead"
        route.inputs(0)
        m.synchronize()  # (the host reads something the GPU computes after the inputs)
        return "returned"

    results = run_ranks(m, rank_fn, timeout=30)
    assert fired == [1], (fired, results)


def test_the_links_timeout_is_the_calls_options(machine_for, monkeypatch):
    """A link's flag waits are timed by the options of the call that uses it (``copy_engine_timeout_s``; None: the
    group's timeout), chosen through the one transport decision; a module attribute named like the old setting
    changes nothing, and one call's timeout does not stay for the next."""
    from longattn.distributed import ParallelOptions, transport

    world = 2
    m = machine_for(world)
    group = Group(world, timeout_s=120.0)
    monkeypatch.setattr(copy_engine, "TIMEOUT_S", 1e-3, raising=False)

    def rank_fn(rank):
        seen = []
        for timeout_s in (None, 7.5, None):
            name, made = transport.choose(ParallelOptions(transport="copy_engine", copy_engine_timeout_s=timeout_s),
                                          group, world, rank, CPU, fn="test")
            seen.append((name, made.timeout))
        return seen

    got = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert got == [[("copy_engine", 120.0), ("copy_engine", 7.5), ("copy_engine", 120.0)]] * world


# -- a group made again ------------------------------------------------------------------------------------------

def test_a_link_replaced_by_a_group_of_the_same_name_is_drained_before_its_memory_goes(machine_for):
    """A process group destroyed and made again (the same name, a new object): the old link's streams may still
    copy into its workspace and its peers' when the new group's first call comes. Every rank waits for them
    before the first collective of the new link's making, so that no copy lands in memory already handed out
    again, also where no new link is made (the old link was dropped as it stood)."""
    world = 2
    m = machine_for(world)

    def rank_fn(rank):
        old = copy_engine.link(Group(world), world, rank, CPU)
        ring_pass(m, old, rank, world, 5, 0)
        done = []
        old.send.put(lambda: (time.sleep(0.3), done.append(True)))  # (a copy still queued on the old link)
        m.possible_on.discard(rank)  # (the new group runs no copy engine: the old link is simply dropped)
        assert copy_engine.link(Group(world), world, rank, CPU) is None
        return bool(done)

    assert _ok(run_ranks(m, rank_fn, timeout=30), m) == [True] * world


def test_a_workspace_rendezvous_that_fails_on_one_rank_fails_on_every_rank_at_once(machine_for):
    """The workspace's rendezvous raises on rank 1 after its peers came through it (mapping their memory): every
    rank raises the same error naming rank 1 at once (rank 1 left the call while its peers started it and waited
    for its flags until the watchdog ended them), and the next call makes the workspace and delivers."""
    world = 3
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def rank_fn(rank):
        link = copy_engine.link(group, world, rank, CPU)
        m.inject("mapping", [1], RuntimeError("simulated: cuMemMap failed"))
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failed:
            ring_pass(m, link, rank, world, 5, 0)
        assert time.monotonic() - start < 2.0
        ring_pass(m, link, rank, world, 5, 1)
        return str(failed.value)

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert len(set(results)) == 1 and "rendezvous of the workspace" in results[0] and "on rank 1;" in results[0]


# -- two groups ----------------------------------------------------------------------------------------------------

def test_a_failure_on_one_of_two_groups_is_recovered_by_release_all_on_every_rank(machine_for):
    """Two copy-engine groups (a hybrid's, a 2-D grid's), each step a call on A then one on B. Rank 1 fails inside
    a call on A and goes to ``release("all")``; rank 0 gets NaN from that call and goes on to its call on B, whose
    start meets rank 1's release there and raises ``OutOfStep``; rank 0's own ``release("all")`` then brings both
    groups into step and the next steps are right. (``release`` agreed group after group: rank 1 waited in A's
    agreement, rank 0 in B's, until the host collective's timeout.)"""
    world = 2
    m = machine_for(world, jitter=1e-4)
    a, b = Group(world, "a"), Group(world, "b")

    def rank_fn(rank):
        events = []
        for step in range(3):
            try:
                ex = _ring_exchange(a, world, rank)
                got = torch.zeros(8, dtype=torch.float64)
                try:
                    incoming, works = ex.exchange("kv", torch.full((8,), float(rank), dtype=torch.float64))
                    if rank == 1 and step == 1:
                        raise _Boom("a kernel failed")
                    for w in works:
                        w.wait()
                    m.launch(lambda incoming=incoming, got=got: got.copy_(incoming))
                    ex.close([got])
                except _Boom:
                    ex.abort()
                    raise
                m.synchronize()
                events.append("nan" if bool(got.isnan().all()) else "a")
                ring_pass(m, copy_engine.link(b, world, rank, CPU), rank, world, 5, step)
                events.append("b")
            except (_Boom, shards.OutOfStep) as e:
                events.append(type(e).__name__)
                copy_engine.release("all")
        return events

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    assert results == [["a", "b", "nan", "OutOfStep", "a", "b"], ["a", "b", "_Boom", "a", "b"]], results
