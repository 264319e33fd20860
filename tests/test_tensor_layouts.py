"""Tensors as model code produces them: views of a fused projection, SDPA-layout transposes, a head dim that is not
innermost, expanded key/value heads, and zero-size corners. Each gives the float64 reference's output and gradients,
on the Triton kernels (in the interpreter) as on the PyTorch backend."""
import pytest
import torch

import longattn
from longattn import ops
from longattn import reference as ref

B, N, HQ, HK, D = 2, 20, 4, 2, 16


def _layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x``'s values in the memory layout ``kind``, as a leaf that requires grad."""
    if kind == "sdpa transpose":  # (B, H, N, D) memory seen as (B, N, H, D)
        y = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif kind == "head dim strided":  # every other element of a wider last dim
        y = torch.zeros(*x.shape, 2, dtype=x.dtype)[..., 1]
        y.copy_(x)
    elif kind == "head dim outermost":
        y = x.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    else:
        y = x.clone()
    return y.detach().requires_grad_(True)


def _against_reference(fn, ref_fn, q, k, v, tol):
    out = fn(q, k, v)
    do = torch.randn(out.shape, dtype=torch.float64)
    out.backward(do.to(out.dtype))
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    want = ref_fn(q64, k64, v64)
    want.backward(do)
    for got, expected in ((out, want), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["fused qkv", "sdpa transpose", "head dim strided", "head dim outermost"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_flash_attention_on_layouts_model_code_produces(backend, kind, gen):
    dtype, tol = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-10)
    if kind == "fused qkv":  # one projection's output, unbound: strided views into one tensor
        qkv = torch.randn(B, N, 3, HK, D, generator=gen, dtype=dtype)
        q, k, v = (x.detach().requires_grad_(True) for x in qkv.unbind(2))
    else:
        q, k, v = (_layout(torch.randn(B, n, h, D, generator=gen, dtype=dtype), kind)
                   for n, h in ((N, HQ), (N + 5, HK), (N + 5, HK)))
    _against_reference(lambda *t: longattn.flash_attention(*t, causal=True, backend=backend),
                       lambda *t: ref.flash_attention(*t, causal=True), q, k, v, tol)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_expanded_kv_heads_and_a_packed_batch_of_views(backend, gen):
    dtype, tol = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-10)
    q = torch.randn(B, N, HQ, D, generator=gen, dtype=dtype, requires_grad=True)
    k1, v1 = (torch.randn(B, N, 1, D, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    out = longattn.flash_attention(q, k1.expand(-1, -1, HQ, -1), v1.expand(-1, -1, HQ, -1), backend=backend)
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(do.to(dtype))
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k1, v1))
    want = ref.flash_attention(q64, k64.expand(-1, -1, HQ, -1), v64.expand(-1, -1, HQ, -1))
    want.backward(do)
    for got, expected in ((out, want), (q.grad, q64.grad), (k1.grad, k64.grad), (v1.grad, v64.grad)):
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    qkv = torch.randn(19, 3, HK, D, generator=gen, dtype=dtype)
    q, k, v = (x.detach().requires_grad_(True) for x in qkv.unbind(1))
    _against_reference(
        lambda *t: longattn.flash_attention_varlen(*t, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend=backend),
        lambda *t: ref.flash_attention_varlen(*t, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True), q, k, v, tol)


@pytest.mark.parametrize("kind", ["head dim strided", "head dim outermost", "sdpa transpose"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_explicit_backward_takes_an_output_of_any_layout(backend, kind, gen):
    """``ops.attention_backward``'s ``o`` is the caller's tensor: the Triton backward's row statistics read its head
    dim as unit-stride, so an ``o`` whose head dim was strided gave gradients off by O(1) (dq 2.2, dk 3.3 here)."""
    dtype, tol = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-10)
    q, k, v, do = (torch.randn(1, N, 2, D, generator=gen, dtype=dtype) for _ in range(4))
    o, lse = ops.attention_forward(q, k, v, causal=True, backend=backend)
    want = ops.attention_backward(do, q, k, v, o, lse, causal=True, backend=backend)
    got = ops.attention_backward(do, q, k, v, _layout(o, kind).detach(), lse, causal=True, backend=backend)
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    ref.flash_attention(q64, k64, v64, causal=True).backward(do.double())
    for g, w, r in zip(got, want, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(g.double(), r, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(2, 0, 2), (2, 3, 0)], ids=["no new tokens", "no query heads"])
@pytest.mark.parametrize("fn", ["flash", "flash softcap", "dilated"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kvcache_calls_without_new_tokens_or_query_heads(backend, fn, shape, gen):
    """The PyTorch backend reshaped its scores with a ``-1`` that zero elements leave undetermined ("cannot reshape
    tensor of 0 elements"), for the log-sum-exp, soft-capping, ALiBi and dilated decode; the Triton kernels gave
    zeros. Both give the empty result now, and append the new keys and values (there are some without query heads)."""
    b, nq, hq = shape
    q = torch.randn(b, nq, hq, D, generator=gen)
    kc, vc = (torch.zeros(b, 10, 1, D) for _ in range(2))
    k, v = (torch.randn(b, nq, 1, D, generator=gen) for _ in range(2))
    lens = torch.tensor([3, 5], dtype=torch.int32)
    kw = {"flash": {}, "flash softcap": {"softcap": 3.0},
          "dilated": {"segment_lengths": (4,), "dilation_rates": (1,)}}[fn]
    call = longattn.dilated_attention_with_kvcache if fn == "dilated" else longattn.flash_attention_with_kvcache
    out, lse = call(q, kc, vc, k, v, cache_seqlens=lens, return_lse=True, backend=backend, **kw)
    assert out.shape == q.shape and lse.shape == (b, hq, nq)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(kc[i, n:n + nq], k[i]) and torch.equal(vc[i, n:n + nq], v[i])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n,m", [(0, 5), (4, 0)], ids=["no queries", "no keys"])
def test_a_zero_size_calls_log_sum_exp_is_differentiable(backend, n, m):
    """A loss on the log-sum-exp alone raised "element 0 of tensors does not require grad" on a zero-size call
    (the lse was marked non-differentiable) where the reference's, and a non-empty call's, has zero gradients."""
    q = torch.randn(2, n, 2, D, requires_grad=True)
    k, v = (torch.randn(2, m, 1, D, requires_grad=True) for _ in range(2))
    _, lse = longattn.flash_attention(q, k, v, return_lse=True, backend=backend)
    assert lse.requires_grad
    torch.nan_to_num(lse, neginf=0.0).sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_overlapping_contiguous_cache_is_refused_after_a_call_of_the_same_shapes(backend, gen):
    """A decode step skips the checks its signature passed before, and a contiguous cache's signature keeps only
    classes of its strides: a cache whose sequences overlap in memory (the second starting two rows after the first,
    strides ``(64, 32, 16, 1)`` against ``(1280, 32, 16, 1)``) was accepted after a call on caches of their own
    memory, and the appended keys written over rows another sequence reads; it is refused as on a first call."""
    q, k, v = (torch.randn(2, 1, 2, D, generator=gen) for _ in range(3))
    call = lambda kc, vc: longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3,  # noqa: E731
                                                               backend=backend)
    call(torch.zeros(2, 40, 2, D), torch.zeros(2, 40, 2, D))
    overlapping = [torch.zeros(80 * 2 * D).as_strided((2, 40, 2, D), (4 * D, 2 * D, D, 1)) for _ in range(2)]
    with pytest.raises(ValueError, match="k_cache has elements that share memory"):
        call(*overlapping)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batched_output_gradients_are_computed_or_refused_by_name(backend, gen):
    """``is_grads_batched=True`` (and a vectorised Jacobian) runs the backward under vmap: the PyTorch backend's
    gradients match the reference's; the Triton kernels' backward failed inside the planner with "Cannot access data
    pointer of Tensor that doesn't have storage" and now names the call and what computes it."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3))
    out = longattn.flash_attention(q, k, v, causal=True, backend=backend)
    grads = torch.randn(3, *out.shape, generator=gen, dtype=dtype)
    if backend == "triton":
        with pytest.raises(RuntimeError, match="backward was given batched output gradients.*backend='torch'"):
            torch.autograd.grad(out, q, grads, is_grads_batched=True)
        return
    got, = torch.autograd.grad(out, q, grads, is_grads_batched=True)
    q64 = q.detach().requires_grad_(True)
    want, = torch.autograd.grad(ref.flash_attention(q64, k.detach(), v.detach(), causal=True), q64, grads,
                                is_grads_batched=True)
    torch.testing.assert_close(got, want)
