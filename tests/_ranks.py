"""Test-local helpers of the multi-process tests: the ranks of a gloo process group on the CPU, one spawn per world
size, every case run in every rank and its failure recorded, the tests asserting on the records.

Worker side (a module-level function, as ``torch.multiprocessing.spawn`` needs)::

    def _worker(rank: int, world: int, store_dir: str) -> None:
        with gloo_group(rank, world, store_dir):
            grid = grid_groups(2, world // 2)  # sub-groups: every rank creates every group, in the same order
            run_cases(rank, store_dir, CASES, lambda name: _case(name, grid))

Test side::

    results = cases_fixture(_worker, WORLD_SIZES, TIMEOUT_S, "my workers")

    @pytest.mark.parametrize("case", CASES)
    def test_case(results, case):
        check_case(results, case)

and small checks the cases share (:func:`normal`, :func:`compare`, :func:`expect_error`).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SKIP = "skipped"  # a case's record where a worker did not run it (at this world size)


def spawn_and_wait(fn, args: tuple, world: int, timeout_s: float, what: str) -> None:
    """``fn(rank, *args)`` in ``world`` processes (``torch.multiprocessing.spawn``); raises if one fails or they run
    past ``timeout_s``, and never leaves one running."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} (world {world}) did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------------------------------------------
# worker side

@contextlib.contextmanager
def gloo_group(rank: int, world: int, store_dir: str) -> Iterator[None]:
    """This process as ``rank`` of a gloo process group of ``world`` (a file store in ``store_dir``, a 60 s timeout,
    one CPU thread), destroyed on the way out. A worker's last statement: on a normal exit the process ends right
    there (``os._exit(0)``, its records already written by :func:`run_cases`), because gloo's threads can abort the
    interpreter's finalization (``terminate called without an active exception``, SIGABRT: a worker of
    test_context_parallel_mods ended so once in CI; not reproduced in 30 local runs, so the cause is not proven)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    end_worker()


def end_worker() -> None:
    """A spawned worker's last statement on a normal exit, after ``dist.destroy_process_group()``: the process ends
    there (``os._exit(0)``; its records are already written), because gloo's threads can abort the interpreter's
    finalization (``terminate called without an active exception``: SIGABRT, seen in CI in the option-check and
    context-parallel workers, never reproduced locally). An exception leaves as usual, so spawn reports it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_cases(rank: int, store_dir: str, names: Iterable[str], run_case: Callable[[str], object], *,
              limit: int = 6) -> None:
    """``run_case(name)`` for each of ``names`` in order, with a barrier after each; records None, :data:`SKIP`
    (``run_case`` returned that constant) or the traceback (``limit`` frames) of the exception it raised, and
    writes the records to ``store_dir/rank{rank}.pkl`` for :func:`gathered_results`, also when something else
    fails."""
    results = {}
    try:
        for name in names:
            try:
                results[name] = SKIP if run_case(name) is SKIP else None
            except Exception:  # recorded, reported by the test of that case
                results[name] = traceback.format_exc(limit=limit)
            dist.barrier()
    finally:
        with open(os.path.join(store_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)


def grid_groups(ring: int, uly: int) -> tuple:
    """This rank's ``(ring group, Ulysses group)`` of the ``ring x uly`` grid of the world's ranks, Ulysses over
    consecutive ranks. It creates every group of the grid, as ``new_group`` requires: every rank calls it alike."""
    rank, mine = dist.get_rank(), {}
    for r in range(ring):
        g = dist.new_group(list(range(r * uly, (r + 1) * uly)))
        if rank // uly == r:
            mine["ulysses"] = g
    for u in range(uly):
        g = dist.new_group(list(range(u, ring * uly, uly)))
        if rank % uly == u:
            mine["ring"] = g
    return mine["ring"], mine["ulysses"]


# ----------------------------------------------------------------------------------------------------------------
# test side

def gathered_results(store_dir: str, world: int) -> dict:
    """The records of :func:`run_cases` of ranks ``0 .. world - 1`` merged: ``{case: SKIP}`` or ``{case: [the
    failures, each "rank r:" and its traceback]}`` (an empty list: passed on every rank)."""
    merged = {}
    for rank in range(world):
        with open(os.path.join(store_dir, f"rank{rank}.pkl"), "rb") as f:
            for name, err in pickle.load(f).items():
                if err == SKIP:
                    merged[name] = SKIP
                    continue
                merged.setdefault(name, [])
                if err is not None:
                    merged[name].append(f"rank {rank}:\n{err}")
    return merged


def cases_fixture(worker: Callable[[int, int, str], None], world: int | Sequence[int], timeout_s: float, what: str):
    """A module-scoped fixture (assign it to the name the tests take) that spawns ``worker(rank, world, store_dir)``
    in ``world`` processes (:func:`spawn_and_wait`, ``what`` naming them in its timeout) and gives
    :func:`gathered_results`. ``world`` a sequence: the fixture is parametrized over it (ids ``world2``, ...), one
    spawn per world size."""
    sizes = None if isinstance(world, int) else tuple(world)

    @pytest.fixture(scope="module", params=sizes, ids=None if sizes is None else [f"world{n}" for n in sizes])
    def results(request, tmp_path_factory):
        n = world if sizes is None else request.param
        store_dir = str(tmp_path_factory.mktemp(f"{worker.__module__}_world{n}"))
        spawn_and_wait(worker, (n, store_dir), n, timeout_s, what)
        return gathered_results(store_dir, n)

    return results


def check_case(results: dict, case: str) -> None:
    """Fails with the workers' tracebacks where ``case`` failed on some rank or did not run, skips it where the
    workers recorded :data:`SKIP`."""
    assert case in results, f"{case} did not run"
    if results[case] == SKIP:
        pytest.skip(f"{case} is not run at this world size")
    assert not results[case], "\n".join(results[case])


# ----------------------------------------------------------------------------------------------------------------
# small shared checks (worker side: they raise AssertionError, which run_cases records)

def normal(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard normal values of ``shape`` drawn in float64 from a generator seeded with ``seed``, cast to
    ``dtype``: the same on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 2e-6) -> None:
    """``got`` equal to ``want`` within ``atol`` relative to the largest value of ``want`` (at least 1), compared in
    float64; infinities must be equal (an lse of ``-inf``: a query without keys). Raises AssertionError naming
    ``name``."""
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    got, want = got.double(), want.double()
    inf = torch.isinf(want)
    if not torch.equal(got[inf], want[inf]):
        raise AssertionError(f"{name}: infinities differ")
    got, want = got[~inf], want[~inf]
    err = (got - want).abs().max().item() if got.numel() else 0.0
    largest = want.abs().max().item() if want.numel() else 0.0
    if not err <= atol * max(1.0, largest):
        raise AssertionError(f"{name}: max abs error {err:.3g} (largest value {largest:.3g})")


def expect_error(error: type[Exception], fn: Callable[[], object], *words: str) -> None:
    """``fn()`` raises ``error`` with each of ``words`` in its message; raises AssertionError if not."""
    try:
        fn()
    except error as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            raise AssertionError(f"{error.__name__} without {missing}: {e}") from e
        return
    raise AssertionError(f"no {error.__name__} raised")


def expect_value_error(fn: Callable[[], object], *words: str) -> None:
    """:func:`expect_error` of ``ValueError``."""
    expect_error(ValueError, fn, *words)
