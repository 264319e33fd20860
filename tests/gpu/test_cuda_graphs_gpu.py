"""GPU tests: a training step (forward and backward) of our kernels captured in a CUDA graph and replayed, as
``torch.compile(mode="reduce-overhead")`` and training frameworks' per-layer graphs do to take a short step's host
time away. The graph must hold every launch of the step with nothing read from the host during capture (tile
counters, dQ's accumulator and the TMA descriptors made on the host or on the device all live in the graph's
memory), so that a replay on new values copied into the captured inputs gives what an eager step on those values
gives: checked against the float64 reference, on two sets of values (a stale replay fails the second), for each
backward the planner routes to (the 128 x 128 and the fused Gluon backwards with host-made descriptors, the two
Triton passes) and a packed batch."""
import pytest
import torch

import _rows as rows

import longattn
from longattn import reference as ref
from longattn.utils import cuda_graph
from longattn.backends.triton import planner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = 2e-2  # bf16 against the float64 reference (tests/gpu's bound for bf16 outputs and gradients)


def _check_replays(inputs, step, reference, seed):
    """Capture ``step`` over the static ``inputs`` (leaves that need gradients, then the output gradient), then for
    two fresh sets of values: copy them in, replay, and compare the graph's output and gradients with
    ``reference(*values)`` (float64)."""
    graph, outs = cuda_graph(step)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(2):
        values = [torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g) for x in inputs]
        with torch.no_grad():
            for x, value in zip(inputs, values):
                x.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        want = reference(*values)
        for got, expected in zip(outs, want):
            assert torch.isfinite(got).all()
            assert rows.rel(got, expected) < TOL


def _dense_reference(causal):
    def reference(q, k, v, do):
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        out = ref.flash_attention(q64, k64, v64, causal=causal)
        return (out, *torch.autograd.grad(out, (q64, k64, v64), do.double()))
    return reference


# (head dim, causal, N, query heads, key heads, the backward the planner routes it to)
DENSE = [(64, True, 2048, 4, 2, planner.GLUON_WIDE_BWD), (64, False, 1000, 4, 4, None),
         (128, True, 1536, 4, 2, planner.GLUON_FUSED_BWD), (128, False, 1024, 2, 2, planner.GLUON_FUSED_BWD),
         (64, True, 300, 4, 1, planner.TRITON_TWO_PASS)]


@pytest.mark.parametrize("d,causal,n,hq,hk,bwd", DENSE)
def test_a_graphed_training_step_matches_the_reference(d, causal, n, hq, hk, bwd):
    make = lambda h: torch.zeros(2, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make(hq), make(hk), make(hk)
    do = torch.zeros(2, n, hq, d, device="cuda", dtype=torch.bfloat16)
    if bwd is not None:  # (the case covers the route it names; None: whatever the planner picks)
        plan = longattn.explain(longattn.flash_attention, q, k, v, causal=causal, backend="triton")
        assert plan.kernel("bwd") == bwd, str(plan)

    def step():
        out = longattn.flash_attention(q, k, v, causal=causal, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    _check_replays((q, k, v, do), step, _dense_reference(causal), seed=d + n)


def test_a_graphed_packed_step_matches_the_reference():
    lengths = [700, 0, 1301, 64, 457]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    total, hq, hk, d = sum(lengths), 4, 2, 128
    q = torch.zeros(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(total, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.zeros(total, hq, d, device="cuda", dtype=torch.bfloat16)

    def step():
        out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                              backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    def reference(q, k, v, do):
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        out = ref.flash_attention_varlen(q64, k64, v64, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        return (out, *torch.autograd.grad(out, (q64, k64, v64), do.double()))

    _check_replays((q, k, v, do), step, reference, seed=7)
