"""The sequence-parallel functions follow SDPA's autocast rule, as the single-process ones do: under
``torch.autocast("cpu", torch.bfloat16)`` float32 shards are cast to bfloat16 and the output is bfloat16, with the
answer of the same call on bfloat16 shards outside autocast (4 gloo ranks)."""
from __future__ import annotations

import torch

from _ranks import cases_fixture, check_case, gloo_group, grid_groups, normal, run_cases

WORLD = 4
TIMEOUT_S = 120
CASES = ("ring", "ring-dilated", "ulysses", "ulysses-dilated", "hybrid")


def _case(name: str, groups) -> None:
    import torch.distributed as dist

    from longattn import distributed as D

    rank = dist.get_rank()
    ring, uly = groups
    q, k, v = (normal(seed, 1, 32, 4, 8, dtype=torch.float32)[:, 8 * rank:8 * rank + 8] for seed in range(3))
    dil = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))
    call = {"ring": lambda *x: D.ring_attention(*x, causal=True, backend="torch"),
            "ring-dilated": lambda *x: D.ring_dilated_attention(*x, **dil, backend="torch"),
            "ulysses": lambda *x: D.ulysses_attention(*x, causal=True, backend="torch"),
            "ulysses-dilated": lambda *x: D.ulysses_dilated_attention(*x, **dil, backend="torch"),
            "hybrid": lambda *x: D.hybrid_attention(*x, ring_group=ring, ulysses_group=uly, causal=True,
                                                    backend="torch")}[name]
    with torch.autocast("cpu", torch.bfloat16):
        out = call(q, k, v)
    if out.dtype != torch.bfloat16:
        raise AssertionError(f"{name}: {out.dtype} under bfloat16 autocast")
    want = call(q.bfloat16(), k.bfloat16(), v.bfloat16())
    if not torch.equal(out, want):
        raise AssertionError(f"{name}: differs from the call on bfloat16 shards by {(out - want).abs().max()}")


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        groups = grid_groups(2, world // 2)
        run_cases(rank, store_dir, CASES, lambda name: _case(name, groups))


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "distributed autocast workers")


def test_ring_attention_under_autocast(results):
    check_case(results, "ring")


def test_ring_dilated_attention_under_autocast(results):
    check_case(results, "ring-dilated")


def test_ulysses_attention_under_autocast(results):
    check_case(results, "ulysses")


def test_ulysses_dilated_attention_under_autocast(results):
    check_case(results, "ulysses-dilated")


def test_hybrid_attention_under_autocast(results):
    check_case(results, "hybrid")
