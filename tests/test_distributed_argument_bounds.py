"""Distributed calls with arguments far past the inputs, and cross-rank errors inside subgroups, on 4 gloo ranks:
ring_dilated_attention with a dilation rate of 10**12 (computed in time independent of the rate, or refused by
name), and hybrid_attention's option check naming the global ranks and the group that differ."""
from __future__ import annotations

import signal

from _ranks import cases_fixture, check_case, compare, expect_value_error, gloo_group, grid_groups, normal, run_cases

WORLD = 4
TIMEOUT_S = 120
HUGE = 10 ** 12
CASES = ("ring-dilated-huge-rate", "hybrid-mismatch-names-global-ranks")


def _ring_dilated_huge_rate() -> None:
    """Branches inside a shard (4 rows): rate 10**12 leaves each head its offset row of each segment. A segment
    across shards with that rate is refused by name (its rows are not the same on every shard)."""
    import torch.distributed as dist

    from longattn import reference
    from longattn.distributed import ring_dilated_attention

    rank = dist.get_rank()
    q, k, v = (normal(seed, 1, 16, 4, 8) for seed in range(3))
    kw = dict(segment_lengths=(4, 2), dilation_rates=(HUGE, HUGE), causal=True)
    rows = slice(4 * rank, 4 * rank + 4)
    out = ring_dilated_attention(q[:, rows], k[:, rows], v[:, rows], backend="torch", **kw)
    compare("out", out, reference.dilated_attention(q, k, v, **kw)[:, rows])
    expect_value_error(lambda: ring_dilated_attention(q[:, rows], k[:, rows], v[:, rows], segment_lengths=(16,),
                                                     dilation_rates=(HUGE,), backend="torch"),
                       "ring_dilated_attention", "divisible by the dilation rate 1000000000000")


def _hybrid_mismatch(ring, uly) -> None:
    """Global rank 3 (rank 1 of its Ulysses group [2, 3]) passes causal=True, the others False."""
    import torch.distributed as dist

    from longattn.distributed import hybrid_attention

    x = normal(0, 1, 4, 4, 8)
    causal = dist.get_rank() == 3
    expect_value_error(lambda: hybrid_attention(x, x, x, ring_group=ring, ulysses_group=uly, causal=causal,
                                                backend="torch"),
                       "hybrid_attention", "the Ulysses group of global ranks [2, 3]", "option causal differs",
                       "rank 2 has False", "rank 3 has True")


def _case(name: str, groups) -> None:
    def expired(*_):
        raise TimeoutError(f"{name} took more than 5 s")

    signal.signal(signal.SIGALRM, expired)  # a hang or a growing allocation is cut short, not left to fill memory
    signal.setitimer(signal.ITIMER_REAL, 5)
    try:
        if name == "ring-dilated-huge-rate":
            _ring_dilated_huge_rate()
        else:
            _hybrid_mismatch(*groups)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        groups = grid_groups(2, world // 2)
        run_cases(rank, store_dir, CASES, lambda name: _case(name, groups))


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "argument bound workers")


def test_ring_dilated_attention_with_a_rate_past_the_sequence_matches_the_reference(results):
    check_case(results, "ring-dilated-huge-rate")


def test_hybrid_option_mismatch_names_global_ranks_and_the_group(results):
    check_case(results, "hybrid-mismatch-names-global-ranks")
