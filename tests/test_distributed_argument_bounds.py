"""Distributed calls with arguments far past the inputs, and cross-rank errors inside subgroups, on 4 gloo ranks:
ring_dilated_attention with a dilation rate of 10**12 (computed in time independent of the rate, or refused by
name), hybrid_attention's option check naming the global ranks and the group that differ, zero-size calls (no batch
rows, no query heads) and a rank outside the group it passes."""
from __future__ import annotations

import signal

from _ranks import cases_fixture, check_case, compare, expect_value_error, gloo_group, grid_groups, normal, run_cases

WORLD = 4
TIMEOUT_S = 120
HUGE = 10 ** 12
CASES = ("ring-dilated-huge-rate", "hybrid-mismatch-names-global-ranks", "zero-size-calls", "non-member-group")


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


def _zero_size_calls(ring, uly) -> None:
    """Zero-size calls return zero-size results with gradients, as the single-device functions do (README: no batch,
    queries, query heads or keys): ring_dilated_attention with no batch rows and a segment spanning ranks (a view
    of ``-1`` windows of 0 elements raised), and every function with no query heads (a division by the key/value
    head count, or a head-group split, raised deep inside)."""
    import torch

    from longattn.distributed import (hybrid_attention, ring_attention, ring_dilated_attention, ulysses_attention,
                                      ulysses_dilated_attention)

    dil = dict(segment_lengths=(2, 16), dilation_rates=(1, 2))
    q = torch.zeros(0, 4, 4, 8, dtype=torch.float64, requires_grad=True)
    out = ring_dilated_attention(q, q, q, causal=True, backend="torch", **dil)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape
    calls = {
        "ring_attention": lambda q, k: ring_attention(q, k, k, causal=True, return_lse=True, backend="torch"),
        "ulysses_attention": lambda q, k: ulysses_attention(q, k, k, causal=True, return_lse=True, backend="torch"),
        "hybrid_attention": lambda q, k: hybrid_attention(q, k, k, ring_group=ring, ulysses_group=uly, causal=True,
                                                          return_lse=True, backend="torch"),
        "ulysses_dilated_attention": lambda q, k: ulysses_dilated_attention(q, k, k, return_lse=True,
                                                                            backend="torch", **dil),
    }
    for name, call in calls.items():
        for hk in (0, 2):
            q = torch.zeros(1, 4, 0, 8, dtype=torch.float64, requires_grad=True)
            k = torch.zeros(1, 4, hk, 8, dtype=torch.float64, requires_grad=True)
            out, lse = call(q, k)
            out.sum().backward()
            assert out.shape == (1, 4, 0, 8) and lse.shape == (1, 0, 4), (name, hk, out.shape, lse.shape)
            assert k.grad is not None and not k.grad.any(), (name, hk)


def _non_member_group() -> None:
    """A group that is not a process group is refused by the function's name; a rank that passes the group
    ``dist.new_group`` gave it without making it a member (the int NON_GROUP_MEMBER) gets a ValueError saying so, not
    'got int -100'."""
    import torch.distributed as dist

    from longattn.distributed import ring_attention, shard

    from longattn.distributed import ContextParallel, ring_dilated_attention, ulysses_attention, unshard
    from torch.distributed.device_mesh import init_device_mesh

    x = normal(0, 1, 4, 2, 8)
    for fn, call in (("ring_attention", lambda: ring_attention(x, x, x, group=5)),
                     ("ulysses_attention", lambda: ulysses_attention(x, x, x, group=5)),
                     ("ring_dilated_attention", lambda: ring_dilated_attention(
                         x, x, x, segment_lengths=(4,), dilation_rates=(1,), group=5)),
                     ("unshard", lambda: unshard(x, 5)), ("shard", lambda: shard(x, 5)),
                     ("ContextParallel", lambda: ContextParallel(group=5))):
        try:
            call()
        except TypeError as e:  # (before any collective: every rank raises alone, none waits)
            assert str(e).startswith(f"{fn}: group must be a torch.distributed.ProcessGroup"), e
        else:
            raise AssertionError(f"{fn} took group=5")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        ring_attention(x, x, x, group=mesh)
    except TypeError as e:  # a DeviceMesh: the error says which group to pass
        assert "pass mesh.get_group()" in str(e), e
    else:
        raise AssertionError("ring_attention took a DeviceMesh as its group")
    group = dist.new_group([0, 1])  # (every rank creates it)
    if dist.get_rank() in (0, 1):
        return
    for call in (lambda: ring_attention(x, x, x, group=group), lambda: shard(x, group)):
        expect_value_error(call, "NON_GROUP_MEMBER", "not a member of the group")


def _case(name: str, groups) -> None:
    def expired(*_):
        raise TimeoutError(f"{name} took more than 5 s")

    signal.signal(signal.SIGALRM, expired)  # a hang or a growing allocation is cut short, not left to fill memory
    signal.setitimer(signal.ITIMER_REAL, 5)
    try:
        if name == "ring-dilated-huge-rate":
            _ring_dilated_huge_rate()
        elif name == "zero-size-calls":
            _zero_size_calls(*groups)
        elif name == "non-member-group":
            _non_member_group()
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


def test_zero_size_calls_return_zero_size_results(results):
    check_case(results, "zero-size-calls")


def test_a_rank_outside_the_group_is_told_so(results):
    check_case(results, "non-member-group")
