"""Attention sinks (gpt-oss): every query's softmax gains an entry of score ``sinks[h]`` and no value. The reference
against a by-hand definition, then every backend against the reference in float64 (outputs, log-sum-exp and the
gradients of q, k, v and the sinks), on awkward sizes, grouped-query heads, causal with N != M, windows that leave
rows without keys, packed batches with empty sequences and decode against contiguous and paged caches."""
import math

import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.utils import cu_seqlens_of

BACKENDS = ["torch", "triton"]  # triton: the interpreter on the CPU


def _by_hand(q, k, v, sinks, allowed, scale):
    """One query at a time: softmax over [allowed scores..., sink], values of the keys only."""
    B, N, H, D = q.shape
    group = H // k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.empty(B, H, N, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                keys = [j for j in range(k.shape[1]) if allowed[i, j]]
                scores = [float(q[b, i, h] @ k[b, j, h // group]) * scale for j in keys] + [float(sinks[h])]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                for w, j in zip(weights, keys):
                    out[b, i, h] += w / total * v[b, j, h // group]
    return out, lse


def test_reference_matches_the_definition():
    q, k, v = torch.randn(2, 5, 4, 8, dtype=torch.float64), *torch.randn(2, 2, 7, 2, 8, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    for causal, window in ((False, (-1, -1)), (True, (1, -1))):
        allowed = ref.flash_mask(5, 7, causal, window)
        want, want_lse = _by_hand(q, k, v, sinks, allowed, 8 ** -0.5)
        out, lse = ref.flash_attention(q, k, v, causal=causal, window=window, sinks=sinks, return_lse=True)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)


def _check(public, reference, q, k, v, sinks, dtype, tol):
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    s = sinks.detach().clone().requires_grad_()
    out, lse = public(*xs, s)
    x64 = [x.detach().requires_grad_() for x in (q, k, v)]
    s64 = sinks.detach().clone().requires_grad_()
    want, want_lse = reference(*x64, s64)
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    do = torch.randn_like(want)
    (out.double() * do).sum().backward()
    (want * do).sum().backward()
    for got, exp in zip((*xs, s), (*x64, s64)):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.double(), exp.grad, **tol)


TOL = {torch.float64: dict(rtol=1e-7, atol=1e-7), torch.float32: dict(rtol=2e-4, atol=2e-4)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal, window, n, m", [(False, (-1, -1), 37, 37), (True, (-1, -1), 19, 45),
                                                  (True, (3, -1), 45, 45), (False, (2, 0), 30, 20)])
def test_flash_attention_with_sinks(backend, causal, window, n, m):
    dtype = torch.float64 if backend == "torch" else torch.float32
    q = torch.randn(2, n, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, m, 2, 16, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64) * 2
    kw = dict(causal=causal, window=window)
    _check(lambda q, k, v, s: longattn.flash_attention(q, k, v, sinks=s, return_lse=True, backend=backend, **kw),
           lambda q, k, v, s: ref.flash_attention(q, k, v, sinks=s, return_lse=True, **kw), q, k, v, sinks, dtype,
           TOL[dtype])


def test_rows_without_keys_give_zero_and_the_sink_as_lse():
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = longattn.flash_attention(q, k, v, window=(0, -1), causal=True, sinks=sinks, return_lse=True,
                                        backend="torch")
    empty_q, empty_k = q[:, :0], k
    out0, lse0 = longattn.flash_attention(empty_q, empty_k, v, sinks=sinks, return_lse=True)
    assert out0.shape == (1, 0, 2, 8) and lse0.shape == (1, 2, 0)
    out1, lse1 = longattn.flash_attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True)
    assert (out1 == 0).all() and torch.equal(lse1, sinks[None, :, None].expand(1, 2, 6))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_gradients_through_the_log_sum_exp_and_special_sinks(backend):
    """A loss on the output and on the returned log-sum-exp; sinks with -inf (no sink) in a head, strided, and in
    float16 (the gradient comes back in the sinks' dtype); rows that see no key (a window of 0 keys to the left and
    a causal query above every key). The Triton backend adds the sinks after its forward kernels and computes
    their gradient from the output and log-sum-exp: this checks both against the reference."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    torch.manual_seed(3)
    B, N, M, hq, hk, d = 2, 23, 17, 4, 2, 16
    q, k, v = torch.randn(B, N, hq, d), torch.randn(B, M, hk, d), torch.randn(B, M, hk, d)
    wide = torch.randn(2 * hq, dtype=torch.float64)
    wide[4] = float("-inf")
    for sinks, kw in ((wide[::2], dict(causal=True)), (wide[1::2].half(), dict(window=(0, 2))),
                      (wide[::2], dict(causal=False))):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        s = sinks.detach().clone().requires_grad_()
        s64 = sinks.detach().double().requires_grad_()
        out, lse = longattn.flash_attention(*xs, sinks=s, return_lse=True, backend=backend, **kw)
        want, want_lse = ref.flash_attention(*x64, sinks=s64, return_lse=True, **kw)
        tol = TOL[dtype] if sinks.dtype != torch.float16 else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(out.double(), want, **tol)
        torch.testing.assert_close(lse.double(), want_lse, **tol)
        do, dl = torch.randn_like(want), torch.randn_like(want_lse)
        ((out.double() * do).sum() + (lse.double() * dl).sum()).backward()
        ((want * do).sum() + (want_lse * dl).sum()).backward()
        assert s.grad.dtype == sinks.dtype
        for got, exp in zip((*xs, s), (*x64, s64)):
            assert torch.isfinite(got.grad).all()
            torch.testing.assert_close(got.grad.double(), exp.grad, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_with_sinks_and_empty_sequences(backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    lens_q, lens_k = [5, 0, 9, 3], [7, 4, 9, 0]
    cu_q, cu_k = cu_seqlens_of(lens_q), cu_seqlens_of(lens_k)
    q = torch.randn(sum(lens_q), 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, sum(lens_k), 2, 16, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    _check(lambda q, k, v, s: longattn.flash_attention_varlen(q, k, v, sinks=s, return_lse=True, backend=backend,
                                                              **kw),
           lambda q, k, v, s: ref.flash_attention_varlen(q, k, v, sinks=s, return_lse=True, **kw), q, k, v, sinks,
           dtype, TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_new, page", [(1, None), (3, None), (1, 8), (2, 8)])
def test_decode_with_sinks(backend, n_new, page):
    dtype = torch.float64 if backend == "torch" else torch.float32
    B, hq, hk, d = 3, 4, 2, 16
    lens = torch.tensor([5, 0, 17], dtype=torch.int32)
    q = torch.randn(B, n_new, hq, d, dtype=dtype)
    k, v = (torch.randn(B, n_new, hk, d, dtype=dtype) for _ in range(2))
    if page is None:
        kc, vc, table = torch.randn(B, 24, hk, d, dtype=dtype), torch.randn(B, 24, hk, d, dtype=dtype), None
    else:
        kc, vc = torch.randn(9, page, hk, d, dtype=dtype), torch.randn(9, page, hk, d, dtype=dtype)
        table = torch.tensor([[3, 0, 5], [1, 2, 4], [8, 7, 6]], dtype=torch.int32)
    sinks = torch.randn(hq, dtype=dtype)
    want, want_lse = ref.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=lens,
                                                      block_table=table, sinks=sinks, return_lse=True)
    out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                     sinks=sinks, return_lse=True, backend=backend)
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(lse.to(dtype), want_lse.to(dtype), **TOL[dtype])
    buf = torch.empty_like(q)  # the out= buffer receives the result with the sinks
    longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens + n_new, block_table=table, sinks=sinks,
                                          out=buf, backend=backend)
    torch.testing.assert_close(buf, want, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_sinks_strided_minus_inf_and_rows_without_keys(backend):
    """The sinks as the decode kernels' merge reads them: a strided view, a sink of -inf (no sink) or +inf (all the
    weight), a float16 sink; a sequence whose query sees no key gives 0 and the sink as its log-sum-exp."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    B, hq, hk, d = 2, 4, 2, 16
    lens = torch.tensor([9, 0], dtype=torch.int32)  # the second sequence has no cached rows and no new ones
    q = torch.randn(B, 1, hq, d, dtype=dtype)
    kc, vc = torch.randn(B, 12, hk, d, dtype=dtype), torch.randn(B, 12, hk, d, dtype=dtype)
    wide = torch.randn(2 * hq, dtype=dtype)
    wide[2] = float("-inf")
    infinite = wide[::2].clone()
    infinite[1] = float("inf")  # the sink takes all of the head's weight: output 0, log-sum-exp +inf
    for sinks in (wide[::2], wide[::2].half(), infinite):
        want, want_lse = ref.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks.to(dtype),
                                                          return_lse=True)
        out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks, return_lse=True,
                                                         backend=backend)
        torch.testing.assert_close(out, want.to(dtype), **TOL[dtype])
        torch.testing.assert_close(lse.to(dtype), want_lse.to(dtype), **TOL[dtype])
        assert (out[1] == 0).all() and torch.equal(lse[1, :, 0].to(dtype), sinks.to(dtype))


@pytest.mark.parametrize("bad, err, match", [
    ([0.0, 1.0], TypeError, "torch.Tensor"),
    (torch.zeros(3), ValueError, r"shape \(Hq,\)"),
    (torch.zeros(4, dtype=torch.int64), TypeError, "floating dtype"),
    (torch.zeros(1, 4), ValueError, r"shape \(Hq,\)"),
])
def test_bad_sinks_are_named(bad, err, match):
    q = torch.randn(1, 3, 4, 8)
    for call in (lambda: longattn.flash_attention(q, q[:, :, :2], q[:, :, :2], sinks=bad),
                 lambda: longattn.flash_attention_varlen(q[0], q[0, :, :2], q[0, :, :2], sinks=bad,
                                                         cu_seqlens_q=cu_seqlens_of([3]),
                                                         cu_seqlens_k=cu_seqlens_of([3])),
                 lambda: longattn.flash_attention_with_kvcache(q, q[:, :, :2], q[:, :, :2], cache_seqlens=3,
                                                               sinks=bad)):
        with pytest.raises(err, match=match) as e:
            call()
        assert "sinks" in str(e.value)


def test_sink_passes_launch_one_dimensional_grids(monkeypatch):
    """The Triton backend's sink passes launch (batch x head x row block) programs on one grid dimension: CUDA's
    second and third are limited to 65535, which a batch of many heads (or a long sequence) exceeds."""
    from longattn.backends.triton import sinks as sink_pass

    grids = []

    class Record:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(sink_pass, "_add_sinks_kernel", Record())
    monkeypatch.setattr(sink_pass, "_sink_grad_kernel", Record())
    o = torch.zeros(1).expand(2, 3, 70000, 8)  # B x H = 140000 (batch, rows, heads, head dim); never read
    lse, s = torch.zeros(2, 70000, 3), torch.zeros(70000)  # (add_sinks returns a new lse like it)
    sink_pass.add_sinks(o, lse, s)
    sink_pass.sink_grad(o, o, lse, None, s)
    blocks = -(-3 // sink_pass.ROWS)
    assert grids == [(2 * 70000 * blocks,)] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_gradient_alone_and_from_an_expanded_output_gradient(backend, monkeypatch):
    """``out.sum()`` hands the backward an expanded dO (every stride 0), which the sinks' gradient must read as
    such; and where only the sinks need a gradient (frozen q, k, v; an ``s_aux`` parameter), no backward kernel
    runs."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 50, 4, 16, dtype=dtype) for _ in range(3))
    want_s = torch.tensor([0.5, -0.3, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    ref.flash_attention(q.double(), k.double(), v.double(), causal=True, sinks=want_s).sum().backward()
    if backend == "triton":
        from longattn.backends.triton import entry

        def refuse(*args, **kwargs):
            raise AssertionError("a backward kernel ran although q, k and v need no gradient")
        monkeypatch.setattr(entry, "backward", refuse)
    s = want_s.detach().to(dtype).requires_grad_()
    longattn.flash_attention(q, k, v, causal=True, sinks=s, backend=backend).sum().backward()
    torch.testing.assert_close(s.grad.double(), want_s.grad, **TOL[dtype])
    monkeypatch.undo()
    qs, s = q.clone().requires_grad_(), want_s.detach().to(dtype).requires_grad_()
    want_q = q.double().requires_grad_()
    ref.flash_attention(want_q, k.double(), v.double(), causal=True, sinks=want_s.detach()).sum().backward()
    longattn.flash_attention(qs, k, v, causal=True, sinks=s, backend=backend).sum().backward()
    torch.testing.assert_close(s.grad.double(), want_s.grad, **TOL[dtype])
    torch.testing.assert_close(qs.grad.double(), want_q.grad, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_sink_gives_a_nan_gradient_as_the_reference(backend):
    """A NaN sink makes its head's output NaN (IEEE arithmetic, as the reference) and its own gradient NaN too, on
    every backend: not 0, which would hide it from a check of the gradients. The other head is untouched."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    torch.manual_seed(5)
    q = torch.randn(1, 3, 2, 16, dtype=dtype)
    k, v = torch.randn(1, 5, 2, 16, dtype=dtype), torch.randn(1, 5, 2, 16, dtype=dtype)
    sinks = torch.tensor([float("nan"), 0.5], dtype=dtype, requires_grad=True)
    want_sinks = sinks.detach().double().requires_grad_()
    out = longattn.flash_attention(q, k, v, sinks=sinks, backend=backend)
    want = ref.flash_attention(q.double(), k.double(), v.double(), sinks=want_sinks)
    out.sum().backward()
    want.sum().backward()
    assert out[..., 0, :].isnan().all() and not out[..., 1, :].isnan().any()
    assert want_sinks.grad[0].isnan() and sinks.grad[0].isnan()
    torch.testing.assert_close(sinks.grad[1].double(), want_sinks.grad[1], **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_forward_adds_the_sinks_on_every_backend(backend):
    """The building block without autograd (``runner.forward``, which the explicit ops and the rings call) gives
    the same result with sinks on every backend, keys or none."""
    from dataclasses import replace

    from longattn import runner
    from longattn.call import flash_call

    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = (torch.randn(1, 9, 2, 8, dtype=dtype) for _ in range(3))
    sinks = torch.tensor([0.3, float("-inf")], dtype=dtype)
    call = replace(flash_call(8 ** -0.5, True, (-1, -1)), sinks=sinks)
    for m in (9, 0):
        out, lse = runner.forward(q, k[:, :m], v[:, :m], call, backend=backend, fn="test")
        want, want_lse = ref.flash_attention(q, k[:, :m], v[:, :m], causal=True, sinks=sinks, return_lse=True)
        torch.testing.assert_close(out, want.to(dtype), **TOL[dtype])
        torch.testing.assert_close(lse.to(dtype), want_lse.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("packed", [False, True])
def test_second_derivatives_with_sinks_and_rows_without_keys(packed):
    """The PyTorch backend differentiates twice, as the reference: also the sinks' second derivatives where some
    queries see no key (causal with N > M, an empty key sequence), whose log-sum-exp over the keys is -inf (the
    sinks' entries of a Hessian-vector product were NaN there)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 9, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 7, 1, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.tensor([0.4, -1.2], dtype=torch.float64, requires_grad=True)
    if packed:
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 4, 9], [0, 0, 7]))

        def public(q, k, v, s):
            return longattn.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                                   sinks=s, backend="torch")

        def reference(q, k, v, s):
            return ref.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                              sinks=s)
    else:
        def public(q, k, v, s):
            return longattn.flash_attention(q, k, v, causal=True, sinks=s, backend="torch")

        def reference(q, k, v, s):
            return ref.flash_attention(q, k, v, causal=True, sinks=s)
    inputs = (q, k, v, sinks)
    do = torch.randn(public(*inputs).shape, generator=g, dtype=torch.float64)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]

    def hessian_vector(fn):
        grads = torch.autograd.grad(fn(*inputs), inputs, do, create_graph=True)
        return torch.autograd.grad(sum((gr * t).sum() for gr, t in zip(grads, tangents)), inputs)

    for got, want in zip(hessian_vector(public), hessian_vector(reference)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)
