"""Every rank of a collective call must pass the same options: a rank that differs makes every rank raise a
``ValueError`` that names the option and each rank's value. Ranks are gloo processes on the CPU.

Each case calls one entry point of :mod:`longattn.distributed` with one option set differently on rank 1; the
workers record what every rank raised, and the tests assert on those records.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from datetime import timedelta
from typing import Optional

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


def _with_grad(requires_grad, scheme="ring"):
    """A call whose backward then runs where it has one (rank 1 without gradients: its backward would never come,
    and rank 0's would wait in its collectives for the group's timeout)."""
    from longattn.distributed import ring_attention, ulysses_attention

    x = _x().requires_grad_(requires_grad)
    fn = ring_attention if scheme == "ring" else ulysses_attention
    out = fn(x, x, x, causal=True, backend="torch")
    if out.requires_grad:
        out.sum().backward()


def _sinks_with_grad(requires_grad):
    from longattn.distributed import ring_attention

    x = _x()
    sinks = torch.zeros(2, dtype=torch.float32, requires_grad=requires_grad)
    out = ring_attention(x, x, x, causal=True, backend="torch", sinks=sinks)
    if out.requires_grad:
        out.sum().backward()


def _ring_grads(needs_grad, sinks_grad=False, packed=False):
    """The ring with gradients for the inputs named in ``needs_grad`` (of ``"qkv"``) and the sinks, then its backward
    where it has one. The ring's backward runs its collectives only for q, k or v (the sinks' gradient is local), and
    the packed contiguous ring's for k or v (the rows it fetched); ranks where the call has a backward without them
    skip those collectives (was: no error, rank 0's backward waited in the ring's exchange for the group's
    timeout)."""
    from longattn.distributed import ring_attention

    x = _packed() if packed else _x()
    q, k, v = (x.clone().requires_grad_(name in needs_grad) for name in "qkv")
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=sinks_grad)
    kw = dict(cu_seqlens=cu_seqlens_of([5, 11], "cpu")) if packed else dict(sinks=sinks)
    out = ring_attention(q, k, v, causal=True, backend="torch", **kw)
    if out.requires_grad:
        out.sum().backward()


def _unshard_hybrid(ring, **kw):
    """``unshard_hybrid`` over a grid of the two ranks (``ring`` 2: a ring of both, Ulysses groups of one; 1: one
    Ulysses group of both, rings of one)."""
    from _ranks import grid_groups

    from longattn.distributed import unshard_hybrid

    ring_group, ulysses_group = grid_groups(ring, WORLD // ring)
    return unshard_hybrid(_x(), ring_group=ring_group, ulysses_group=ulysses_group, **kw)


def _unshard_grad(requires_grad):
    """``unshard`` (no backward) of a shard that requires gradients on some ranks only."""
    from longattn.distributed import unshard

    return unshard(_x().requires_grad_(requires_grad))


def _packed_zigzag(fn):
    """``shard`` or ``unshard`` of a packed batch (``cu_seqlens``) in the zigzag layout, which Ulysses takes cut
    without ``cu_seqlens``."""
    from longattn.distributed import shard, unshard

    cu = cu_seqlens_of([5, 11], "cpu")
    if fn == "shard":
        return shard(torch.zeros(16, 2, D), layout="zigzag", dim=0, cu_seqlens=cu)
    return unshard(_packed(), layout="zigzag", dim=0, cu_seqlens=cu)


def _hybrid(sinks_grad=False, ring=1, backend="torch"):
    """``hybrid_attention`` over a grid of the two ranks (``ring`` 2: one ring of both; 1: one Ulysses group of
    both), with sinks that need a gradient or not; its backward where it has one."""
    from _ranks import grid_groups

    from longattn.distributed import hybrid_attention

    ring_group, ulysses_group = grid_groups(ring, WORLD // ring)
    x = _x()
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=sinks_grad)
    out = hybrid_attention(x, x, x, ring_group=ring_group, ulysses_group=ulysses_group, sinks=sinks, backend=backend,
                           layout="contiguous")
    if out.requires_grad:
        out.sum().backward()


def _either(scheme):
    from longattn.distributed import ring_attention, ulysses_attention

    x = _x()
    (ring_attention if scheme == "ring" else ulysses_attention)(x, x, x, causal=True, backend="torch")


def _explain_then_call(scheme):
    """``longattn.explain`` of a collective call raises on every rank before any communication (it planned one
    block and left the pass half-way: the next real call hung in its option check); the real call after it runs."""
    import longattn
    from longattn.distributed import ring_attention, ulysses_attention

    x = _x()
    fn = ring_attention if scheme == "ring" else ulysses_attention
    try:
        longattn.explain(fn, x, x, x, causal=True, backend="torch")
    except ValueError as e:
        assert "is a collective call across ranks" in str(e), e
    else:
        raise AssertionError("explain planned a collective call")
    fn(x, x, x, causal=True, backend="torch")


def _ring_varlen(doc_lengths):
    from longattn.distributed import ring_attention

    x = _packed()
    return ring_attention(x, x, x, cu_seqlens=cu_seqlens_of(doc_lengths, "cpu"), backend="torch")


def _dilated(**kw):
    from longattn.distributed import ring_dilated_attention

    x = _x()
    kw = {"segment_lengths": (4, 16), "dilation_rates": (1, 2), "backend": "torch", **kw}
    return ring_dilated_attention(x, x, x, **kw)


def _dilated_with_options(packed: bool = False, **fields):
    """LongNet's ring (a packed batch where ``packed``) given ``options=ParallelOptions(**fields)``."""
    from longattn.distributed import ParallelOptions

    if packed:
        from longattn.distributed import ring_dilated_attention

        x = _packed()
        return ring_dilated_attention(x, x, x, cu_seqlens=cu_seqlens_of([16], "cpu"), segment_lengths=(4,),
                                      dilation_rates=(1,), backend="torch", options=ParallelOptions(**fields))
    return _dilated(options=ParallelOptions(**fields))


def _dilated_varlen(doc_lengths):
    from longattn.distributed import ring_dilated_attention

    x = _packed()
    return ring_dilated_attention(x, x, x, cu_seqlens=cu_seqlens_of(doc_lengths, "cpu"), segment_lengths=(4,),
                                  dilation_rates=(1,), backend="torch")


def _with_options(scheme: str, **fields):
    """Ring or Ulysses attention given ``options=ParallelOptions(**fields)`` (``fields`` None: options that are not
    a ParallelOptions, a dict)."""
    from longattn.distributed import ParallelOptions, ring_attention, ulysses_attention

    options = {"transport": "nccl"} if fields.get("transport") == "dict" else ParallelOptions(**fields)
    attend = ring_attention if scheme == "ring" else ulysses_attention
    x = _x()
    return attend(x, x, x, backend="torch", options=options)


def _first_check_of_a_device_group(host_checks: bool):
    """The agreement an NCCL group's members make on their first check, on where their checks exchange (its gloo
    twin or the group itself; run here on the gloo world as on a device group, which the CPU cannot make): ranks
    passing different ``host_checks`` all raise, naming them (was: on an NCCL group, one rank gathered on the twin
    and the other on the group, and both waited for good); an agreed value is kept."""
    from longattn.distributed import shards

    kept = dict(shards._CHECK_CHANNELS)
    try:
        assert shards._agree_host_checks(None, host_checks, dist.get_world_size(), "") == host_checks
        assert shards._agree_host_checks(None, not host_checks, dist.get_world_size(), "") == host_checks
    finally:
        shards._CHECK_CHANNELS.clear()
        shards._CHECK_CHANNELS.update(kept)


@contextlib.contextmanager
def _as_a_device_group():
    """The checks of the gloo world made as on an NCCL group (the agreement on ``host_checks`` at the group's first
    check, the channel it keeps): the CPU's short-cut to each rank's own value is bypassed; restored after."""
    from longattn.distributed import shards

    kept, agreed = dict(shards._CHECK_CHANNELS), shards._agreed_host_checks
    shards._CHECK_CHANNELS.clear()
    shards._agreed_host_checks = shards._agree_host_checks
    try:
        yield shards
    finally:
        shards._agreed_host_checks = agreed
        shards._CHECK_CHANNELS.clear()
        shards._CHECK_CHANNELS.update(kept)


def _checks_exchange_where_the_group_agreed():
    """On a device group each check exchanges where the group's members agreed (the first check's value), and a
    value every rank passes moves the group there from the next check on: the channels of four checks passing
    True, False, False, True are True (agreed), True (still agreed), False (moved), False (still)."""
    with _as_a_device_group() as shards:
        used, gather = [], shards.gather_ints

        def spy(group, world, values, host_checks=True, *args):
            used.append(host_checks)
            return gather(group, world, values, host_checks, *args)
        shards.gather_ints = spy
        try:
            for host_checks in (True, False, False, True):
                shards.check_same_across_ranks(None, {}, fn="f", host_checks=host_checks, differentiable=False)
        finally:
            shards.gather_ints = gather
        assert used == [True, True, False, False], used


def _device_group_first_check_with_an_input_error(host_checks: Optional[bool]):
    """A device group's first check where one rank's options are not a ParallelOptions (``host_checks`` None: its
    input error, and the default standing in for its ``host_checks``) and its peer passes another value: the input
    error is what every rank reports (was: ``options.host_checks differs``, naming a value the rank never passed)."""
    with _as_a_device_group():
        return _with_options("ring", **({"transport": "dict"} if host_checks is None else
                                        {"host_checks": host_checks}))


def _packed_ring_with_options(**fields):
    """The packed ring (``cu_seqlens``) given ``options=ParallelOptions(**fields)``."""
    from longattn.distributed import ParallelOptions, ring_attention

    world = dist.get_world_size()
    x = torch.randn(8, 2, D, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    cu = torch.tensor([0, 3 * world, 8 * world], dtype=torch.int32)
    return ring_attention(x, x, x, cu_seqlens=cu, backend="torch", options=ParallelOptions(**fields))


def _counting_all_to_alls(fn):
    """``(fn(), how many all-to-alls it issued)``: calls of Ulysses' one all-to-all (``dist.all_to_all``, or its
    point-to-point form where the backend has none)."""
    from longattn.distributed import all_to_all

    calls = []
    issue = all_to_all._all_to_all

    def counted(*args, **kwargs):
        calls.append(1)
        return issue(*args, **kwargs)
    all_to_all._all_to_all = counted
    try:
        return fn(), len(calls)
    finally:
        all_to_all._all_to_all = issue


def _no_module_settings():
    """The five module settings the options replaced are gone: set on their modules, they change nothing (a call
    with the default options still moves its blocks by the group's collectives, cuts Ulysses' heads in 2 groups,
    exchanges its check on the host and leaves the copy engines' timeout to the group); each call reads its own
    options, and nothing of one call's options stays for the next."""
    from longattn.distributed import ParallelOptions, copy_engine, ring, ring_attention, shards, ulysses
    from longattn.distributed import ulysses_attention

    x = torch.randn(1, 8, 8, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # 4 heads a rank
    attend = lambda **kw: ulysses_attention(x, x, x, backend="torch", layout="contiguous", **kw)  # noqa: E731
    _, default_calls = _counting_all_to_alls(attend)
    _, four_calls = _counting_all_to_alls(lambda: attend(options=ParallelOptions(head_chunks=4)))
    assert (default_calls, four_calls) == (4, 8), (default_calls, four_calls)  # (in and out, per head group)
    asked = []
    host_group = shards.host_group
    shards.host_group = lambda group, enabled=True: asked.append(enabled) or host_group(group, enabled)
    old = [(ring, "TRANSPORT", "copy_engine"), (ulysses, "TRANSPORT", "copy_engine"), (ulysses, "HEAD_CHUNKS", 4),
           (shards, "HOST_CHECKS", False), (copy_engine, "TIMEOUT_S", 1e-3)]
    try:
        for module, name, value in old:
            assert not hasattr(module, name), f"{module.__name__}.{name} still exists"
            setattr(module, name, value)
        ring_attention(x, x, x, backend="torch")  # (the copy engines would refuse gloo)
        _, calls = _counting_all_to_alls(attend)
        assert calls == default_calls, (calls, default_calls)
        ring_attention(x, x, x, backend="torch", options=ParallelOptions(host_checks=False))
        assert asked == [True, True, False], asked
    finally:
        shards.host_group = host_group
        for module, name, _ in old:
            delattr(module, name)


def _ulysses_without_list_all_to_all():
    """Where the group's backend has no ``dist.all_to_all`` of tensor lists (gloo up to PyTorch 2.11: every
    Ulysses, hybrid and context-parallel call on the CPU raised "Backend gloo does not support alltoall"), Ulysses
    exchanges its heads by point-to-point sends instead: the output and gradients are the reference's. The refusal
    is met once per backend, not on every exchange."""
    from longattn import reference
    from longattn.distributed import all_to_all, shard, ulysses_attention

    refused = []

    def refuse(*args, **kwargs):
        refused.append(1)
        raise RuntimeError("Backend gloo does not support alltoall")
    full = torch.randn(1, 8, 8, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64,
                       requires_grad=True)
    want = reference.flash_attention(full, full, full, causal=True)
    want.sum().backward()
    part = shard(full.detach(), layout="contiguous").requires_grad_()
    issue = dist.all_to_all
    dist.all_to_all = refuse
    try:
        out = ulysses_attention(part, part, part, causal=True, backend="torch", layout="contiguous")
        out.sum().backward()
    finally:
        dist.all_to_all = issue
        all_to_all._WITHOUT_ALL_TO_ALL.clear()  # (the next cases' exchanges ask again)
    assert len(refused) == 1, f"all-to-all asked for {len(refused)} times after a refusal, not once"
    torch.testing.assert_close(out, shard(want.detach(), layout="contiguous"))
    torch.testing.assert_close(part.grad, shard(full.grad, layout="contiguous"))


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
    # one rank with gradients, the other without (was: rank 0's backward waited for the group's timeout)
    "ring-backward": (_with_grad, dict(requires_grad=True), dict(requires_grad=False),
                      ["ring_attention", "whether the call has a backward", "rank 0 has True", "rank 1 has False"]),
    "ulysses-backward": (_with_grad, dict(requires_grad=True, scheme="ulysses"),
                         dict(requires_grad=False, scheme="ulysses"),
                         ["ulysses_attention", "whether the call has a backward", "rank 1 has False"]),
    "sinks-backward": (_sinks_with_grad, dict(requires_grad=True), dict(requires_grad=False),
                       ["whether the call has a backward", "rank 0 has True", "rank 1 has False"]),
    # (was: no error, rank 0's backward waited in its all-to-all for the group's timeout)
    "hybrid-sinks-backward": (_hybrid, dict(sinks_grad=True), dict(sinks_grad=False),
                              ["hybrid_attention", "whether the call has a backward", "rank 0 has True",
                               "rank 1 has False"]),
    # rank 1's call has a backward (its sinks need a gradient) but the ring's collectives are not in it
    "ring-backward-of-sinks-only": (_ring_grads, dict(needs_grad="q", sinks_grad=True),
                                    dict(needs_grad="", sinks_grad=True),
                                    ["ring_attention", "whether the call's backward runs collectives",
                                     "one of q, k, v requiring gradients", "rank 0 has True", "rank 1 has False"]),
    "packed-ring-backward-without-k-or-v": (_ring_grads, dict(needs_grad="k", packed=True),
                                            dict(needs_grad="q", packed=True),
                                            ["ring_attention", "whether the call's backward runs collectives",
                                             "one of k, v requiring gradients", "rank 0 has True",
                                             "rank 1 has False"]),
    # a failure inside one Ulysses group reaches every rank of the grid (was: rank 0 raised, rank 1 waited in the
    # ring group's gather for the group's timeout)
    "unshard-hybrid-failure-in-one-ulysses-group": (_unshard_hybrid, dict(ring=2, dim=7), dict(ring=2, dim=1),
                                                    ["unshard_hybrid: invalid input on 1 rank(s)",
                                                     "rank 0: unshard_hybrid: dim=7 is out of range"]),
    # the ring's layout compared inside the Ulysses group too (was: rank 0 raised, rank 1 returned the gathered
    # tensor, their next collectives unmatched)
    "unshard-hybrid-ring-layout": (_unshard_hybrid, dict(ring=1, layout="contiguous"), dict(ring=1, layout="zigzag"),
                                   ["unshard_hybrid", "option ring layout differs", "rank 0 has 'contiguous'",
                                    "rank 1 has 'zigzag'"]),
    # ranks calling different functions: said so first (it was a list of their options' differences)
    "different-functions": (_either, dict(scheme="ring"), dict(scheme="ulysses"),
                            ["the function called differs", "rank 0 has 'ring_attention'",
                             "rank 1 has 'ulysses_attention'"]),
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
    "ring-transport": (_with_options, dict(scheme="ring", transport="auto"),
                       dict(scheme="ring", transport="nccl"),
                       ["ring_attention", "option options.transport differs", "rank 0 has 'auto'",
                        "rank 1 has 'nccl'"]),
    "ulysses-transport": (_with_options, dict(scheme="ulysses", transport="nccl"),
                          dict(scheme="ulysses", transport="auto"),
                          ["ulysses_attention", "option options.transport differs", "rank 0 has 'nccl'",
                           "rank 1 has 'auto'"]),
    "ulysses-head-chunks": (_with_options, dict(scheme="ulysses"), dict(scheme="ulysses", head_chunks=1),
                            ["option options.head_chunks differs", "rank 0 has 2", "rank 1 has 1"]),
    "ring-transport-unknown": (_with_options, dict(scheme="ring", transport="nvlink"),
                               dict(scheme="ring", transport="nvlink"),
                               ["ParallelOptions.transport must be one of", "'nvlink'"]),
    "ulysses-transport-unknown": (_with_options, dict(scheme="ulysses", transport="nvlink"),
                                  dict(scheme="ulysses", transport="nvlink"),
                                  ["ParallelOptions.transport must be one of", "'nvlink'"]),
    # options that are not a ParallelOptions on one rank: every rank raises, naming it
    "ring-options-not-parallel-options": (_with_options, dict(scheme="ring"), dict(scheme="ring", transport="dict"),
                                          ["ring_attention: invalid input on 1 rank(s)",
                                           "rank 1: ring_attention: options must be a "
                                           "longattn.distributed.ParallelOptions or None, got dict"]),
    "unshard-dim": (_unshard, dict(dim=1), dict(dim=2), ["option dim differs", "rank 0 has 1", "rank 1 has 2"]),
    # where the checks exchange: compared as any option (on an NCCL group a difference was a hang)
    "ring-host-checks": (_with_options, dict(scheme="ring"), dict(scheme="ring", host_checks=False),
                         ["option options.host_checks differs", "rank 0 has True", "rank 1 has False"]),
    "host-checks-on-a-device-group's-first-check": (_first_check_of_a_device_group, dict(host_checks=True),
                                                    dict(host_checks=False),
                                                    ["option options.host_checks differs across ranks",
                                                     "rank 0 passes True", "rank 1 passes False"]),
    "host-checks-differ-beside-an-input-error-on-a-device-group's-first-check": (
        _device_group_first_check_with_an_input_error, dict(host_checks=False), dict(host_checks=None),
        ["invalid input on 1 rank(s)", "rank 1: ring_attention: options must be a "
         "longattn.distributed.ParallelOptions or None, got dict"]),
}
# name -> (entry point, its arguments on rank 0, on rank 1): options that take effect alike must not raise
AGREEING = {
    "ring-scale-default-and-its-value": (_ring, dict(scale=None), dict(scale=D ** -0.5)),
    "dilated-segments-list-and-tuple": (_dilated, dict(segment_lengths=[4, 16]), dict(segment_lengths=(4, 16))),
    "unshard-negative-dim": (_unshard, dict(dim=1), dict(dim=-3)),
    # unshard has no backward: whether its input requires gradients is no difference (was: a ValueError naming it)
    "unshard-of-a-tensor-requiring-gradients-on-one-rank": (_unshard_grad, dict(requires_grad=True),
                                                            dict(requires_grad=False)),
    # the ring's backward for q, k or v alike on every rank (sinks or not), the packed ring's for k or v alike
    "ring-backward-with-different-inputs-needing-gradients": (_ring_grads, dict(needs_grad="q", sinks_grad=True),
                                                              dict(needs_grad="v")),
    "packed-ring-backward-with-different-keys-values": (_ring_grads, dict(needs_grad="qk", packed=True),
                                                        dict(needs_grad="v", packed=True)),
    "host-twin-allgather": (_host_twin_gather, {}, {}),
    "explain-ring-refused-then-a-real-call": (_explain_then_call, dict(scheme="ring"), dict(scheme="ring")),
    "explain-ulysses-refused-then-a-real-call": (_explain_then_call, dict(scheme="ulysses"), dict(scheme="ulysses")),
    # gloo on the CPU: "auto" moves the blocks by the group's collectives, as "nccl" does
    "ring-transport-auto-on-gloo": (_with_options, dict(scheme="ring", transport="auto"),
                                    dict(scheme="ring", transport="auto")),
    "ulysses-transport-auto-on-gloo": (_with_options, dict(scheme="ulysses", transport="auto"),
                                       dict(scheme="ulysses", transport="auto")),
    # the copy engines' timeout is not compared (it changes no collective)
    "ring-timeout-not-compared": (_with_options, dict(scheme="ring"), dict(scheme="ring", copy_engine_timeout_s=9.0)),
    "host-checks-agreed-on-a-device-group's-first-check": (_first_check_of_a_device_group, dict(host_checks=False),
                                                           dict(host_checks=False)),
    # a new value every rank passes: the next calls exchange there
    "ring-host-checks-changed-on-every-rank": (_with_options, dict(scheme="ring", host_checks=False),
                                               dict(scheme="ring", host_checks=False)),
    "checks-exchange-where-the-group-agreed": (_checks_exchange_where_the_group_agreed, {}, {}),
    "no-module-settings": (_no_module_settings, {}, {}),
    "ulysses-without-a-list-all-to-all": (_ulysses_without_list_all_to_all, {}, {}),
}
# name -> (entry point, its arguments on every rank, the error type, words its message must hold)
REFUSED = {
    "ring-copy-engine-on-gloo": (_with_options, dict(scheme="ring", transport="copy_engine"), "RuntimeError",
                                 ["ring_attention: ParallelOptions.transport='copy_engine'",
                                  "copy-engine transfers cannot run", "'auto' or 'nccl'"]),
    "ulysses-copy-engine-on-cpu": (_with_options, dict(scheme="ulysses", transport="copy_engine"), "RuntimeError",
                                   ["ulysses: ParallelOptions.transport='copy_engine'", "needs CUDA tensors",
                                    "'auto' or 'nccl'"]),
    # the same bad input on every rank: its message once, with the ranks that hold it
    "same-error-on-every-rank-said-once": (_ring, dict(layout="bogus"), "ValueError",
                                           ["invalid input on", "ranks 0-", "layout must be None or one of"]),
    # a backend the ring's blocks cannot run (their explicit passes: FA4 has none), refused before any rank sends (was:
    # raised by the first block on every rank, the ring's posted messages left behind, the next collective hung)
    "ring-fa4-blocks": (_ring, dict(backend="fa4"), "ValueError", ["ring_attention: backend='fa4' cannot run"]),
    "dilated-fa4-blocks": (_dilated, dict(backend="fa4"), "ValueError",
                           ["ring_dilated_attention: backend='fa4' cannot run"]),
    "hybrid-fa4-ring-blocks": (_hybrid, dict(ring=2, backend="fa4"), "ValueError",
                               ["hybrid_attention: backend='fa4' cannot run"]),
    # a packed batch in the zigzag layout (Ulysses'): the error says how to cut its rows
    "shard-packed-zigzag": (_packed_zigzag, dict(fn="shard"), "ValueError",
                            ["shard: a packed batch (cu_seqlens) takes layout 'balanced' or 'contiguous', got "
                             "'zigzag'", "pass no cu_seqlens here", "shard(x, layout='zigzag', dim=0)"]),
    "unshard-packed-zigzag": (_packed_zigzag, dict(fn="unshard"), "ValueError",
                              ["unshard: a packed batch (cu_seqlens) takes layout", "pass no cu_seqlens here"]),
    # asked for explicitly where it has no path: refused, never ignored
    "packed-ring-copy-engine": (_packed_ring_with_options, dict(transport="copy_engine"), "ValueError",
                                ["ring_attention: ParallelOptions.transport='copy_engine' has no packed-batch",
                                 "'auto' or 'nccl'"]),
    # LongNet's ring has no copy-engine transfers (it ran NCCL's, silently)
    "dilated-copy-engine": (_dilated_with_options, dict(transport="copy_engine"), "ValueError",
                            ["ring_dilated_attention: ParallelOptions.transport='copy_engine' has no path here",
                             "'auto' or 'nccl'", "ulysses_dilated_attention"]),
    "packed-dilated-copy-engine": (_dilated_with_options, dict(packed=True, transport="copy_engine"), "ValueError",
                                   ["ring_dilated_attention: ParallelOptions.transport='copy_engine'"]),
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


@pytest.mark.parametrize("fields, kind, words", [
    (dict(transport="nvlink"), ValueError, ["ParallelOptions.transport must be one of ('auto', 'nccl', 'copy_engine')",
                                            "'nvlink'"]),
    (dict(transport=None), ValueError, ["ParallelOptions.transport must be one of", "None"]),
    (dict(head_chunks=0), ValueError, ["ParallelOptions.head_chunks must be an int >= 1", "got 0"]),
    (dict(head_chunks=2.0), TypeError, ["ParallelOptions.head_chunks must be an int >= 1", "float 2.0"]),
    (dict(head_chunks=True), TypeError, ["ParallelOptions.head_chunks must be an int >= 1", "bool True"]),
    (dict(host_checks=1), TypeError, ["ParallelOptions.host_checks must be True or False", "int 1"]),
    (dict(copy_engine_timeout_s=0), ValueError, ["ParallelOptions.copy_engine_timeout_s must be None",
                                                 "seconds > 0", "got 0"]),
    (dict(copy_engine_timeout_s=float("nan")), ValueError, ["ParallelOptions.copy_engine_timeout_s", "nan"]),
    (dict(copy_engine_timeout_s="60"), TypeError, ["ParallelOptions.copy_engine_timeout_s must be None",
                                                   "str '60'"]),
])
def test_parallel_options_refuse_bad_fields_naming_them(fields, kind, words):
    from longattn.distributed import ParallelOptions

    with pytest.raises(kind) as info:
        ParallelOptions(**fields)
    missing = [w for w in words if w not in str(info.value)]
    assert not missing, (missing, str(info.value))


def test_parallel_options_defaults_and_replace():
    """The defaults are today's behaviour (NCCL, 2 head groups, checks on the host, the group's timeout); the value
    is frozen, and a replaced one is checked again."""
    import dataclasses

    from longattn.distributed import ParallelOptions

    o = ParallelOptions()
    assert (o.transport, o.head_chunks, o.host_checks, o.copy_engine_timeout_s) == ("auto", 2, True, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.transport = "nccl"
    assert dataclasses.replace(o, copy_engine_timeout_s=30).copy_engine_timeout_s == 30
    with pytest.raises(ValueError, match="ParallelOptions.head_chunks"):
        dataclasses.replace(o, head_chunks=-1)


def test_the_kept_fingerprint_is_the_digest_and_tells_reprs_apart():
    """The fingerprint kept per signature equals the digest of the values, and values whose ``repr`` differ never
    share one (``1``, ``1.0``, ``True``; ``0.0`` and ``-0.0``; a tuple and a list); values it cannot key (NaN, lists of
    floats) are digested each time."""
    from longattn.distributed.shards import _digest, _exact_key, _facts, _fingerprint

    values = [1, 1.0, True, 0.0, -0.0, None, "1", (0, 5, 16), [0, 5, 16], (0, 5, 17), torch.float32, torch.float64]
    facts = [_facts({"q": torch.zeros(1, 2, 3, 4)}, {"x": v}) for v in values]
    assert len({_exact_key(f) for f in facts}) == len(values)
    assert [_fingerprint(f) for f in facts] == [_digest(f) for f in facts]
    assert len({_fingerprint(f) for f in facts}) == len(values)
    for unkeyed in (float("nan"), [[0.5, 0.25]]):
        f = _facts({}, {"x": unkeyed})
        assert _exact_key(f) is None and _fingerprint(f) == _digest(f)
