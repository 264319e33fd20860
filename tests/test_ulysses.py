"""Ulysses attention (all-to-all between sequence and heads) and the hybrid of Ulysses and ring attention, on the
CPU with gloo, in 2 and 4 processes.

Each world size is spawned once (a module-scoped fixture); the workers run every case and record, per case, None
or the failure text; the tests below assert on those records. A correctness case compares this rank's shard of the
output, of the log-sum-exp and of the gradients of q, k and v (the loss reads the log-sum-exp too) with
:mod:`longattn.reference` on the gathered sequence, in float64. An error case checks, on every rank, that the call
raised ``ValueError`` with the words given.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _ranks import (
    SKIP, cases_fixture, check_case, compare, expect_value_error, gloo_group, grid_groups, normal, run_cases,
)
from longattn.utils import cu_seqlens_of

WORLD_SIZES = (2, 4)
TIMEOUT_S = 180
D = 8
# (Hq, Hk): every Hq divisible by 2 and 4; Hk = Hq, Hk < P (1; 2 at P = 4), P dividing Hk (2 and 6 at P = 2), and
# neither dividing the other (Hk 6 at P = 4, Hk 3)
HEADS = {"mha": (4, 4), "mqa": (4, 1), "gqa": (8, 2), "gqa-6": (12, 6), "gqa-3": (12, 3)}

# name -> (layout, causal, Hq, Hk)
FLASH_CASES = {
    f"flash-{layout}-{'causal' if causal else 'full'}-{heads}": (layout, causal) + HEADS[heads]
    for layout in ("contiguous", "zigzag") for causal in (False, True) for heads in HEADS
}
# the defaults: shard(x) and ulysses_attention without layout= read the shards alike (they did not: a causal call on
# shard()'s zigzag shards read as contiguous was off by 1.5)
FLASH_CASES["flash-default-layouts-causal-gqa"] = (None, True, 4, 2)
# name -> (layout, causal, Hq, Hk): packed batches of 12 rows per rank, documents crossing shards
VARLEN_CASES = {
    "varlen-contiguous-full-gqa": ("contiguous", False, 4, 2),
    "varlen-contiguous-causal-mqa": ("contiguous", True, 4, 1),
    "varlen-zigzag-causal-gqa-3": ("zigzag", True, 12, 3),
    "varlen-zigzag-full-mha": ("zigzag", False, 4, 4),
}
# name -> (layout, causal, Hq, Hk, dilated options, packed)
DILATED_CASES = {
    # rate 3 divides no rank's first head but rank 0's: one branch per head there
    "dilated-rate-3-causal-zigzag": ("zigzag", True, 4, 2, dict(segment_lengths=(6, 12), dilation_rates=(1, 3)),
                                     False),
    # 12 heads in groups of 4: with P = 4 rank 1 holds heads 3-5, of two groups
    "dilated-head-split-gqa": ("contiguous", False, 12, 3, dict(segment_lengths=(4, 8, 24), dilation_rates=(1, 2, 4),
                                                                head_split=True), False),
    "dilated-packed-causal": ("zigzag", True, 4, 2, dict(segment_lengths=(4, 8), dilation_rates=(1, 2)), True),
    "dilated-default-layouts-causal": (None, True, 4, 2, dict(segment_lengths=(4, 8), dilation_rates=(1, 2)),
                                       False),
    "dilated-packed-head-split": ("contiguous", False, 8, 2, dict(segment_lengths=(6, 9), dilation_rates=(2, 3),
                                                                  head_split=True), True),
}
# name -> (layout, causal, Hq, Hk, packed); each runs on the grids R x U = 1 x P, P x 1 and 2 x P/2
HYBRID_CASES = {
    "hybrid-zigzag-causal-mqa": ("zigzag", True, 4, 1, False),
    "hybrid-zigzag-full-mha": ("zigzag", False, 4, 4, False),
    "hybrid-contiguous-causal-gqa": ("contiguous", True, 8, 2, False),
    "hybrid-packed-causal-gqa-3": ("contiguous", True, 12, 3, True),
}
ERROR_CASES = ("error-heads-indivisible", "error-options-differ", "error-one-rank-bad-input", "error-bad-options",
               "options-agree", "error-hybrid")
OTHER_CASES = ("no-lse", "subgroups", "triton-interpreter", "hybrid-mesh", "head-chunks", "head-groups-edges",
               "hybrid-checks-once")
ALL_CASES = (tuple(FLASH_CASES) + tuple(VARLEN_CASES) + tuple(DILATED_CASES) + tuple(HYBRID_CASES) + ERROR_CASES
             + OTHER_CASES)


# ----------------------------------------------------------------------------------------------------------------
# worker side

def _doc_lengths(total):
    """Fixed, long-tailed document lengths (an empty one, ones longer than a shard of 12) filling ``total``."""
    lens, pattern = [], [5, 0, 13, 1, 20, 3, 30, 2]
    while sum(lens) < total:
        lens.append(min(pattern[len(lens) % len(pattern)], total - sum(lens)))
    return lens


def _check(fn_dist, fn_ref, Hq, Hk, seed, *, part, world, packed=False, lse_grad=True, dtype=torch.float64, d=D,
           atol=2e-6):
    """``fn_dist(q, k, v, cu)`` on this rank's parts (``part(t, dim)``) against ``fn_ref(q, k, v, cu)`` on the whole
    float64 tensors of ``world`` parts (both give ``(out, lse)``): outputs, lse, and the gradients of a loss that
    reads both (the output alone without ``lse_grad``)."""
    seq = 12 * world if packed else 2 * world * 3
    lead = (seq,) if packed else (2, seq)
    cu = cu_seqlens_of(_doc_lengths(seq), "cpu") if packed else None
    q, k, v, g = (normal(seed + i, *lead, h, d).to(dtype).double() for i, h in enumerate((Hq, Hk, Hk, Hq)))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = fn_ref(*full, cu)
    g_lse = normal(seed + 9, *ref_lse.shape).masked_fill(torch.isinf(ref_lse), 0)  # lse -inf: a query without keys
    g_lse = g_lse if lse_grad else torch.zeros_like(g_lse)
    finite = lambda lse: lse.masked_fill(torch.isinf(lse), 0)  # noqa: E731
    ((ref * g).sum() + (finite(ref_lse) * g_lse).sum()).backward()

    seq_dim, lse_dim = (0, 1) if packed else (1, 2)
    parts = [part(t, seq_dim).to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn_dist(*parts, cu)
    loss = (out.double() * part(g, seq_dim)).sum()
    if lse_grad:
        loss = loss + (finite(lse.double()) * part(g_lse, lse_dim)).sum()
    loss.backward()
    compare("out", out.double(), part(ref.detach(), seq_dim), atol)
    compare("lse", lse.double(), part(ref_lse.detach(), lse_dim), atol)
    for name, p, f in zip("qkv", parts, full):
        compare(f"d{name}", p.grad.double(), part(f.grad, seq_dim), atol)


def _ulysses_part(group, layout):
    from longattn.distributed import shard

    return lambda t, dim: shard(t, group, layout, dim=dim)


def _reference(causal, opts=None):
    """``(q, k, v, cu) -> (out, lse)`` of the reference: flash attention, or dilated attention with ``opts``."""
    from longattn import reference

    def ref(q, k, v, cu):
        if opts is not None and cu is None:
            return reference.dilated_attention(q, k, v, causal=causal, return_lse=True, **opts)
        if opts is not None:
            return reference.dilated_attention_varlen(q, k, v, cu_seqlens=cu, causal=causal, return_lse=True, **opts)
        if cu is None:
            return reference.flash_attention(q, k, v, causal=causal, return_lse=True)
        return reference.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                                return_lse=True)

    return ref


def _flash(layout, causal, Hq, Hk, seed, *, packed=False, group=None, backend="torch", options=None, **kw):
    from longattn.distributed import ulysses_attention

    _check(lambda q, k, v, cu: ulysses_attention(q, k, v, group=group, layout=layout, causal=causal,
                                                 backend=backend, return_lse=True, cu_seqlens=cu, options=options),
           _reference(causal), Hq, Hk, seed, part=_ulysses_part(group, layout), world=dist.get_world_size(group),
           packed=packed, **kw)


def _dilated_case(name, backend="torch", options=None, **kw):
    from longattn.distributed import ulysses_dilated_attention

    layout, causal, Hq, Hk, opts, packed = DILATED_CASES[name]
    _check(lambda q, k, v, cu: ulysses_dilated_attention(q, k, v, layout=layout, causal=causal, backend=backend,
                                                         return_lse=True, cu_seqlens=cu, options=options, **opts),
           _reference(causal, opts), Hq, Hk, seed=len(name), part=_ulysses_part(None, layout),
           world=dist.get_world_size(), packed=packed, **kw)


def _grids(world):
    """Every ``(R, U)`` grid the tests use, as ``{(R, U): (ring group, Ulysses group)}`` of this rank."""
    return {grid: grid_groups(*grid) for grid in dict.fromkeys(((1, world), (world, 1), (2, world // 2)))}


def _hybrid_case(name, grids, world, cases=HYBRID_CASES):
    """Case ``name`` of ``cases`` (layout, causal, Hq, Hk, packed) on each ``(R, U)`` grid of ``grids``."""
    from longattn.distributed import hybrid_attention, shard_hybrid

    layout, causal, Hq, Hk, packed = cases[name]
    for (ring, uly), (ring_group, ulysses_group) in grids.items():
        try:
            _check(lambda q, k, v, cu: hybrid_attention(q, k, v, ring_group=ring_group, ulysses_group=ulysses_group,
                                                        layout=layout, causal=causal, backend="torch",
                                                        return_lse=True, cu_seqlens=cu),
                   _reference(causal), Hq, Hk, seed=len(name),
                   part=lambda t, dim: shard_hybrid(t, ring_group, ulysses_group, layout, dim), world=world,
                   packed=packed)
        except AssertionError as e:
            raise AssertionError(f"grid {ring} x {uly}: {e}") from e


def _hybrid_mesh_case(world):
    """A 2-D DeviceMesh (ring, ulysses) instead of the two groups; the ``shard_hybrid``/``unshard_hybrid`` round
    trip."""
    from torch.distributed.device_mesh import init_device_mesh

    from longattn.distributed import hybrid_attention, shard_hybrid, unshard_hybrid

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ring", "ulysses"))
    _check(lambda q, k, v, cu: hybrid_attention(q, k, v, mesh=mesh, causal=True, backend="torch", return_lse=True),
           _reference(True), 4, 1, seed=3, part=lambda t, dim: shard_hybrid(t, layout="zigzag", dim=dim, mesh=mesh),
           world=world)
    x = torch.arange(8 * world, dtype=torch.float64).view(1, -1, 1, 1)
    for layout in ("zigzag", "contiguous"):
        compare(f"{layout} roundtrip", unshard_hybrid(shard_hybrid(x, layout=layout, mesh=mesh), layout=layout,
                                                      mesh=mesh), x)


def _hybrid_checks_once_case(world, rank, grids):
    """A hybrid call (forward and backward) runs the cross-rank check once on each of its two groups: two
    exchanges (``gather_ints``), not a third for its inner ring; a ring call and a Ulysses call one each. A rank of
    the grid passing another transport makes every rank raise, naming it."""
    from longattn.distributed import ParallelOptions, hybrid_attention, ring_attention, shard_hybrid, shards
    from longattn.distributed import ulysses_attention

    ring_group, ulysses_group = grids[(2, world // 2)]
    x = normal(8, 1, 4 * world, 4, D)
    part = shard_hybrid(x, ring_group, ulysses_group, "zigzag").requires_grad_()
    gathered = []
    gather = shards.gather_ints
    shards.gather_ints = lambda group, *a, **kw: gathered.append(group) or gather(group, *a, **kw)
    try:
        hybrid_attention(part, part, part, ring_group=ring_group, ulysses_group=ulysses_group, causal=True,
                         backend="torch").sum().backward()
        if gathered != [ulysses_group, ring_group]:
            raise AssertionError(f"a hybrid call exchanged {len(gathered)} times for its checks, not once per group")
        del gathered[:]
        ring_attention(part, part, part, group=ring_group, causal=True, backend="torch")
        ulysses_attention(part, part, part, group=ulysses_group, causal=True, backend="torch")
        if gathered != [ring_group, ulysses_group]:
            raise AssertionError(f"a ring and a Ulysses call exchanged {len(gathered)} times, not once each")
    finally:
        shards.gather_ints = gather
    opts = ParallelOptions(transport="nccl" if rank == world - 1 else "auto")
    expect_value_error(lambda: hybrid_attention(part, part, part, ring_group=ring_group, ulysses_group=ulysses_group,
                                                backend="torch", options=opts),
                       "option options.transport differs")


def _no_lse_case(world):
    """Without return_lse the result is the output alone, equal to the reference (and its backward runs, once: a
    second backward through the same call raises)."""
    from longattn import reference
    from longattn.distributed import shard, ulysses_attention, ulysses_dilated_attention

    x = normal(1, 2, 4 * world, 4, D)
    for layout in ("contiguous", "zigzag"):
        part = shard(x, layout=layout).requires_grad_()
        out = ulysses_attention(part, part, part, layout=layout, causal=True, backend="torch")
        if not isinstance(out, torch.Tensor):
            raise AssertionError(f"ulysses_attention returned {type(out).__name__}, not a tensor")
        compare("out", out, shard(reference.flash_attention(x, x, x, causal=True), layout=layout))
        out.sum().backward(retain_graph=True)
        try:  # a second backward through the call: a clear error, not a crash inside
            out.sum().backward()
        except RuntimeError as e:
            if "second time" not in str(e):
                raise
        else:
            raise AssertionError("a second backward through ulysses_attention did not raise")
        kw = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))
        out = ulysses_dilated_attention(part, part, part, layout=layout, backend="torch", **kw)
        compare("dilated out", out, shard(reference.dilated_attention(x, x, x, **kw), layout=layout))


def _subgroups(world, rank):
    """Ulysses inside sub-groups of 2 ranks (the all-to-all takes the group) and in groups of one rank (the
    single-GPU op)."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    singles = [dist.new_group([r]) for r in range(world)]
    for group in (pairs[rank // 2], singles[rank]):
        for layout, causal in (("zigzag", True), ("contiguous", False)):
            _flash(layout, causal, 4, 1, seed=17, group=group)
        _flash("zigzag", True, 4, 2, seed=19, group=group, packed=True)


def _triton_interpreter_case():
    """The Triton kernels (in the interpreter, float32) as the local kernel."""
    _flash("zigzag", True, 4, 2, seed=11, backend="triton", dtype=torch.float32, d=16, atol=2e-5)
    _flash("contiguous", True, 4, 2, seed=12, packed=True, backend="triton", dtype=torch.float32, d=16, atol=2e-5)
    _dilated_case("dilated-rate-3-causal-zigzag", backend="triton", dtype=torch.float32, d=16, atol=2e-5)


def _head_chunks_case(world):
    """The heads cut into 1, 2 and 4 groups whose all-to-alls overlap (ParallelOptions.head_chunks): the same result
    as the reference for each, batches of two rows (packed sends) and packed batches (one row: views sent), both
    layouts, grouped-query heads, a dilated call whose groups keep whole branches and one whose groups cannot; float64
    results to 1e-9 (the groups' sums must not round through float32)."""
    from longattn.distributed import ParallelOptions, ulysses

    for chunks in (1, 2, 4):
        opts = ParallelOptions(head_chunks=chunks)
        hq, hk = 8 * world, 4 * world  # 8 query and 4 key/value heads a rank: 4 groups divide them
        if ulysses.head_chunks(hq, hk, world, wanted=chunks) != chunks:
            raise AssertionError(f"head_chunks({hq}, {hk}, {world}, wanted={chunks}) != {chunks}")
        for layout, causal in (("zigzag", True), ("contiguous", False)):
            _flash(layout, causal, hq, hk, seed=30 + chunks, atol=1e-9, options=opts)
            _flash(layout, causal, hq, hk, seed=40 + chunks, packed=True, atol=1e-9, options=opts)
        # fewer key/value heads than ranks: repeated, one a rank, every group reading it
        _flash("zigzag", True, hq, 2, seed=50 + chunks, atol=1e-9, options=opts)
        if ulysses.head_chunks(hq, world, world, wanted=chunks) != chunks:  # Hk = 2 repeated to P heads: one a rank
            raise AssertionError("one key/value head a rank: the groups share it")
        _flash("contiguous", False, hq, world, seed=60 + chunks, packed=True, atol=1e-9,
               options=opts)  # Hk = P: one each, packed
        # two a rank: with 4 groups, each reads one
        _flash("zigzag", True, hq, 2 * world, seed=70 + chunks, atol=1e-9, options=opts)
    if ulysses.head_chunks(8 * world, 8 * world, world, multiple_of=8) != 1:  # (the default, 2 groups)
        raise AssertionError("a group of 4 heads does not hold whole branches of rate 8")
    _dilated_case("dilated-head-split-gqa")


def _head_groups_edges_case(world, rank):
    """Around the head groups' own autograd: a hook on the sinks runs once, on this rank's whole gradient (the
    groups' graphs read leaves of their own); an empty sequence with the log-sum-exp differentiates (its lse depends
    on no input); ranks cutting the heads differently raise, naming the setting."""
    from longattn.distributed import ParallelOptions, shard, ulysses_attention

    hq = 4 * world  # 4 query and key/value heads a rank: two groups
    x, sinks = normal(5, 1, 4 * world, hq, D), normal(6, hq)
    part = shard(x, layout="zigzag")
    grads = []
    for hooked in (False, True):
        s = sinks.clone().requires_grad_()
        if hooked:
            s.register_hook(lambda g: g * 2)
        ulysses_attention(part, part, part, layout="zigzag", causal=True, backend="torch", sinks=s).sum().backward()
        grads.append(s.grad)
    compare("sinks gradient with a doubling hook", grads[1], 2 * grads[0])

    empty = normal(7, 1, 0, hq, D).requires_grad_()
    out, lse = ulysses_attention(empty, empty, empty, causal=True, backend="torch", return_lse=True)
    (out.sum() + lse.sum()).backward()
    compare("empty sequence's gradient", empty.grad, torch.zeros_like(empty))

    opts = ParallelOptions(head_chunks=1 + rank % 2)
    expect_value_error(lambda: ulysses_attention(part, part, part, backend="torch", options=opts),
                       "option options.head_chunks differs")


def _error_case(name, world, rank, grids):
    from longattn.distributed import (hybrid_attention, shard_hybrid, ulysses_attention, ulysses_dilated_attention,
                                      unshard_hybrid)

    x = normal(0, 1, 8, 4, D)
    cu = torch.tensor([0, 5, 8 * world], dtype=torch.int32)
    ua = lambda *a, **kw: ulysses_attention(*a, **{"backend": "torch", **kw})  # noqa: E731
    if name == "error-heads-indivisible":
        y, k = normal(0, 1, 8, world + 1, D), normal(0, 1, 8, 1, D)
        expect_value_error(lambda: ua(y, k, k), f"Hq={world + 1}", f"P={world}", "divisible")
        expect_value_error(lambda: ulysses_dilated_attention(y, k, k, segment_lengths=(4,), dilation_rates=(1,)),
                           "ulysses_dilated_attention", f"Hq={world + 1}")
    elif name == "error-options-differ":
        one = rank == 1
        cases = [  # (call, words): rank 1 differs
            (lambda: ua(x, x, x, scale=0.1 if one else None), ["option scale", "rank 1 has 0.1", "None (= 0.3535"]),
            (lambda: ua(x, x, x, causal=one), ["option causal", "rank 1 has True"]),
            (lambda: ua(x, x, x, layout="zigzag" if one else "contiguous"),
             ["option layout", "rank 1 has 'zigzag'", "'contiguous'"]),
            (lambda: ua(x, x, x, backend="auto" if one else "torch"), ["option backend", "rank 1 has 'auto'"]),
            (lambda: ua(x, x, x, return_lse=one), ["option return_lse", "rank 1 has True"]),
            (lambda: ua(x.float() if one else x, x.float() if one else x, x.float() if one else x),
             ["the dtype of q", "rank 1 has torch.float32"]),
            (lambda: ua(x[0], x[0], x[0], cu_seqlens=torch.tensor([0, 3, 8 * world]) if one else cu),
             ["option cu_seqlens", f"rank 1 has [0, 3, {8 * world}]", f"[0, 5, {8 * world}]"]),
            (lambda: ulysses_dilated_attention(x, x, x, segment_lengths=(8,) if one else (4,), dilation_rates=(1,),
                                               backend="torch"),
             ["ulysses_dilated_attention", "option segment_lengths", "rank 1 has (8,)", "(4,)"]),
            (lambda: ulysses_dilated_attention(x, x, x, segment_lengths=(4, 8), dilation_rates=(1, 2),
                                               head_split=one, backend="torch"),
             ["option head_split", "rank 1 has True"]),
        ]
        for call, words in cases:
            expect_value_error(call, "ulysses", "differs across ranks", *words)
    elif name == "error-one-rank-bad-input":
        k = x[..., :4] if rank == world - 1 else x  # head dims differ on the last rank only
        expect_value_error(lambda: ua(x, k, k), f"rank {world - 1}", "invalid input")
    elif name == "error-bad-options":
        expect_value_error(lambda: ua(x[:, :7], x[:, :7], x[:, :7], layout="zigzag"), "zigzag", "even")
        expect_value_error(lambda: ua(x, x, x, layout="ring"), "layout must be one of")
        expect_value_error(lambda: ua(x[0], x[0], x[0], cu_seqlens=cu, layout="balanced"), "'balanced' is the ring's")
        expect_value_error(lambda: ua(x[0], x[0], x[0], cu_seqlens=cu[:2]), "cu_seqlens")
        # a TypeError of the local checks reaches every rank as a ValueError with its message
        expect_value_error(lambda: ua(x, x, x, causal="yes"), "causal must be a bool")
        # a group that is not a process group: named, not an AttributeError inside torch.distributed
        from _ranks import expect_error
        from longattn.distributed import ring_attention
        expect_error(TypeError, lambda: ua(x, x, x, group="world"), "group must be a torch.distributed.ProcessGroup")
        expect_error(TypeError, lambda: ring_attention(x, x, x, group=123), "group must be")
        expect_error(TypeError, lambda: hybrid_attention(x, x, x, ring_group="a", ulysses_group="b"),
                     "ring_group must be")
        expect_value_error(lambda: hybrid_attention(x, x, x), "hybrid_attention: pass ring_group")
    elif name == "error-hybrid":
        ring_group, ulysses_group = grids[(2, world // 2)]
        ha = lambda *a, **kw: hybrid_attention(  # noqa: E731
            *a, **{"ring_group": ring_group, "ulysses_group": ulysses_group, "backend": "torch", **kw})
        # every rank of the grid raises, also those whose Ulysses group agrees (rank 1 differs from rank 0)
        expect_value_error(lambda: ha(x, x, x, scale=0.1 if rank == 1 else None), "hybrid_attention",
                           "option scale differs", "rank 1 has 0.1")
        expect_value_error(lambda: ha(x, x, x, causal=rank == world - 1), "option causal differs")
        y = normal(0, 1, 8, world // 2 + 1, D)  # heads not divisible by the Ulysses degree (when it is above 1)
        if world // 2 > 1:
            expect_value_error(lambda: ha(y, y, y), f"Hq={world // 2 + 1}", f"P={world // 2}")
        expect_value_error(lambda: ha(x[0], x[0], x[0], layout="zigzag", cu_seqlens=torch.tensor([0, 8 * world])),
                           "layout must be 'contiguous'")
        # a layout the ring takes elsewhere (packed batches) but shard_hybrid does not: the function is named
        expect_value_error(lambda: shard_hybrid(x, ring_group, ulysses_group, layout="balanced"),
                           "shard_hybrid: layout must be one of")
        expect_value_error(lambda: unshard_hybrid(x, ring_group, ulysses_group, layout="balanced"),
                           "unshard_hybrid: layout must be one of")
        # the two groups must make a grid: here the ranks of a ring group sit at different Ulysses positions
        if world == 2:  # one group as both
            wrong_ring = ulysses_group = grids[(1, 2)][1]
        else:  # Ulysses groups {0, 1}, {2, 3}; ring groups {0, 3}, {1, 2}
            crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
            wrong_ring, ulysses_group = crossed[rank in (1, 2)], grids[(2, 2)][1]
        expect_value_error(lambda: hybrid_attention(x, x, x, ring_group=wrong_ring, ulysses_group=ulysses_group,
                                                    backend="torch"),
                           "ring_group and ulysses_group are the same group" if world == 2
                           else "position differs across ranks")
        # shard(x)'s zigzag part is not shard_hybrid's (contiguous inside a Ulysses group) and nothing in the data
        # tells them apart: the very tensors shard() returned are refused on every rank (a causal result on them
        # was wrong, with no error); shard_hybrid's parts of the same tensor run.
        from longattn.distributed import shard

        ring_group, ulysses_group = grids[(1, world)]
        full = torch.cat([normal(7, 1, 8, 4, D)] * world, dim=1)  # (the same on every rank)
        part = shard(full)
        expect_value_error(lambda: hybrid_attention(part, part, part, ring_group=ring_group,
                                                    ulysses_group=ulysses_group, causal=True, backend="torch"),
                           "hybrid_attention", "shard_hybrid", "zigzag")
        part = shard_hybrid(full, ring_group, ulysses_group)
        hybrid_attention(part, part, part, ring_group=ring_group, ulysses_group=ulysses_group, causal=True,
                         backend="torch")
        # with one Ulysses rank the cut is the ring's layout, with two ring positions and a zigzag ring no shard()
        # cut is the hybrid's: shard()'s other cuts are refused too; its contiguous cut read as contiguous runs
        from longattn import reference

        want = reference.flash_attention(full, full, full, causal=True)
        for grid in dict.fromkeys(((world, 1), (2, world // 2))):
            ring_group, ulysses_group = grids[grid]
            for cut, layout in (("contiguous", "zigzag"), ("zigzag", "contiguous")):
                part = shard(full, layout=cut)
                expect_value_error(lambda: hybrid_attention(part, part, part, ring_group=ring_group,
                                                            ulysses_group=ulysses_group, layout=layout, causal=True,
                                                            backend="torch"),
                                   "shard_hybrid", f"{layout!r} layout over the ring", f"{cut!r} shard")
            part = shard(full, layout="contiguous")
            compare(f"grid {grid}: shard(x, layout='contiguous')", hybrid_attention(
                part, part, part, ring_group=ring_group, ulysses_group=ulysses_group, layout="contiguous",
                causal=True, backend="torch"), shard(want, layout="contiguous"))
    elif name == "options-agree":  # options that take effect alike
        ua(x, x, x, scale=None if rank else D ** -0.5)
        ulysses_dilated_attention(x, x, x, segment_lengths=[4, 8] if rank else (4, 8), dilation_rates=(1, 2),
                                  backend="torch")


def _case(name, world, rank, grids):
    """Runs case ``name`` on this rank (:data:`SKIP` where it does not run at this world size)."""
    if name == "triton-interpreter" and world != 2:  # slow in the interpreter; once is enough
        return SKIP
    if name in FLASH_CASES:
        _flash(*FLASH_CASES[name], seed=len(name))
    elif name in VARLEN_CASES:
        _flash(*VARLEN_CASES[name], seed=len(name), packed=True)
    elif name in DILATED_CASES:
        _dilated_case(name)
    elif name in HYBRID_CASES:
        _hybrid_case(name, grids, world)
    elif name in ERROR_CASES:
        _error_case(name, world, rank, grids)
    elif name == "no-lse":
        _no_lse_case(world)
    elif name == "subgroups":
        _subgroups(world, rank)
    elif name == "hybrid-mesh":
        _hybrid_mesh_case(world)
    elif name == "head-chunks":
        _head_chunks_case(world)
    elif name == "head-groups-edges":
        _head_groups_edges_case(world, rank)
    elif name == "hybrid-checks-once":
        if world < 4:  # (a grid of two groups of more than one rank)
            return SKIP
        _hybrid_checks_once_case(world, rank, grids)
    elif name == "triton-interpreter":
        _triton_interpreter_case()


def _worker(rank: int, world: int, store_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels (only the Triton case uses them)
    with gloo_group(rank, world, store_dir):
        grids = _grids(world)
        run_cases(rank, store_dir, ALL_CASES, lambda name: _case(name, world, rank, grids))


results = cases_fixture(_worker, WORLD_SIZES, TIMEOUT_S, "ulysses workers")


# ----------------------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", ALL_CASES)
def test_ulysses_case(results, case):
    check_case(results, case)


@pytest.mark.parametrize("hk,world,repeats", [(4, 2, 1), (2, 4, 2), (1, 4, 4), (6, 4, 2), (3, 2, 2), (3, 4, 4),
                                              (0, 4, 1)])
def test_kv_repeats_make_the_heads_divisible(hk, world, repeats):
    from longattn.distributed.ulysses import kv_repeats

    assert kv_repeats(hk, world) == repeats
    assert hk * repeats % world == 0


@pytest.mark.parametrize("hq,hk,world", [(4, 4, 2), (4, 1, 4), (8, 2, 4), (12, 6, 4), (12, 3, 2), (12, 4, 6),
                                         (6, 2, 3)])
def test_repeated_kv_heads_are_the_ones_each_rank_reads(hq, hk, world):
    """After repeating and splitting the key/value heads, local query head j of every rank reads (by local GQA)
    a copy of the key/value head its global head reads."""
    from longattn.distributed.ulysses import kv_repeats

    c = kv_repeats(hk, world)
    copies = [h for h in range(hk) for _ in range(c)]  # repeat_interleave: which head each copy is
    h_q, h_kv = hq // world, len(copies) // world
    for r in range(world):
        mine = copies[r * h_kv:(r + 1) * h_kv]
        for j in range(h_q):
            assert mine[j // (h_q // h_kv)] == (r * h_q + j) // (hq // hk)


def test_local_branches_keep_global_offsets_and_groups():
    from longattn.call import dilated_branches
    from longattn.distributed.ulysses import local_branches

    def offsets(branches, n_heads):  # head -> sorted (segment, rate, offset) of the branches it is in
        got = {h: [] for h in range(n_heads)}
        for br in branches:
            for h in range(br.head_start, br.head_start + br.n_heads):
                got[h].append((br.segment, br.dilation, h % br.dilation if br.offset is None else br.offset))
        return {h: sorted(v) for h, v in got.items()}

    for head_split in (False, True):
        glob = dilated_branches(24, 12, (4, 8, 24), (1, 3, 4), head_split)
        want = offsets(glob, 12)
        for world in (2, 3, 4, 6):
            h = 12 // world
            for r in range(world):
                got = offsets(local_branches(glob, r * h, h), h)
                assert got == {j: want[r * h + j] for j in range(h)}, (head_split, world, r)
