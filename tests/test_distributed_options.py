"""Every rank of a collective call must pass the same options: a rank that differs makes every rank raise a
``ValueError`` that names the option and each rank's value. Ranks are gloo processes on the CPU.

Each case calls one entry point of :mod:`longattn.distributed` with one option set differently on rank 1; the
workers record what every rank raised, and the tests assert on those records.
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from longattn.utils import cu_seqlens_of

WORLD = 2
TIMEOUT_S = 120
D = 8  # head dim: the default scale is 8 ** -0.5 = 0.3535..., not 0.1


def _x(dtype=torch.float64):
    return torch.randn(1, 8, 2, D, generator=torch.Generator().manual_seed(0), dtype=dtype)


def _packed():
    return torch.randn(8, 2, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _ring(dtype=torch.float64, **kw):
    from longattn.distributed import ring_attention

    x = _x(dtype)
    return ring_attention(x, x, x, **{"backend": "torch", **kw})


def _ring_varlen(doc_lengths):
    from longattn.distributed import ring_attention

    x = _packed()
    return ring_attention(x, x, x, cu_seqlens=cu_seqlens_of(doc_lengths, "cpu"), backend="torch")


def _dilated(**kw):
    from longattn.distributed import ring_dilated_attention

    x = _x()
    kw = {"segment_lengths": (4, 16), "dilation_rates": (1, 2), "backend": "torch", **kw}
    return ring_dilated_attention(x, x, x, **kw)


def _dilated_varlen(doc_lengths):
    from longattn.distributed import ring_dilated_attention

    x = _packed()
    return ring_dilated_attention(x, x, x, cu_seqlens=cu_seqlens_of(doc_lengths, "cpu"), segment_lengths=(4,),
                                  dilation_rates=(1,), backend="torch")


def _with_transport(module: str, transport: str):
    """Ring or Ulysses attention under ``<module>.TRANSPORT = transport`` (a module setting compared across ranks)."""
    import importlib

    from longattn.distributed import ring_attention, ulysses_attention

    mod = importlib.import_module(f"longattn.distributed.{module}")
    saved, mod.TRANSPORT = mod.TRANSPORT, transport
    try:
        attend = ring_attention if module == "ring" else ulysses_attention
        x = _x()
        return attend(x, x, x, backend="torch")
    finally:
        mod.TRANSPORT = saved


def _host_twin_gather():
    """The option check's gloo twin of a group (made here for the gloo world, as it is for an NCCL group): every
    rank's value gathered in rank order, twice on the same twin."""
    from longattn.distributed.shards import _host_twin

    twin = _host_twin(dist.group.WORLD)
    assert twin is not None, "no twin made"
    for round_ in range(2):
        mine = torch.tensor([10 * round_ + dist.get_rank()], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        twin.allgather([every], [mine]).wait()
        got = [int(t) for t in every]
        assert got == [10 * round_ + r for r in range(dist.get_world_size())], got


def _unshard(dim):
    from longattn.distributed import unshard

    return unshard(_x(), layout="contiguous", dim=dim)


# name -> (entry point, its arguments on rank 0, on rank 1, words every rank's message must hold)
CASES = {
    # ranks passing different scales (was: no error, the gathered output off by 0.79)
    "ring-scale": (_ring, dict(scale=None), dict(scale=0.1),
                   ["ring_attention", "option scale differs", "rank 0 has None", "rank 1 has 0.1"]),
    "ring-causal": (_ring, dict(causal=True), dict(causal=False),
                    ["option causal differs", "rank 0 has True", "rank 1 has False"]),
    "ring-layout": (_ring, dict(layout="zigzag"), dict(layout="contiguous"),
                    ["option layout differs", "rank 0 has 'zigzag'", "rank 1 has 'contiguous'"]),
    "ring-backend": (_ring, {}, dict(backend="auto"),
                     ["option backend differs", "rank 0 has 'torch'", "rank 1 has 'auto'"]),
    "ring-return-lse": (_ring, dict(return_lse=False), dict(return_lse=True),
                        ["option return_lse differs", "rank 0 has False", "rank 1 has True"]),
    "ring-dtype": (_ring, {}, dict(dtype=torch.float32),
                   ["the dtype of q differs", "rank 0 has torch.float64", "rank 1 has torch.float32"]),
    "ring-varlen-cu-contents": (_ring_varlen, dict(doc_lengths=[5, 11]), dict(doc_lengths=[3, 13]),
                                ["option cu_seqlens differs", "rank 0 has [0, 5, 16]", "rank 1 has [0, 3, 16]"]),
    "dilated-segments": (_dilated, {}, dict(segment_lengths=(8, 16)),
                         ["ring_dilated_attention", "option segment_lengths differs", "rank 0 has (4, 16)",
                          "rank 1 has (8, 16)"]),
    "dilated-rates": (_dilated, {}, dict(dilation_rates=(1, 4)),
                      ["option dilation_rates differs", "rank 0 has (1, 2)", "rank 1 has (1, 4)"]),
    "dilated-scale": (_dilated, dict(scale=0.5), dict(scale=0.25),
                      ["option scale differs", "rank 0 has 0.5", "rank 1 has 0.25"]),
    "dilated-head-split": (_dilated, {}, dict(head_split=True),
                           ["option head_split differs", "rank 0 has False", "rank 1 has True"]),
    "dilated-varlen-cu-contents": (_dilated_varlen, dict(doc_lengths=[5, 11]), dict(doc_lengths=[6, 4, 6]),
                                   ["option cu_seqlens differs", "rank 0 has [0, 5, 16]",
                                    "rank 1 has [0, 6, 10, 16]"]),
    "ring-transport": (_with_transport, dict(module="ring", transport="auto"),
                       dict(module="ring", transport="nccl"),
                       ["option ring.TRANSPORT differs", "rank 0 has 'auto'", "rank 1 has 'nccl'"]),
    "ulysses-transport": (_with_transport, dict(module="ulysses", transport="nccl"),
                          dict(module="ulysses", transport="auto"),
                          ["option ulysses.TRANSPORT differs", "rank 0 has 'nccl'", "rank 1 has 'auto'"]),
    "ring-transport-unknown": (_with_transport, dict(module="ring", transport="nvlink"),
                               dict(module="ring", transport="nvlink"),
                               ["ring.TRANSPORT must be one of", "'nvlink'"]),
    "ulysses-transport-unknown": (_with_transport, dict(module="ulysses", transport="nvlink"),
                                  dict(module="ulysses", transport="nvlink"),
                                  ["ulysses.TRANSPORT must be one of", "'nvlink'"]),
    "unshard-dim": (_unshard, dict(dim=1), dict(dim=2), ["option dim differs", "rank 0 has 1", "rank 1 has 2"]),
}
# name -> (entry point, its arguments on rank 0, on rank 1): options that take effect alike must not raise
AGREEING = {
    "ring-scale-default-and-its-value": (_ring, dict(scale=None), dict(scale=D ** -0.5)),
    "dilated-segments-list-and-tuple": (_dilated, dict(segment_lengths=[4, 16]), dict(segment_lengths=(4, 16))),
    "unshard-negative-dim": (_unshard, dict(dim=1), dict(dim=-3)),
    "host-twin-allgather": (_host_twin_gather, {}, {}),
    # gloo on the CPU: "auto" moves the blocks by the group's collectives, as "nccl" does
    "ring-transport-auto-on-gloo": (_with_transport, dict(module="ring", transport="auto"),
                                    dict(module="ring", transport="auto")),
    "ulysses-transport-auto-on-gloo": (_with_transport, dict(module="ulysses", transport="auto"),
                                       dict(module="ulysses", transport="auto")),
}
# name -> (entry point, its arguments on every rank, the error type, words its message must hold)
REFUSED = {
    "ring-copy-engine-on-gloo": (_with_transport, dict(module="ring", transport="copy_engine"), "RuntimeError",
                                 ["TRANSPORT='copy_engine'", "copy-engine transfers cannot run", "'auto' or 'nccl'"]),
    "ulysses-copy-engine-on-cpu": (_with_transport, dict(module="ulysses", transport="copy_engine"), "RuntimeError",
                                   ["TRANSPORT='copy_engine'", "needs CUDA tensors", "'auto' or 'nccl'"]),
}


def _worker(rank: int, world: int, store_dir: str) -> None:
    from _ranks import end_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = {}
    try:
        for name, calls in {**CASES, **AGREEING, **REFUSED}.items():
            try:
                fn, kwargs = calls[0], calls[1 if name in REFUSED else 1 + min(rank, 1)]
                fn(**kwargs)
                results[name] = ("ok", None)
            except Exception as e:  # recorded, reported by the test of that case
                results[name] = (type(e).__name__, str(e))
            dist.barrier()
    finally:
        with open(os.path.join(store_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
        dist.destroy_process_group()
    end_worker()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _ranks import spawn_and_wait

    store_dir = str(tmp_path_factory.mktemp("options"))
    spawn_and_wait(_worker, (WORLD, store_dir), WORLD, TIMEOUT_S, "distributed option workers")
    out = []
    for rank in range(WORLD):
        with open(os.path.join(store_dir, f"rank{rank}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_differing_option_raises_on_every_rank_and_names_it(results, case):
    words = CASES[case][3]
    for rank, per_rank in enumerate(results):
        kind, message = per_rank[case]
        assert kind == "ValueError", f"rank {rank}: {kind} {message if kind != 'ok' else ''}"
        missing = [w for w in words if w not in message]
        assert not missing, f"rank {rank}: {missing} not in {message!r}"


@pytest.mark.parametrize("case", AGREEING)
def test_options_that_take_effect_alike_agree(results, case):
    for rank, per_rank in enumerate(results):
        kind, message = per_rank[case]
        assert kind == "ok", f"rank {rank}: {kind} {message}"


@pytest.mark.parametrize("case", REFUSED)
def test_a_transport_that_cannot_run_is_refused_on_every_rank(results, case):
    _, _, kind_wanted, words = REFUSED[case]
    for rank, per_rank in enumerate(results):
        kind, message = per_rank[case]
        assert kind == kind_wanted, f"rank {rank}: {kind} {message}"
        missing = [w for w in words if w not in message]
        assert not missing, f"rank {rank}: {missing} not in {message!r}"


def test_differences_group_ranks_by_value():
    """Ranks with the same value are listed together; a default shows what it resolved to; equal ones are left
    out."""
    from longattn.distributed.shards import differences

    facts = [[("option scale", 0.5, None), ("option causal", True, True)],
             [("option scale", 0.1, 0.1), ("option causal", True, True)],
             [("option scale", 0.5, 0.5), ("option causal", True, True)],
             [("option scale", 0.1, 0.1), ("option causal", True, True)]]
    assert differences(facts) == ["option scale differs across ranks: ranks 0, 2 have None (= 0.5), ranks 1, 3 "
                                  "have 0.1"]
    long = [[("option cu_seqlens", list(range(0, 1000, 5)), list(range(0, 1000, 5)))],
            [("option cu_seqlens", list(range(0, 995, 5)) + [996], list(range(0, 995, 5)) + [996])]]
    (line,) = differences(long)
    assert "first at index 199: 995 vs 996" in line and len(line) < 600
