"""A rank that dies in Ulysses (2 processes) or in the hybrid (a 2 x 2 grid): the others must end with an error
within the process-group timeout, never hang (CPU, gloo). The ring's own test is
``test_distributed.test_a_dead_rank_ends_the_others_with_an_error``.
"""
from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEAD_RANK_TIMEOUT_S = 10
DYING = 1  # the rank that dies
WORLDS = {"ulysses": 2, "hybrid": 4}


def _full(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _attention(kind: str, world: int):
    """``(shards of q, k, v, attention(q, k, v))`` of this rank. The hybrid's 2 x 2 grid: Ulysses groups {0, 1} and
    {2, 3}, ring groups {0, 2} and {1, 3}; built with the short timeout (``new_group`` does not take the world's)."""
    from longattn.distributed import hybrid_attention, shard, shard_hybrid, ulysses_attention

    full = [_full(s, 1, 16 * world, 2, 8) for s in (1, 2, 3)]
    if kind == "ulysses":
        return [shard(t).requires_grad_() for t in full], lambda q, k, v: ulysses_attention(
            q, k, v, layout="zigzag", causal=True, backend="torch")
    rank, timeout = dist.get_rank(), timedelta(seconds=DEAD_RANK_TIMEOUT_S)
    ulysses = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)][rank // 2]
    ring = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 3], timeout=timeout)][rank % 2]
    return [shard_hybrid(t, ring, ulysses).requires_grad_() for t in full], lambda q, k, v: hybrid_attention(
        q, k, v, ring_group=ring, ulysses_group=ulysses, causal=True, backend="torch")


def _dying_worker(rank: int, world: int, store_dir: str, kind: str, when: str) -> None:
    from longattn import ops, runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=DEAD_RANK_TIMEOUT_S))
    # Every rank's connections are up before one dies (else a peer still connecting fails inside
    # init_process_group, before the call this test is about).
    dist.barrier()
    start = time.monotonic()
    try:
        # (the subgroups are made in here: a survivor may already see the dead rank while it makes them)
        (q, k, v), attention = _attention(kind, world)
        if rank == DYING and when == "before-the-call":
            os._exit(3)
        if rank == DYING:  # at its second local attention call (Ulysses: between the all-to-alls; hybrid: the ring)
            module, name = (runner, "run") if kind == "ulysses" else (ops, "attention_forward")
            real, calls = getattr(module, name), []

            def dying(*args, **kwargs):
                calls.append(1)
                if len(calls) == 2:
                    if when == "stuck-inside-the-call":  # alive but never answering again
                        time.sleep(10 * DEAD_RANK_TIMEOUT_S)
                    os._exit(3)
                return real(*args, **kwargs)

            setattr(module, name, dying)
        for _ in range(3):  # training steps; a rank that is gone must stop them
            attention(q, k, v).sum().backward()
        outcome = None
    except Exception as e:  # what the survivors must see
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
    with open(os.path.join(store_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((outcome, time.monotonic() - start), f)
    os._exit(0)  # no destroy_process_group: its peers are gone


# A rank that stops answering (alive, "stuck") ends the others at the group's timeout: checked when written (10-11 s
# each), left out of the suite for its time; a rank that exits ends them at once.
@pytest.mark.parametrize("when", ["before-the-call", "inside-the-call"])
@pytest.mark.parametrize("kind", list(WORLDS))
def test_a_dead_rank_ends_the_others_with_an_error(tmp_path, kind, when):
    """Rank 1 exits before the call or inside it (Ulysses: in its local attention, while rank 0 waits in the
    all-to-all; hybrid: in the ring): every other rank gets an exception (gloo: at once, when the peer's connection
    closes), also one that sees it go while it is still making the hybrid's subgroups."""
    world = WORLDS[kind]
    survivors = [r for r in range(world) if r != DYING]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dying_worker, args=(r, world, str(tmp_path), kind, when)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEAD_RANK_TIMEOUT_S + 60  # process start-up and imports included
    for r in survivors:
        procs[r].join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r in survivors if procs[r].is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running {DEAD_RANK_TIMEOUT_S + 60} s after rank {DYING} left {kind}"
    for r in survivors:
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            outcome, seconds = pickle.load(f)
        assert outcome is not None, f"rank {r} ran three {kind} steps although rank {DYING} died"
        assert seconds <= DEAD_RANK_TIMEOUT_S + 5, (r, seconds, outcome)
