"""Soft-capping, ALiBi and attention sinks in the sequence-parallel functions (ring, Ulysses, hybrid), on the CPU
with gloo, in 2 and 4 processes.

Each world size is spawned once (a module-scoped fixture); the workers run every case and record, per case, None
or the failure text. A correctness case compares this rank's shard of the output and log-sum-exp, and of the
gradients of q, k and v, and the gradient of the sinks summed over the ranks (each rank's is its share), with
:mod:`longattn.reference` on the whole sequence in float64; the loss reads the log-sum-exp too. ALiBi's distances
are between global positions, so a block of the ring with the wrong offset changes the result.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _ranks import (
    SKIP, cases_fixture, check_case, compare, expect_error, gloo_group, grid_groups, normal, run_cases,
)
from longattn.utils import cu_seqlens_of

WORLD_SIZES = (2, 4)
TIMEOUT_S = 180
D = 8
MODS = ("softcap", "alibi", "sinks", "all")
# name -> (layout, causal, Hq, Hk, modifications); GQA, and MQA (one key/value head: Hk < P for Ulysses)
RING_CASES = {
    f"ring-{layout}-{'causal' if causal else 'full'}-{mods}": (layout, causal, 4, 2 if causal else 1, mods)
    for layout in ("zigzag", "contiguous") for causal in (False, True) for mods in MODS
}
ULYSSES_CASES = {
    f"ulysses-{layout}-{'causal' if causal else 'full'}-{mods}": (layout, causal, 4, 1 if causal else 2, mods)
    for layout, causal in (("zigzag", True), ("contiguous", False)) for mods in MODS
}
HYBRID_CASES = {  # on the grid R x U = 2 x P/2
    f"hybrid-{layout}-{'causal' if causal else 'full'}-{mods}": (layout, causal, 4, 1, mods)
    for layout, causal in (("zigzag", True), ("contiguous", False)) for mods in MODS
}
OTHER_CASES = ("ring-packed-sinks", "ulysses-packed-all", "ulysses-head-chunks", "hybrid-packed-sinks",
               "packed-ring-refuses", "groups-of-one", "options-differ", "triton-interpreter",
               "second-derivatives-refused")
ALL_CASES = tuple(RING_CASES) + tuple(ULYSSES_CASES) + tuple(HYBRID_CASES) + OTHER_CASES


# ----------------------------------------------------------------------------------------------------------------
# worker side

def _doc_lengths(total):
    """Fixed, long-tailed document lengths (an empty one, ones longer than a shard) filling ``total``."""
    lens, pattern = [], [5, 0, 13, 1, 20, 3, 30, 2]
    while sum(lens) < total:
        lens.append(min(pattern[len(lens) % len(pattern)], total - sum(lens)))
    return lens


def _mods(which: str, hq: int, rows: int, seed: int, dtype=torch.float64) -> dict:
    """The keyword arguments of modifications ``which``: ALiBi slopes per head or per batch row (``rows``)."""
    gen = torch.Generator().manual_seed(seed)
    kw = {}
    if which in ("softcap", "all"):
        kw["softcap"] = 1.5
    if which in ("alibi", "all"):
        shape = (hq,) if seed % 2 else (rows, hq)
        kw["alibi_slopes"] = torch.rand(shape, generator=gen) * 0.5 + 0.05
    if which in ("sinks", "all"):
        kw["sinks"] = torch.randn(hq, generator=gen, dtype=torch.float64).to(dtype)
    return kw


def _check(fn_dist, hq, hk, causal, which, seed, *, part, world, packed=False, dtype=torch.float64, d=D,
           atol=2e-6, reduce_group=None):
    """``fn_dist(q, k, v, cu, mods)`` on this rank's parts (``part(t, dim)``) against the reference on the whole
    float64 tensors (both give ``(out, lse)``): outputs, lse, the gradients of q, k, v, and the sinks' gradient
    summed over ``reduce_group`` (None: the world; False: not summed, for a group of one rank)."""
    from longattn import reference

    seq = 12 * world if packed else 2 * world * 3
    lead = (seq,) if packed else (2, seq)
    cu = cu_seqlens_of(_doc_lengths(seq), "cpu") if packed else None
    q, k, v, g = (normal(seed + i, *lead, h, d) * (2.0 if i == 0 else 1.0) for i, h in enumerate((hq, hk, hk, hq)))
    mods = _mods(which, hq, lead[0] if not packed else len(cu) - 1, seed, dtype)
    ref_mods = {**mods, "sinks": mods["sinks"].double().requires_grad_()} if "sinks" in mods else dict(mods)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if packed:
        ref, ref_lse = reference.flash_attention_varlen(*full, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                                        return_lse=True, **ref_mods)
    else:
        ref, ref_lse = reference.flash_attention(*full, causal=causal, return_lse=True, **ref_mods)
    g_lse = normal(seed + 9, *ref_lse.shape)
    ((ref * g).sum() + (ref_lse * g_lse).sum()).backward()

    seq_dim, lse_dim = (0, 1) if packed else (1, 2)
    parts = [part(t, seq_dim).to(dtype).requires_grad_() for t in (q, k, v)]
    if "sinks" in mods:
        mods["sinks"].requires_grad_()
    out, lse = fn_dist(*parts, cu, mods)
    ((out.double() * part(g, seq_dim)).sum() + (lse.double() * part(g_lse, lse_dim)).sum()).backward()
    compare("out", out.double(), part(ref.detach(), seq_dim), atol)
    compare("lse", lse.double(), part(ref_lse.detach(), lse_dim), atol)
    for name, p, f in zip("qkv", parts, full):
        compare(f"d{name}", p.grad.double(), part(f.grad, seq_dim), atol)
    if "sinks" in mods:
        grad = mods["sinks"].grad.double()
        if reduce_group is not False:
            dist.all_reduce(grad, group=reduce_group)
        compare("dsinks", grad, ref_mods["sinks"].grad, atol)


def _shard_part(group, layout):
    from longattn.distributed import shard

    return lambda t, dim: shard(t, group, layout, dim=dim)


def _ring(name, *, group=None, backend="torch", **kw):
    from longattn.distributed import ring_attention

    layout, causal, hq, hk, which = RING_CASES[name]
    _check(lambda q, k, v, cu, mods: ring_attention(q, k, v, group=group, layout=layout, causal=causal,
                                                    backend=backend, return_lse=True, **mods),
           hq, hk, causal, which, len(name), part=_shard_part(group, layout), world=dist.get_world_size(group), **kw)


def _ulysses(layout, causal, hq, hk, which, seed, *, group=None, packed=False, options=None, **kw):
    from longattn.distributed import ulysses_attention

    _check(lambda q, k, v, cu, mods: ulysses_attention(q, k, v, group=group, layout=layout, causal=causal,
                                                       backend="torch", return_lse=True, cu_seqlens=cu,
                                                       options=options, **mods),
           hq, hk, causal, which, seed, part=_shard_part(group, layout), world=dist.get_world_size(group),
           packed=packed, **kw)


def _hybrid(layout, causal, hq, hk, which, seed, grid, *, packed=False):
    from longattn.distributed import hybrid_attention, shard_hybrid

    ring_group, ulysses_group = grid
    _check(lambda q, k, v, cu, mods: hybrid_attention(q, k, v, ring_group=ring_group, ulysses_group=ulysses_group,
                                                      layout=layout, causal=causal, backend="torch",
                                                      return_lse=True, cu_seqlens=cu, **mods),
           hq, hk, causal, which, seed, part=lambda t, dim: shard_hybrid(t, ring_group, ulysses_group, layout, dim),
           world=dist.get_world_size(), packed=packed)


def _packed_ring_case():
    from longattn.distributed import ring_attention

    _check(lambda q, k, v, cu, mods: ring_attention(q, k, v, causal=True, backend="torch", return_lse=True,
                                                    cu_seqlens=cu, **mods),
           4, 2, True, "sinks", 5, part=_shard_part(None, "contiguous"), world=dist.get_world_size(), packed=True)


def _packed_refusal_case(world, grid):
    """The packed ring does not take softcap or ALiBi yet: every rank raises, naming the argument."""
    from longattn.distributed import hybrid_attention, ring_attention

    x, cu = normal(0, 4, 4, D), torch.tensor([0, 5, 4 * world], dtype=torch.int32)  # shards of 4 rows
    for kw, name in (({"softcap": 2.0}, "softcap"), ({"alibi_slopes": torch.ones(4)}, "alibi_slopes")):
        expect_error(NotImplementedError, lambda: ring_attention(x, x, x, cu_seqlens=cu, backend="torch", **kw),
                     "ring_attention", name, "cu_seqlens")
        expect_error(NotImplementedError, lambda: hybrid_attention(x, x, x, ring_group=grid[0], ulysses_group=grid[1],
                                                                   layout="contiguous", cu_seqlens=cu, backend="torch",
                                                                   **kw), "hybrid_attention", name)


def _groups_of_one(world, rank):
    """A group of one rank runs the single-GPU op with the modifications."""
    singles = [dist.new_group([r]) for r in range(world)]
    _ring("ring-zigzag-causal-all", group=singles[rank], reduce_group=False)
    _ulysses("contiguous", False, 4, 2, "all", 3, group=singles[rank], reduce_group=False)


def _second_derivatives_case(world, grid):
    """The sequence-parallel backwards run kernels and collectives whose gradients carry no graph: a backward with
    create_graph=True raises on every rank, naming the function (it returned gradients without a graph: a gradient
    penalty's second-order term was silently zero)."""
    from longattn.distributed import hybrid_attention, ring_attention, ring_dilated_attention, ulysses_attention

    def leaves():
        return [normal(s, 2, 4, 4, D).requires_grad_() for s in range(3)]

    calls = {
        "ring_attention": lambda q, k, v: ring_attention(q, k, v, causal=True, backend="torch"),
        "ulysses_attention": lambda q, k, v: ulysses_attention(q, k, v, causal=True, backend="torch"),
        "hybrid_attention": lambda q, k, v: hybrid_attention(q, k, v, ring_group=grid[0], ulysses_group=grid[1],
                                                             causal=True, backend="torch"),
        "ring_dilated_attention": lambda q, k, v: ring_dilated_attention(
            q, k, v, segment_lengths=(4, 4 * world), dilation_rates=(1, 2), causal=True, backend="torch"),
    }
    for fn, call in calls.items():
        q, k, v = leaves()
        out = call(q, k, v)
        expect_error(RuntimeError, lambda: torch.autograd.grad(out.sum(), q, create_graph=True),
                     "second derivatives")
        q, k, v = leaves()
        torch.autograd.grad(call(q, k, v).sum(), (q, k, v))  # a first derivative still runs


def _options_differ_case(world, rank, grid):
    """Ranks that pass different modifications (rank 1 differs) all raise, naming the option and the values; a
    slope that differs in its 8th digit is told apart (the values are compared, not a rounded repr)."""
    from longattn.distributed import hybrid_attention, ring_attention, ulysses_attention

    x, one = normal(0, 2, 4, 4, D), rank == 1
    slopes = torch.full((4,), 0.25)
    close = slopes.clone()
    close[2] += 1e-7
    calls = {
        "ring_attention": lambda **kw: ring_attention(x, x, x, backend="torch", **kw),
        "ulysses_attention": lambda **kw: ulysses_attention(x, x, x, backend="torch", **kw),
        "hybrid_attention": lambda **kw: hybrid_attention(x, x, x, ring_group=grid[0], ulysses_group=grid[1],
                                                          backend="torch", **kw),
    }
    for fn, call in calls.items():
        expect_error(ValueError, lambda: call(softcap=2.0 if one else 0.0), fn, "option softcap differs",
                     "rank 1 has 2.0")
        expect_error(ValueError, lambda: call(alibi_slopes=close if one else slopes), fn,
                     "option alibi_slopes differs", repr(close.tolist())[1:-1])
        expect_error(ValueError, lambda: call(sinks=torch.ones(4) if one else torch.zeros(4)), fn,
                     "option sinks differs", "rank 1 has [1.0, 1.0, 1.0, 1.0]")
        expect_error(ValueError, lambda: call(sinks=torch.ones(3) if one else torch.ones(4)), fn, "invalid input",
                     "rank 1", "sinks must have shape")
    # (Hq,) slopes and the same slopes per batch row take effect alike
    ring_attention(x, x, x, backend="torch", alibi_slopes=slopes.expand(2, 4).clone() if one else slopes)


def _triton_case():
    """The Triton kernels (in the interpreter, float32) under the ring: ALiBi offsets of both signs in the forward
    and both backward kernels, soft-capping, the sinks' gradient through the log-sum-exp."""
    _ring("ring-contiguous-full-all", backend="triton", dtype=torch.float32, d=16, atol=2e-5)


def _case(name, world, rank, grid):
    """Runs case ``name`` on this rank (:data:`SKIP` where it does not run at this world size)."""
    if name == "triton-interpreter" and world != 2:  # slow in the interpreter; once is enough
        return SKIP
    if name in RING_CASES:
        _ring(name)
    elif name in ULYSSES_CASES:
        _ulysses(*ULYSSES_CASES[name], len(name))
    elif name in HYBRID_CASES:
        _hybrid(*HYBRID_CASES[name], len(name), grid)
    elif name == "ring-packed-sinks":
        _packed_ring_case()
    elif name == "ulysses-packed-all":
        _ulysses("contiguous", True, 4, 2, "all", 4, packed=True)
    elif name == "ulysses-head-chunks":  # every modification (sinks' gradient summed over the groups), 4 head groups
        from longattn.distributed import ParallelOptions

        opts = ParallelOptions(head_chunks=4)
        _ulysses("zigzag", True, 4 * world, 4 * world, "all", 8, options=opts)
        _ulysses("contiguous", False, 4 * world, 4 * world, "all", 9, packed=True, options=opts)
        _ulysses("zigzag", True, 4 * world, world, "all", 10, options=opts)  # one key/value head a rank, shared
    elif name == "hybrid-packed-sinks":
        _hybrid("contiguous", True, 4, 2, "sinks", 7, grid, packed=True)
    elif name == "packed-ring-refuses":
        _packed_refusal_case(world, grid)
    elif name == "groups-of-one":
        _groups_of_one(world, rank)
    elif name == "options-differ":
        _options_differ_case(world, rank, grid)
    elif name == "triton-interpreter":
        _triton_case()
    elif name == "second-derivatives-refused":
        _second_derivatives_case(world, grid)


def _worker(rank: int, world: int, store_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels (only the Triton case uses them)
    with gloo_group(rank, world, store_dir):
        grid = grid_groups(2, world // 2)  # (ring group, Ulysses group) of this rank
        run_cases(rank, store_dir, ALL_CASES, lambda name: _case(name, world, rank, grid))


results = cases_fixture(_worker, WORLD_SIZES, TIMEOUT_S, "score-modification workers")


# ----------------------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", ALL_CASES)
def test_score_mods_case(results, case):
    check_case(results, case)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_plan_gives_global_distances(world, layout, causal):
    """The ALiBi blocks cover exactly the pairs of :func:`block_plan` (the causal mask), each pair once, and local
    query ``i`` and key ``j`` of a block are ``i + offset - j`` apart in global positions."""
    from longattn.distributed import local_positions
    from longattn.distributed.ring import alibi_plan, block_plan

    n = 6
    for rank in range(world):
        qpos = local_positions(n, layout, rank, world)
        for src in range(world):
            kpos = local_positions(n, layout, src, world)
            want = torch.zeros(n, n, dtype=torch.int64)
            for qs, ks, diag in block_plan(layout, rank, src, world, causal, n):
                block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.int64)
                want[qs, ks] += block.tril() if diag else block
            got = torch.zeros(n, n, dtype=torch.int64)
            for qs, ks, diag, offset in alibi_plan(layout, rank, src, world, causal, n):
                block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.int64)
                got[qs, ks] += block.tril() if diag else block
                i = torch.arange(qs.stop - qs.start)[:, None]
                j = torch.arange(ks.stop - ks.start)[None, :]
                assert torch.equal(i + offset - j, qpos[qs][:, None] - kpos[ks][None, :]), (rank, src, qs, ks)
            assert torch.equal(got, want), (rank, src)
