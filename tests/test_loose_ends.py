"""Loose ends: the PyTorch backend's explicit backward of packed calls, dilated calls with score modifications
refused, ``deterministic`` through the distributed functions and modules, ``auto_backend`` under ``deterministic``,
``ring_attention``'s balanced packed batches through the public function, and the benchmarks' README.

The distributed cases run in 2 gloo processes (one spawn; the workers record each case's failure, the tests assert on
the records).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import longattn
from _ranks import cases_fixture, check_case, compare, gloo_group, normal, run_cases
from longattn import reference, runner
from longattn.backends.torch import chunked
from longattn.call import AttentionCall, Branch, SeqLens
from longattn.utils import auto_backend, cu_seqlens_of

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------------------------------
# the PyTorch backend's explicit backward of a packed call

@pytest.mark.parametrize("causal, mods", [(True, False), (False, True)])
def test_torch_explicit_backward_of_a_packed_call_is_per_sequence(causal, mods):
    lens = [3, 0, 6, 4, 1]
    cu = cu_seqlens_of(lens)
    total, hq, hk, d = sum(lens), 4, 2, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, total, h, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hk, hk))
    extra = dict(softcap=2.0, alibi=torch.rand(len(lens), hq, generator=g)) if mods else {}
    call = AttentionCall(scale=0.4, causal=causal, seqlens=SeqLens(cu, cu, max(lens), max(lens)), **extra)
    out, lse = chunked.attention(q, k, v, call)
    do, dlse = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(lse.shape, generator=g,
                                                                                 dtype=lse.dtype)
    want = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v))
    got = chunked.backward(do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), call, dlse=dlse,
                           grad_dtype=torch.float64)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name}")


# ---------------------------------------------------------------------------------------------------------------
# dilated calls take no score modifications

@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mod", ["softcap", "alibi", "sinks"])
def test_a_dilated_call_with_score_modifications_is_refused(backend, mod):
    q = torch.randn(1, 8, 2, 16)
    value = {"softcap": 2.0, "alibi": torch.ones(1, 2), "sinks": torch.zeros(2)}[mod]
    call = AttentionCall(scale=0.25, branches=(Branch(4, 2, 0, 2),), **{mod: value})
    with pytest.raises(ValueError, match=f"dilated attention takes no score modifications: {mod} must be off"):
        runner.run(q, q, q, call, backend=backend, fn="test")
    with pytest.raises(ValueError, match=mod):
        runner.forward(q, q, q, call, backend=backend, fn="test")
    with pytest.raises(ValueError, match=mod):
        runner.backward(q, q, q, q, q, torch.zeros(1, 2, 8), call, backend=backend, fn="test")
    with pytest.raises(ValueError, match=mod):
        runner.decode(backend, q, AttentionCall(scale=0.25, branches=call.branches, cache=object(), **{mod: value}),
                      False)


# ---------------------------------------------------------------------------------------------------------------
# auto_backend under deterministic

def _ran(monkeypatch, **kwargs) -> str:
    """The implementation ``flash_attention(backend="auto")`` runs."""
    seen = []
    run_on = runner.run_on
    monkeypatch.setattr(runner, "run_on", lambda impl, *a: seen.append(impl) or run_on(impl, *a))
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    longattn.flash_attention(q, q, q, causal=True, **kwargs)
    return seen[0]


def test_auto_backend_reports_what_deterministic_calls_run(monkeypatch):
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    assert auto_backend(q, q, causal=True) == "sdpa" == _ran(monkeypatch)
    assert auto_backend(q, q, causal=True, deterministic=True) == "torch" == _ran(monkeypatch, deterministic=True)
    assert auto_backend(q, q, causal=True, deterministic=True, needs_grad=False) == "sdpa"  # no backward to run
    with pytest.raises(TypeError, match="deterministic"):
        auto_backend(q, q, deterministic="yes")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert auto_backend(q, q, causal=True) == "torch" == _ran(monkeypatch)
    finally:
        torch.use_deterministic_algorithms(before)
    # only v needs a gradient: the call still has a backward to run
    q0, k0 = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    v = torch.randn(1, 8, 2, 16, requires_grad=True)
    assert auto_backend(q0, k0, causal=True, deterministic=True, v=v) == "torch"
    assert auto_backend(q0, k0, causal=True, deterministic=True) == "sdpa"  # (without v it cannot know)


# ---------------------------------------------------------------------------------------------------------------
# a deterministic index_add

def test_index_add_in_a_fixed_order_adds_every_occurrence():
    from longattn.distributed.ring_varlen import index_add

    g = torch.Generator().manual_seed(2)
    index = torch.tensor([3, 0, 3, 3, 1, 0, 5])
    src = torch.randn(2, 7, 3, generator=g, dtype=torch.float64)
    dst = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    want = dst.clone().index_add_(1, index, src)
    torch.testing.assert_close(index_add(dst.clone(), 1, index, src, True), want)
    torch.testing.assert_close(index_add(dst.clone(), 1, index[:0], src[:, :0], True), dst)


def test_index_add_in_a_fixed_order_never_adds_twice_to_a_row_in_one_call(monkeypatch):
    """The deterministic path's every ``index_add_`` reaches each row at most once (the CUDA atomics that would meet
    in a row never do), and the sum is the one of adding the occurrences in their order, bitwise; int32 indices
    too."""
    from longattn.distributed.ring_varlen import index_add

    calls = []
    real = torch.Tensor.index_add_

    def spy(self, dim, index, source, **kw):
        calls.append(index.clone())
        return real(self, dim, index, source, **kw)
    g = torch.Generator().manual_seed(3)
    for n_rows, n in ((6, 7), (3, 40), (50, 20)):
        index = torch.randint(0, n_rows, (n,), generator=g)
        src = torch.randn(n, 2, generator=g)
        dst = torch.randn(n_rows, 2, generator=g)
        want = dst.clone()
        for i in range(n):  # one occurrence after another
            want[index[i]] += src[i]
        for idx in (index, index.int()):
            calls.clear()
            monkeypatch.setattr(torch.Tensor, "index_add_", spy)
            got = index_add(dst.clone(), 0, idx, src, True)
            monkeypatch.setattr(torch.Tensor, "index_add_", real)
            assert calls and all(len(c.unique()) == len(c) for c in calls)
            assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# benchmarks/README.md

def test_the_benchmarks_readme_lists_every_script():
    listed = set(re.findall(r"^- `(bench_\w+\.py)`", (ROOT / "benchmarks" / "README.md").read_text(), re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert scripts <= listed, f"benchmarks/README.md does not list {sorted(scripts - listed)}"


# ---------------------------------------------------------------------------------------------------------------
# distributed cases (worker side)

def _calls(world: int, rank: int, hybrid_groups):
    """name -> fn(deterministic=...) running one distributed function or module (forward and backward) on this rank's
    shards, returning the gradients of q, k, v."""
    from longattn.distributed import (
        RingDilatedAttention, RingMultiheadDilatedAttention, hybrid_attention, ring_attention, ring_dilated_attention,
        shard, ulysses_attention, ulysses_dilated_attention,
    )

    ring_group, ulysses_group = hybrid_groups
    cu = cu_seqlens_of([3, 9, 0, 4])  # 16 rows: a document cut across the ranks in both layouts

    def run(fn, layout="contiguous", packed=False, hk=2):
        def call(**kw):
            n = 16
            dims = (n, 4, 8) if packed else (1, n, 4, 8)
            q, k, v = (normal(i, *dims[:-2], h, dims[-1]) for i, h in enumerate((4, hk, hk)))
            parts = [(shard(t, layout=layout, dim=0, cu_seqlens=cu) if packed else shard(t, layout=layout))
                     .requires_grad_() for t in (q, k, v)]
            out = fn(*parts, **kw)
            (out * normal(7, *out.shape)).sum().backward()
            return [p.grad for p in parts]
        return call

    dilated = dict(segment_lengths=(4, 16), dilation_rates=(1, 2))  # a local branch and one spanning both ranks
    ring_mha = {}
    for flag in (False, True):
        torch.manual_seed(0)
        ring_mha[flag] = RingMultiheadDilatedAttention(32, 4, (4, 16), (1, 2), num_kv_heads=2, backend="torch",
                                                       deterministic=flag).double()

    def module_call(**kw):
        x = normal(8, 1, 8, 32).requires_grad_()
        out = (RingDilatedAttention(**dilated, backend="torch", **kw)(x.view(1, 8, 4, 8), x.view(1, 8, 4, 8),
                                                                       x.view(1, 8, 4, 8)).sum()
               + ring_mha[kw.get("deterministic", False)](x).sum())
        out.backward()
        return [x.grad]

    return {
        "ring_attention": run(lambda *t, **kw: ring_attention(*t, causal=True, backend="torch", **kw),
                              layout="zigzag"),
        "ring_attention packed balanced": run(lambda *t, **kw: ring_attention(
            *t, cu_seqlens=cu, layout="balanced", causal=True, backend="torch", **kw), "balanced", True),
        "ring_attention packed contiguous": run(lambda *t, **kw: ring_attention(
            *t, cu_seqlens=cu, layout="contiguous", causal=True, backend="torch", **kw), packed=True),
        "ring_dilated_attention": run(lambda *t, **kw: ring_dilated_attention(*t, **dilated, causal=True,
                                                                              backend="torch", **kw), hk=1),
        "ring_dilated_attention packed": run(lambda *t, **kw: ring_dilated_attention(
            *t, **dilated, cu_seqlens=cu, backend="torch", **kw), packed=True),
        "ulysses_attention": run(lambda *t, **kw: ulysses_attention(*t, causal=True, layout="contiguous",
                                                                    backend="torch", **kw)),
        "ulysses_dilated_attention": run(lambda *t, **kw: ulysses_dilated_attention(
            *t, **dilated, causal=True, layout="contiguous", backend="torch", **kw)),
        "hybrid_attention": run(lambda *t, **kw: hybrid_attention(
            *t, ring_group=ring_group, ulysses_group=ulysses_group, causal=True, backend="torch", **kw),
            layout="zigzag"),
        "ring modules": module_call,
    }


def _spy_calls(records: list):
    """Record ``call.deterministic`` of every call the PyTorch backend runs (with autograd, or its explicit
    backward)."""
    from longattn.backends import torch as torch_backend

    for name in ("attention", "backward"):
        original = getattr(torch_backend, name)

        def spy(*args, original=original, **kwargs):
            records.append(next(a for a in args if isinstance(a, AttentionCall)).deterministic)
            return original(*args, **kwargs)

        setattr(torch_backend, name, spy)


def _deterministic_flag_case(world, rank, groups):
    """Every distributed function and ring module passes ``deterministic`` (or PyTorch's deterministic mode) to the
    calls it runs, and gives the same gradients (up to rounding) with it as without."""
    records: list = []
    _spy_calls(records)
    for name, call in _calls(world, rank, groups).items():
        grads = {}
        for flag in (False, True):
            records.clear()
            grads[flag] = call(deterministic=flag)
            if not records or set(records) != {flag}:
                raise AssertionError(f"{name}, deterministic={flag}: the backend's calls had {sorted(set(records))}")
        for i, (a, b) in enumerate(zip(grads[False], grads[True])):
            compare(f"{name}: gradient {i}", b, a, atol=1e-9)
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            records.clear()
            call()
        finally:
            torch.use_deterministic_algorithms(before)
        if set(records) != {True}:
            raise AssertionError(f"{name} under torch's deterministic mode: the backend's calls had {set(records)}")


def _deterministic_mismatch_case(world, rank, groups):
    """A ``deterministic`` that differs across ranks raises ``ValueError`` on every rank, naming it."""
    for name, call in _calls(world, rank, groups).items():
        try:
            call(deterministic=rank == 0)
        except ValueError as e:
            if "deterministic" not in str(e) or "rank 0" not in str(e):
                raise AssertionError(f"{name}: ValueError without 'deterministic' and 'rank 0': {e}") from e
        else:
            raise AssertionError(f"{name}: no ValueError for deterministic differing across ranks")


def _balanced_ring_attention_case(world, rank):
    """``ring_attention(cu_seqlens=cu, layout="balanced", return_lse=True)`` on shards cut by ``shard(...,
    layout="balanced", cu_seqlens=cu)`` against the float64 reference: outputs, lse, gradients."""
    from longattn.distributed import ring_attention, shard

    cu = cu_seqlens_of([5, 13, 0, 2, 7, 1])  # 28 rows: whole documents and one cut in 2P chunks
    total, hq, hk, d = 28, 4, 2, 8
    q, k, v, g = (normal(i, total, h, d) for i, h in enumerate((hq, hk, hk, hq)))
    g_lse = normal(5, hq, total)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference.flash_attention_varlen(*full, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                                    return_lse=True)
    ((ref * g).sum() + (ref_lse * g_lse).sum()).backward()

    def mine(x, dim=0):
        return shard(x, layout="balanced", dim=dim, cu_seqlens=cu)

    parts = [mine(t).requires_grad_() for t in (q, k, v)]
    out, lse = ring_attention(*parts, cu_seqlens=cu, layout="balanced", causal=True, return_lse=True)
    ((out * mine(g)).sum() + (lse * mine(g_lse, 1)).sum()).backward()
    compare("out", out, mine(ref.detach()), atol=1e-9)
    compare("lse", lse, mine(ref_lse.detach(), 1), atol=1e-9)
    for name, p, f in zip("qkv", parts, full):
        compare(f"d{name}", p.grad, mine(f.grad), atol=1e-9)


CASES = ("deterministic-flag", "deterministic-mismatch", "balanced-ring-attention")


def _case(name, world, rank, groups):
    if name == "deterministic-flag":
        _deterministic_flag_case(world, rank, groups)
    elif name == "deterministic-mismatch":
        _deterministic_mismatch_case(world, rank, groups)
    else:
        _balanced_ring_attention_case(world, rank)


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        singles = [dist.new_group([r]) for r in range(world)]  # the 2 x 1 grid of hybrid_attention: Ulysses of one
        groups = (dist.group.WORLD, singles[rank])
        run_cases(rank, store_dir, CASES, lambda name: _case(name, world, rank, groups))


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "loose-ends workers")


@pytest.mark.parametrize("case", CASES)
def test_distributed_case(results, case):
    check_case(results, case)
