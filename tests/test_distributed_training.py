"""A training step's collectives beside the attention, on the CPU with gloo (2 processes): the gradients' reduction of
:class:`longattn.distributed.ContextParallel` where a parameter has a gradient on some ranks only (a
mixture-of-experts' expert no token of one rank's shard was routed to), and backends a rank's call cannot run,
refused before any communication, naming the function called (and the distributed modules' at construction).

Two processes are spawned once (a module-scoped fixture); the workers run every case and record None or the
failure text.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _ranks import cases_fixture, check_case, expect_error, expect_value_error, gloo_group, normal, run_cases

from longattn.distributed import (  # noqa: E402
    ContextParallel, RingDilatedAttention, RingMultiheadDilatedAttention, ring_attention, ring_dilated_attention,
    shard, ulysses_attention,
)
from longattn.nn import MultiheadDilatedAttention  # noqa: E402
from longattn.utils import cu_seqlens_of  # noqa: E402

WORLD = 2
TIMEOUT_S = 90
CASES = ("gradients-on-some-ranks", "gradients-parameter-count", "ulysses-backend-refused",
         "ring-mha-module-options-differ", "batched-gradients-refused", "ring-mha-module-zigzag-shard",
         "ring-modules-deepcopy-subgroup")


# ----------------------------------------------------------------------------------------------------------------
# worker side

def _experts() -> torch.nn.ModuleDict:
    experts = torch.nn.ModuleDict({name: torch.nn.Linear(2, 2) for name in ("a", "b", "c", "unused")}).double()
    for p in experts.parameters():
        torch.nn.init.ones_(p)
    return experts


def _gradients_on_some_ranks(rank: int) -> None:
    """Expert b gets tokens on rank 0 only: its gradient is rank 0's on every rank, c's the sum of both ranks' (as
    one process would compute), and the expert no rank used keeps no gradient."""
    experts = _experts()
    x = torch.ones(1, 2, dtype=torch.float64)
    y = experts["a"](x) + 2 * experts["c"](x)
    if rank == 0:
        y = y + 3 * experts["b"](x)
    y.sum().backward()
    ContextParallel().all_reduce_gradients(experts)
    want = {"a": 2.0, "b": 3.0, "c": 4.0}  # (d/dW of sum(W x + b) with x = 1: the factor, per rank)
    for name, module in experts.items():
        for p in module.parameters():
            if name == "unused":
                if p.grad is not None:
                    raise AssertionError(f"the unused expert got a gradient: {p.grad}")
            elif p.grad is None or not torch.equal(p.grad, torch.full_like(p, want[name])):
                raise AssertionError(f"expert {name}: gradient {p.grad}, want {want[name]} everywhere")


def _gradients_parameter_count(rank: int) -> None:
    experts = _experts()
    params = list(experts.parameters())[:4 + rank]  # rank 1 passes one more
    expect_value_error(lambda: ContextParallel().all_reduce_gradients(params), "ContextParallel.all_reduce_gradients",
                       "number of parameters differs", "rank 0 has 4", "rank 1 has 5")


def _ulysses_backend_refused(rank: int) -> None:
    q, k, v = (normal(seed, 1, 4, 4, 8) for seed in (1, 2, 3))
    for backend in ("fa4", "triton"):  # (neither runs on CPU tensors without the Triton interpreter)
        expect_value_error(lambda: ulysses_attention(q, k, v, causal=True, backend=backend), "ulysses_attention",
                           f"backend={backend!r} cannot run")
    expect_value_error(lambda: ContextParallel(mode="ulysses").attention(q, k, v, causal=True, backend="fa4"),
                       "ulysses_attention", "backend='fa4' cannot run")
    ulysses_attention(q, k, v, causal=True)  # and the next call runs


def _ring_mha_module_options_differ(rank: int) -> None:
    """RingMultiheadDilatedAttention's own options that change its rows (the rotary embedding, the Sub-LN's eps,
    dropout in training) differing on one rank: a ValueError naming the option on every rank, not wrong rows."""
    x = normal(4, 1, 8, 16)
    base = dict(rotary=True, backend="torch", dtype=torch.float64)
    for option, value in (("rotary", False), ("rotary_base", 100.0), ("layer_norm_eps", 1e-3), ("dropout", 0.5)):
        m = RingMultiheadDilatedAttention(16, 2, (4, 16), (1, 2), **{**base, **({option: value} if rank else {})})
        expect_value_error(lambda: m(x), "ring_dilated_attention", f"RingMultiheadDilatedAttention.{option}",
                           "differs across ranks")
    m = RingMultiheadDilatedAttention(16, 2, (4, 16), (1, 2), dropout=0.5 * rank, **base).eval()
    m(x)  # (dropout is off in eval: nothing differs) and the next call runs


def _ring_mha_module_zigzag_shard(rank: int) -> None:
    """RingMultiheadDilatedAttention reads its input as the contiguous shard: ``shard(x)`` (zigzag, the default)
    raises on every rank naming the layout (it gave wrong rows silently: the attention's own check sees the
    projections, which cannot be told apart), and the contiguous shard equals one process on the whole sequence."""
    torch.manual_seed(0)
    m = RingMultiheadDilatedAttention(16, 2, (4, 16), (1, 2), causal=True, rotary=True, backend="torch",
                                      dtype=torch.float64)
    x = normal(4, 1, 16, 16)
    expect_value_error(lambda: m(shard(x)), "RingMultiheadDilatedAttention", "'zigzag' layout",
                       "layout='contiguous'")
    want = MultiheadDilatedAttention(16, 2, (4, 16), (1, 2), causal=True, rotary=True, backend="torch",
                                     dtype=torch.float64)
    want.load_state_dict(m.state_dict())
    got = m(shard(x, layout="contiguous"))
    torch.testing.assert_close(got, shard(want(x), layout="contiguous"))


def _ring_modules_deepcopy_subgroup(rank: int) -> None:
    """``copy.deepcopy`` of the modules built on a group other than the default (a context-parallel subgroup, as an
    EMA copy of the model takes): the copy attends over the same group with its own parameters (it raised
    ``TypeError: cannot pickle ... ProcessGroup``)."""
    import copy
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    m = RingMultiheadDilatedAttention(16, 2, (4, 16), (1, 2), causal=True, group=group, backend="torch",
                                      dtype=torch.float64)
    c = copy.deepcopy(m)
    assert c.group is group and c.attention.group is group
    assert c.q_proj.weight is not m.q_proj.weight
    x = shard(normal(4, 1, 16, 16), layout="contiguous")
    torch.testing.assert_close(c(x), m(x), rtol=0, atol=0)
    d = copy.deepcopy(RingDilatedAttention((4, 16), (1, 2), group=group))
    assert d.group is group


def _batched_gradients_refused(rank: int) -> None:
    """``is_grads_batched=True`` runs a backward under vmap, whose batched gradients the exchanges between ranks
    cannot carry: every rank refuses by name before the first exchange (the PyTorch backend's operations took them,
    and one rank failed in an exchange while the other waited in its own), and the next call runs."""
    q, k, v = (normal(seed, 1, 8, 2, 8).requires_grad_() for seed in (1, 2, 3))
    packed = [x[0] for x in (q, k, v)]
    calls = {"ring_attention": lambda: ring_attention(q, k, v, causal=True, backend="torch"),
             "ring_attention ": lambda: ring_attention(*packed, cu_seqlens=cu_seqlens_of([5, 11], "cpu"),
                                                       causal=True, backend="torch"),
             "ring_dilated_attention": lambda: ring_dilated_attention(q, k, v, segment_lengths=(8, 16),
                                                                      dilation_rates=(1, 2), backend="torch"),
             "ulysses_attention": lambda: ulysses_attention(q, k, v, causal=True, backend="torch")}
    for fn, call in calls.items():
        out = call()
        grads = torch.ones(3, *out.shape, dtype=out.dtype)
        expect_error(RuntimeError, lambda: torch.autograd.grad(out, (q, k, v), grads, is_grads_batched=True),
                     fn.strip(), "batched output gradients", "exchanges between ranks")
        torch.autograd.grad(call(), (q, k, v), grads[0])  # one at a time: runs


def _case(name: str) -> None:
    rank = dist.get_rank()
    {"gradients-on-some-ranks": _gradients_on_some_ranks, "gradients-parameter-count": _gradients_parameter_count,
     "ulysses-backend-refused": _ulysses_backend_refused,
     "ring-mha-module-options-differ": _ring_mha_module_options_differ,
     "batched-gradients-refused": _batched_gradients_refused,
     "ring-mha-module-zigzag-shard": _ring_mha_module_zigzag_shard,
     "ring-modules-deepcopy-subgroup": _ring_modules_deepcopy_subgroup}[name](rank)


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        run_cases(rank, store_dir, CASES, _case)


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "training-step workers")


# ----------------------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", CASES)
def test_training_step_case(results, case):
    check_case(results, case)


def test_dilated_modules_refuse_fa4_at_construction():
    with pytest.raises(ValueError, match=r"RingDilatedAttention: backend must be 'auto', 'triton' or 'torch', got "
                                         r"'fa4'"):
        RingDilatedAttention((4,), (1,), backend="fa4")
    with pytest.raises(ValueError, match=r"RingMultiheadDilatedAttention: backend must be 'auto', 'triton' or "
                                         r"'torch', got 'fa4'"):
        RingMultiheadDilatedAttention(16, 2, (4,), (1,), backend="fa4")
