"""Sequence parallelism in 8 processes (CPU, gloo): Ulysses, the hybrid on the 2 x 4 and 4 x 2 grids, and the ring.

One world of 8 is spawned once (a module-scoped fixture) and runs a small set of cases chosen to cover every kind
that :mod:`test_ulysses` and :mod:`test_distributed` check at 2 and 4 processes: both layouts, causal and not,
fewer key/value heads than the degree (GQA and MQA; 6 heads, which neither divides 8 nor is divided by it), packed
batches. Each case compares this rank's part of the output, of the log-sum-exp and of the gradients of q, k and v
(the loss reads the log-sum-exp too) with :mod:`longattn.reference` on the whole sequence, in float64 (the checks of
:func:`test_ulysses._check`).
"""
from __future__ import annotations

import pytest

from _ranks import cases_fixture, check_case, gloo_group, grid_groups, run_cases
from longattn.utils import cu_seqlens_of
from test_ulysses import _check, _doc_lengths, _flash, _hybrid_case, _reference

WORLD = 8
TIMEOUT_S = 150
GRIDS = ((2, 4), (4, 2))  # (ring R, Ulysses U), Ulysses over consecutive ranks
# name -> (layout, causal, Hq, Hk)
ULYSSES_CASES = {
    "ulysses-contiguous-full-gqa": ("contiguous", False, 8, 2),
    "ulysses-contiguous-causal-gqa-6": ("contiguous", True, 24, 6),
    "ulysses-zigzag-full-mha": ("zigzag", False, 8, 8),
    "ulysses-zigzag-causal-mqa": ("zigzag", True, 8, 1),
}
# name -> (layout, causal, Hq, Hk): packed batches of 12 rows per rank, documents crossing shards
ULYSSES_PACKED_CASES = {
    "ulysses-packed-contiguous-causal-gqa": ("contiguous", True, 8, 2),
    "ulysses-packed-zigzag-full-gqa-6": ("zigzag", False, 24, 6),
}
# name -> (layout, causal, Hq, Hk, packed); each runs on both GRIDS (Hk 2 is below the 2 x 4 grid's U = 4)
HYBRID_CASES = {
    "hybrid-zigzag-causal-gqa": ("zigzag", True, 8, 2, False),
    "hybrid-contiguous-full-mqa": ("contiguous", False, 8, 1, False),
    "hybrid-packed-causal-gqa": ("contiguous", True, 8, 2, True),
}
# name -> (layout, causal, Hq, Hk, packed)
RING_CASES = {
    "ring-zigzag-causal-gqa": ("zigzag", True, 8, 2, False),
    "ring-contiguous-full-mqa": ("contiguous", False, 8, 1, False),
    "ring-packed-balanced-causal-gqa": ("balanced", True, 8, 2, True),
}
ALL_CASES = tuple(ULYSSES_CASES) + tuple(ULYSSES_PACKED_CASES) + tuple(HYBRID_CASES) + ("hybrid-mesh",) \
    + tuple(RING_CASES)


# ----------------------------------------------------------------------------------------------------------------
# worker side

def _hybrid_mesh_case(world):
    """A 2-D DeviceMesh (ring 2, Ulysses 4) instead of the two groups."""
    from torch.distributed.device_mesh import init_device_mesh

    from longattn.distributed import hybrid_attention, shard_hybrid

    mesh = init_device_mesh("cpu", GRIDS[0], mesh_dim_names=("ring", "ulysses"))
    _check(lambda q, k, v, cu: hybrid_attention(q, k, v, mesh=mesh, causal=True, backend="torch", return_lse=True),
           _reference(True), 8, 2, seed=3, part=lambda t, dim: shard_hybrid(t, layout="zigzag", dim=dim, mesh=mesh),
           world=world)


def _ring_case(name, world):
    from longattn.distributed import ring_attention, shard

    layout, causal, Hq, Hk, packed = RING_CASES[name]
    cu = cu_seqlens_of(_doc_lengths(12 * world)) if packed else None  # the batch _check packs
    _check(lambda q, k, v, cu: ring_attention(q, k, v, layout=layout, causal=causal, backend="torch",
                                              return_lse=True, cu_seqlens=cu),
           _reference(causal), Hq, Hk, seed=len(name),
           part=lambda t, dim: shard(t, layout=layout, dim=dim, cu_seqlens=cu), world=world, packed=packed)


def _case(name, grids, world):
    if name in ULYSSES_CASES:
        _flash(*ULYSSES_CASES[name], seed=len(name))
    elif name in ULYSSES_PACKED_CASES:
        _flash(*ULYSSES_PACKED_CASES[name], seed=len(name), packed=True)
    elif name in HYBRID_CASES:
        _hybrid_case(name, grids, world, HYBRID_CASES)
    elif name == "hybrid-mesh":
        _hybrid_mesh_case(world)
    else:
        _ring_case(name, world)


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        grids = {grid: grid_groups(*grid) for grid in GRIDS}  # (ring group, Ulysses group) of this rank
        run_cases(rank, store_dir, ALL_CASES, lambda name: _case(name, grids, world))


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "sequence-parallel workers")


# ----------------------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", ALL_CASES)
def test_world8_case(results, case):
    check_case(results, case)
