"""The copy-engine transfers' protocol (:mod:`longattn.distributed.copy_engine`: ``Link``, ``RingExchange``,
``link()``, ``release()``, and Ulysses' ``CopyRoute``) run for real on a simulated machine (``tests/_fake_cuda.py``:
threads as ranks, every stream a queue worked by its own thread with random delays, copies and flags in host
memory): the bytes every rank receives, over worlds of 2 to 15 ranks, several calls of different sizes (the
workspace grows between them), ``release()``, and that no rank or stream hangs (every wait has a limit)."""
from __future__ import annotations

import pytest
import torch

from _fake_cuda import Group, Hang, Machine, machines, run_ranks
from longattn.distributed import ParallelOptions, all_to_all, copy_engine
from longattn.distributed.shards import take_shard

COPY_ENGINES = ParallelOptions(transport="copy_engine")

CPU = torch.device("cpu")


@pytest.fixture
def machine_for(monkeypatch):
    """``machine_for(world, **kw)``: a simulated machine installed as the transfers' runtime (stopped after)."""
    with machines(monkeypatch) as make:
        yield make


def _ok(results, machine: Machine) -> list:
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert not machine.errors, machine.errors
    return results


# -- the ring --------------------------------------------------------------------------------------------------

def _block(owner: int, n: int, call: int) -> torch.Tensor:
    """Rank ``owner``'s key/value block in call ``call``: values that name it."""
    return torch.arange(n, dtype=torch.float64) + 1000.0 * owner + 1e6 * call


def _contribution(rank: int, owner: int, n: int) -> torch.Tensor:
    return torch.full((n,), float(1 + rank * 16 + owner), dtype=torch.float64)


def ring_pass(m: Machine, link, rank: int, world: int, n: int, call: int) -> None:
    """A ring backward's traffic as ``longattn.distributed.ring`` issues it (key/value blocks round the ring, an
    accumulator travelling with each block home), the "compute" on the caller's stream; checks every received
    block and the accumulators that come home."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    kv = _block(rank, n, call)
    seen = torch.zeros(world, n, dtype=torch.float64)
    ex = copy_engine.RingExchange(link, nxt, prv, {"kv": 8 * n, "dkv": 8 * n})
    dkv_in, dkv_works = None, []
    for step in range(world):
        src = (rank - step) % world
        incoming, works = ex.exchange("kv", kv) if step < world - 1 else (None, [])
        m.launch(lambda kv=kv, step=step: seen[step].copy_(kv))
        for w in dkv_works:
            w.wait()
        dkv = torch.empty(n, dtype=torch.float64)
        m.launch(lambda dkv=dkv, din=dkv_in, src=src: dkv.copy_(
            _contribution(rank, src, n) + (0 if din is None else din)))
        dkv_in, dkv_works = ex.exchange("dkv", dkv)
        for w in works:
            w.wait()
        if incoming is not None:
            kv = incoming
    for w in dkv_works:
        w.wait()
    home = torch.empty(n, dtype=torch.float64)
    m.launch(lambda: home.copy_(dkv_in))
    ex.close()
    m.synchronize()
    for step in range(world):
        assert torch.equal(seen[step], _block((rank - step) % world, n, call)), (rank, step)
    want = sum(_contribution(r, rank, n) for r in range(world))
    assert torch.equal(home, want), (rank, home[:3], want[:3])


@pytest.mark.parametrize("world", range(2, 16))
def test_ring_exchanges_deliver_every_block_in_order(machine_for, world):
    """Worlds 2-15: a few passes of different sizes (the workspace grows between them), with random delays on
    every stream: each rank sees every block in ring order and gets its accumulators home, nothing hangs."""
    m = machine_for(world, jitter=2e-4, seed=world)
    group = Group(world)
    sizes = [3, 40, 5, 160000][: 2 if world > 8 else 4]  # (the last one grows the workspace past its first 1 MiB)

    def rank_fn(rank):
        for call, n in enumerate(sizes):
            link = copy_engine.link(group, world, rank, CPU)
            assert link is not None
            ring_pass(m, link, rank, world, n, call)
        return link.epoch

    assert _ok(run_ranks(m, rank_fn, timeout=60), m) == [len(sizes)] * world


def test_release_makes_a_new_link_that_works(machine_for):
    """``release()`` on every rank between calls: the next call makes a new link (collectively) and delivers."""
    world = 3
    m = machine_for(world, jitter=2e-4)
    group = Group(world)

    def rank_fn(rank):
        first = copy_engine.link(group, world, rank, CPU)
        ring_pass(m, first, rank, world, 7, 0)
        copy_engine.release(group)
        second = copy_engine.link(group, world, rank, CPU)
        assert second is not first
        ring_pass(m, second, rank, world, 9, 1)

    _ok(run_ranks(m, rank_fn), m)


# -- Ulysses' all-to-alls --------------------------------------------------------------------------------------

def _full(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def ulysses_call(m: Machine, group, rank: int, world: int, *, layout: str, groups: int, fresh: bool, seed: int,
                 rows: int = 2, batch: int = 2, dim: int = 4):
    """One call's all-to-alls as ``ulysses._Ulysses`` issues them, on a tensor of rows ``(B, n, H, D)`` and one of
    per-head rows ``(B, H, n)``; the "attention" (x -> 2x + 1, lse -> 3 lse) on the caller's stream. Checks the
    whole sequences each rank receives and the shards it gets back."""
    H, N = world * groups, world * rows
    x_full, l_full = _full(seed, batch, N, H, dim), _full(seed + 1, batch, H, N)
    x, lse = take_shard(x_full, layout, rank, world, 1), take_shard(l_full, layout, rank, world, 2)
    plan = all_to_all.Plan.of(layout, group, world, rank, rows)
    inbound = [[all_to_all.Part(x, c, groups), all_to_all.Part(lse, c, groups, per_head=True)]
               for c in range(groups)]
    outbound = [all_to_all.Out(groups, H, dim, x.dtype), all_to_all.Out(groups, H, 1, lse.dtype, per_head=True)]
    route = all_to_all.open_route(plan, inbound, outbound, fresh=fresh, options=COPY_ENGINES)
    assert isinstance(route, all_to_all.CopyRoute)
    got = []
    for c in range(groups):
        xs, ls = route.inputs(c)
        keep_x, keep_l = torch.empty(xs.shape, dtype=xs.dtype), torch.empty(ls.shape, dtype=ls.dtype)
        y, z = torch.empty(xs.shape, dtype=xs.dtype), torch.empty(ls.shape, dtype=ls.dtype)
        m.launch(lambda xs=xs, ls=ls, a=keep_x, b=keep_l, y=y, z=z: (a.copy_(xs), b.copy_(ls), y.copy_(2 * xs + 1),
                                                                     z.copy_(3 * ls)))
        got.append((c, keep_x, keep_l))
        route.give(0, c, y)
        route.give(1, c, z)
    out, out_lse = route.finish()
    m.synchronize()
    for c, keep_x, keep_l in got:
        h0 = (rank * groups + c)
        assert torch.equal(keep_x, x_full[:, :, h0:h0 + 1]), (rank, c)
        assert torch.equal(keep_l, l_full[:, h0:h0 + 1]), (rank, c)
    assert torch.equal(out, 2 * x + 1) and torch.equal(out_lse, 3 * lse), rank


@pytest.mark.parametrize("world", [2, 3, 4, 5, 7, 8, 11, 15])
def test_ulysses_routes_deliver_every_row(machine_for, world):
    """Worlds up to 15, both layouts, one and two head groups, inputs kept (``fresh``) or read in the workspace,
    calls of different sizes one after another, random delays on every stream."""
    m = machine_for(world, jitter=2e-4, seed=100 + world)
    group = Group(world)
    cases = [("contiguous", 1, False, 2), ("zigzag", 2, True, 4), ("contiguous", 2, False, 6)]

    def rank_fn(rank):
        for i, (layout, groups, fresh, rows) in enumerate(cases[: 2 if world > 8 else 3]):
            ulysses_call(m, group, rank, world, layout=layout, groups=groups, fresh=fresh, seed=10 * i, rows=rows)

    _ok(run_ranks(m, rank_fn, timeout=60), m)


def test_the_simulated_machine_reports_a_wait_that_never_ends(machine_for):
    """The harness itself: a flag nobody writes is a :class:`Hang` after the limit, not a hung test."""
    m = machine_for(1, limit=0.3)
    m.as_rank(0)
    flags = m.symm_empty(4, torch.int32, CPU)
    s = m.stream(CPU)
    m.wait(s, flags.data_ptr(), 1)
    with pytest.raises(Hang):
        s.record_event().synchronize()
    m.limit = 5.0
    m.block(0, lambda: bool(m.errors), "the stream's report")  # (the stream gives up on its own clock)
    assert "Hang" in m.errors[0]


def test_a_first_call_of_empty_shards_runs_and_the_next_ones_deliver(machine_for):
    """An empty sequence (shards of no rows) as a group's first copy-engine call: its regions are views of a
    workspace too (none existed yet: every rank raised ``IndexError`` and the link refused every later call), and
    calls with rows then deliver."""
    world = 3
    m = machine_for(world, jitter=1e-4)
    group = Group(world)

    def rank_fn(rank):
        ulysses_call(m, group, rank, world, layout="zigzag", groups=2, fresh=True, seed=1, rows=0)
        ulysses_call(m, group, rank, world, layout="zigzag", groups=2, fresh=True, seed=2, rows=2)
        copy_engine.release(group)
        ring_pass(m, copy_engine.link(group, world, rank, CPU), rank, world, 0, 0)
        ring_pass(m, copy_engine.link(group, world, rank, CPU), rank, world, 5, 1)

    _ok(run_ranks(m, rank_fn, timeout=30), m)


# -- Ulysses' autograd function on the copy engines ---------------------------------------------------------------

def _attention(q, k, v, first_head, params):
    """The local "kernel" of a Ulysses call: float64 attention with the log-sum-exp (grouped key/value heads)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhnm,bmhd->bnhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("chunks, kv_heads, refused", [(16, 16, True), (20, 1, False)])
def test_ulysses_head_groups_past_what_a_backward_routes_are_refused_at_the_forward(machine_for, monkeypatch,
                                                                                    chunks, kv_heads, refused):
    """Head groups whose backward (three gradients a group) needs more flags than a link has: refused by the
    forward on every rank, before it runs (it ran, and the backward raised after the step's loss); where the
    key/value gradients travel once (fewer key/value heads than groups) 20 groups fit, and the gradients through
    flag slots up to 61 are right (they were refused past 15 groups)."""
    from longattn.distributed import shards, ulysses

    world, n, D = 2, 2, 4
    m = machine_for(world, jitter=1e-5)
    group = Group(world)
    for name in ("inputs", "finish"):  # (the simulated machine runs host ops at once: they wait for the streams)
        real = getattr(all_to_all.CopyRoute, name)
        monkeypatch.setattr(all_to_all.CopyRoute, name,
                            lambda self, *a, real=real, **kw: (real(self, *a, **kw), m.synchronize())[0])
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n * world, h * world, D, generator=gen, dtype=torch.float64).requires_grad_()
            for h in (chunks, kv_heads, kv_heads)]
    weight = torch.randn(1, n * world, chunks * world, D, generator=gen, dtype=torch.float64)
    out, lse = _attention(*full, 0, ())
    ((out * weight).sum() + lse.sum()).backward()

    def rank_fn(rank):
        q, k, v = (take_shard(x.detach(), "contiguous", rank, world, 1).requires_grad_() for x in full)
        plan = all_to_all.Plan.of("contiguous", group, world, rank, n)
        opts = ParallelOptions(transport="copy_engine", head_chunks=chunks)
        try:
            o, l = ulysses._Ulysses.apply(plan, _attention, (chunks, True, True, opts), q, k, v)
        except RuntimeError as e:
            return str(e)
        ((o * take_shard(weight, "contiguous", rank, world, 1)).sum() + l.sum()).backward()
        m.synchronize()
        return [x.grad for x in (q, k, v)]

    results = _ok(run_ranks(m, rank_fn, timeout=30), m)
    if refused:
        assert all(r == results[0] for r in results), results
        assert "at most 15 head groups with a backward, got 16 (ParallelOptions.head_chunks)" in results[0]
        return
    for rank, grads in enumerate(results):
        for got, x in zip(grads, full):
            torch.testing.assert_close(got, shards.take_shard(x.grad, "contiguous", rank, world, 1))
