"""Packed batches balanced across ranks: the balanced layout of ``shard`` / ``unshard`` (documents kept
whole where that balances the work, the longest cut in 2P chunks), the ring's packed flash attention on it, and the
work it gives each rank.

The distributed cases run in 2 and 4 gloo processes (one spawn per world size; the workers record each case's
failure, the tests assert on the records) against the float64 reference on the whole packed batch: outputs,
log-sum-exps and the gradients of q, k, v of a loss that reads both, causal or not, grouped-query or not, on batches
whose layout has whole documents, documents cut in chunks and documents cut in runs to fill the ranks, and on
documents of awkward lengths (empty, shorter than 2P, lengths 2P does not divide).
"""
from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch

from _ranks import SKIP, cases_fixture, check_case, compare, expect_value_error, gloo_group, normal, run_cases
from longattn.utils import cu_seqlens_of

WORLD_SIZES = (2, 4)
TIMEOUT_S = 120
# Batches (document lengths) per world size (test_batches_have_the_pieces_they_are_for checks their layouts):
# "mixed" gives every rank whole documents and chunks of documents cut in 2P chunks, and some rank a run of a
# document cut to fill the ranks; "awkward" has documents of every awkward length (empty, one row, shorter than 2P,
# lengths 2P does not divide, cut in chunks or whole); "tiny" cuts documents shorter than 2P in chunks, some of them
# empty; "whole" cuts nothing (no exchange between the ranks).
BATCHES = {
    2: {"mixed": [1, 3, 0, 9, 13, 5, 5], "awkward": [0, 1, 3, 5, 0, 4, 5, 15, 17, 2, 0, 1, 1],
        "tiny": [3, 1, 0, 1, 1], "whole": [6, 2, 0, 6, 2]},
    4: {"mixed": [13, 2, 7, 13, 7, 7, 2, 5, 0], "awkward": [0, 1, 7, 5, 0, 8, 9, 27, 17, 2, 0, 1, 3],
        "tiny": [1, 7, 0, 2, 3, 1, 6, 5, 7], "whole": [6, 2, 6, 2, 0, 6, 2, 6, 2]},
}
# name -> (batch, causal, Hq, Hk)
ATTENTION_CASES = {"mixed-causal-mha": ("mixed", True, 3, 3), "mixed-full-gqa": ("mixed", False, 4, 1),
                   "awkward-causal-gqa": ("awkward", True, 4, 2), "awkward-full-mha": ("awkward", False, 2, 2),
                   "tiny-causal-gqa": ("tiny", True, 4, 2), "tiny-full-gqa": ("tiny", False, 2, 1),
                   "whole-causal-gqa": ("whole", True, 4, 2)}
OTHER_CASES = ("roundtrip", "empty-batch", "errors", "triton-interpreter")
ALL_CASES = tuple(ATTENTION_CASES) + OTHER_CASES


def long_tailed_lengths(total: int, seed: int, low: int = 64, high: int = 16384):
    """Log-uniform document lengths in ``[low, high]`` filling ``total`` rows (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        x = math.exp(math.log(low) + torch.rand((), generator=g).item() * (math.log(high) - math.log(low)))
        lens.append(min(int(x), total - sum(lens)))
    return lens


# ----------------------------------------------------------------------------------------------------------------
# worker side

def _attention_case(world, causal, Hq, Hk, lens, backend="torch", dtype=torch.float64, D=8, atol=2e-6, seed=0):
    """This rank's rows of the packed batch in the balanced layout through the ring's packed flash attention,
    against the float64 reference on the whole batch: out, lse, and dq, dk, dv of a loss reading both."""
    from longattn import reference
    from longattn.distributed import shard, unshard
    from longattn.distributed.ring_varlen import ring_flash_varlen

    cu = cu_seqlens_of(lens, "cpu")
    total = int(cu[-1])
    q, k, v, g = (normal(seed + i, total, h, D).to(dtype).double() for i, h in enumerate((Hq, Hk, Hk, Hq)))
    g_lse = normal(seed + 4, Hq, total)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference.flash_attention_varlen(*full, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                                    return_lse=True)
    ((ref * g).sum() + (ref_lse * g_lse).sum()).backward()

    def mine(x, dim=0):
        return shard(x, layout="balanced", dim=dim, cu_seqlens=cu)

    parts = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = ring_flash_varlen(*parts, cu.tolist(), group=None, causal=causal, scale=D ** -0.5, backend=backend,
                                 layout="balanced")
    ((out * mine(g).to(dtype)).sum() + (lse * mine(g_lse, 1).to(lse.dtype)).sum()).backward()
    compare("out", out, mine(ref.detach()), atol)
    compare("lse", lse, mine(ref_lse.detach(), 1), atol)
    for name, p, f in zip("qkv", parts, full):
        compare(f"d{name}", p.grad, mine(f.grad), atol)
    compare("unshard(out)", unshard(out, layout="balanced", dim=0, cu_seqlens=cu), ref.detach(), atol)


def _roundtrip_case(world, rank):
    """shard / unshard with cu_seqlens give back the batch (both layouts, along dim 1); every rank holds total/P
    rows; local_cu_seqlens bounds runs of one document's consecutive rows that make up the shard."""
    from longattn.distributed import local_cu_seqlens, shard, unshard

    for lens in BATCHES[world].values():
        cu = cu_seqlens_of(lens, "cpu")
        total = int(cu[-1])
        rows = torch.arange(total)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        for layout in ("balanced", "contiguous"):
            x = normal(3, 2, total, 3)
            part = shard(x, layout=layout, dim=1, cu_seqlens=cu)
            compare(f"{layout} roundtrip", unshard(part, layout=layout, dim=1, cu_seqlens=cu), x, 0)
            mine = shard(rows, layout=layout, dim=0, cu_seqlens=cu)
            assert len(mine) == total // world, (layout, len(mine))
            local = local_cu_seqlens(cu, layout, rank, world)
            assert local.dtype == torch.int32 and local[0] == 0 and local[-1] == len(mine), local
            for a, b in zip(local.tolist(), local[1:].tolist()):
                run = mine[a:b]
                assert b > a and (doc[run] == doc[run[0]]).all() and (run.diff() == 1).all(), (layout, run)


def _empty_batch_case(world):
    """Documents that are all empty: shards of no rows, outputs and gradients of no rows."""
    from longattn.distributed.ring_varlen import ring_flash_varlen

    q = torch.zeros(0, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = ring_flash_varlen(q, q, q, [0, 0, 0], group=None, causal=True, scale=0.5, backend="torch",
                                 layout="balanced")
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == (0, 2, 8)


def _errors_case(world, rank):
    from longattn.distributed import shard, unshard

    cu = cu_seqlens_of([3, 5 * world - 3])
    x = torch.zeros(5 * world, 2)
    expect_value_error(lambda: shard(x[:-1], layout="balanced", dim=0, cu_seqlens=cu), "shard", "cu_seqlens", "end")
    odd = cu_seqlens_of([3, 5 * world - 2])  # a length the ranks do not divide
    expect_value_error(lambda: shard(torch.zeros(5 * world + 1, 2), layout="balanced", dim=0, cu_seqlens=odd),
                       "divisible by")
    expect_value_error(lambda: shard(x, layout="zigzag", dim=0, cu_seqlens=cu), "balanced", "contiguous")
    # the ranks disagree on the documents: every rank raises, naming cu_seqlens and rank 0
    theirs = cu if rank else cu_seqlens_of([4, 5 * world - 4])
    part = shard(x, layout="balanced", dim=0, cu_seqlens=cu)
    expect_value_error(lambda: unshard(part, layout="balanced", dim=0, cu_seqlens=theirs), "cu_seqlens", "rank 0")
    unshard(part, layout="balanced", dim=0, cu_seqlens=cu)  # and the next call works


def _case(name, world, rank):
    """Runs case ``name`` on this rank (:data:`SKIP` where it does not run at this world size)."""
    if name == "triton-interpreter" and world != 2:  # slow in the interpreter: once is enough
        return SKIP
    if name in ATTENTION_CASES:
        batch, causal, hq, hk = ATTENTION_CASES[name]
        _attention_case(world, causal, hq, hk, BATCHES[world][batch], seed=len(name))
    elif name == "roundtrip":
        _roundtrip_case(world, rank)
    elif name == "empty-batch":
        _empty_batch_case(world)
    elif name == "errors":
        _errors_case(world, rank)
    elif name == "triton-interpreter":
        _attention_case(world, True, 4, 2, BATCHES[world]["mixed"], backend="triton", dtype=torch.float32, D=16,
                        atol=2e-5)


def _worker(rank: int, world: int, store_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # only the "triton-interpreter" case runs the kernels
    with gloo_group(rank, world, store_dir):
        run_cases(rank, store_dir, ALL_CASES, lambda name: _case(name, world, rank))


results = cases_fixture(_worker, WORLD_SIZES, TIMEOUT_S, "packed batch workers")


# ----------------------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", ALL_CASES)
def test_packed_balanced_case(results, case):
    check_case(results, case)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_batches_have_the_pieces_they_are_for(world):
    """The batches of the distributed cases test what they mean to (see BATCHES)."""
    from longattn.distributed.shards import balanced_layout

    def layout(name):
        lens = BATCHES[world][name]
        cut = balanced_layout(tuple(itertools.accumulate(lens, initial=0)), world)
        return lens, cut, set(sorted(range(len(lens)), key=lambda d: (-lens[d], d))[:cut.cut])

    lens, mixed, chunked = layout("mixed")
    assert chunked and all(mixed.whole), mixed
    assert all(any(d in chunked for d, _, _ in parts) for parts in mixed.parts), mixed
    assert any(d not in chunked for parts in mixed.parts for d, _, _ in parts), mixed  # a run filling the ranks
    lens, awkward, chunked = layout("awkward")
    assert {0, 1} <= set(lens) and any(1 < n < 2 * world for n in lens), lens
    assert chunked and all(lens[d] % (2 * world) for d in chunked) and any(awkward.whole), awkward
    lens, tiny, chunked = layout("tiny")
    assert any(lens[d] < 2 * world for d in chunked), tiny
    assert not any(layout("whole")[1].parts)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_work_is_balanced_on_long_tailed_documents(world, causal):
    """131072 rows per rank in documents of 64..16k rows (log-uniform, as the GPU benchmark's batch): in the balanced
    layout no rank has more than 1% more query-key pairs than the mean; in the contiguous layout (the only packed
    layout before the balanced one) some rank has more than 4% more (10-20% causal)."""
    from longattn.distributed.ring_varlen import work_per_rank

    for seed in (0, 1):
        lens = long_tailed_lengths(131072 * world, seed)
        cu = [0] + list(itertools.accumulate(lens))
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
        for layout, within in (("balanced", True), ("contiguous", False)):
            work = work_per_rank(cu, world, causal, layout)
            assert sum(work) == pairs, (layout, sum(work), pairs)  # every pair computed once, on one rank
            imbalance = max(work) * world / pairs
            assert (imbalance <= 1.01) == within, (layout, seed, imbalance)
            if layout == "contiguous":
                assert imbalance > 1.04, (seed, imbalance)


def test_balanced_layout_on_any_lengths():
    """Random batches of short and awkward documents over 1 to 8 ranks: the ranks' rows cover every row once, each
    rank holds total/P rows, and the busiest rank's causal work is within 1% of the mean or, where documents are too
    short for that, within twice the batch's rows (the spare rows of lengths 2P does not divide) of it."""
    from longattn.distributed.ring_varlen import work_per_rank
    from longattn.distributed.shards import packed_rows

    rnd = random.Random(0)
    for _ in range(300):
        world = rnd.choice([1, 2, 3, 4, 8])
        lens = [rnd.choice([0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 100, 300]) for _ in range(rnd.randint(1, 12))]
        lens += [1] * (-sum(lens) % world)
        cu = tuple(itertools.accumulate(lens, initial=0))
        rows = [packed_rows(cu, "balanced", r, world) for r in range(world)]
        assert all(len(x) == cu[-1] // world for x in rows), (world, lens)
        assert torch.cat(rows).sort().values.equal(torch.arange(cu[-1])), (world, lens)
        work = work_per_rank(cu, world, True, "balanced")
        assert sum(work) == sum(n * (n + 1) // 2 for n in lens)
        mean = sum(work) / world
        assert max(work) <= max(1.01 * mean, mean + 2 * cu[-1]), (world, lens, work)
