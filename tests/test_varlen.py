"""Packed variable-length attention (issue 16): the reference, the argument checks and the public function.

The reference builds one block-diagonal mask over the packed batch; here it is checked against the plain reference
applied to every sequence on its own (including empty sequences, N != M per sequence, causal and windows, GQA)."""
import pytest
import torch

from longattn import reference as ref


def _packed(lens_q, lens_k, hq=4, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64, requires_grad=True)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (3, 1)}, {"causal": True, "window": (2, -1)}])
def test_varlen_reference_is_each_sequence_alone(kw):
    lens_q, lens_k = [5, 0, 9, 1, 7], [3, 4, 9, 6, 0]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    out, lse = ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        want, want_lse = ref.flash_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], return_lse=True, **kw)
        torch.testing.assert_close(out[q0:q1], want[0])
        torch.testing.assert_close(lse[:, q0:q1], want_lse[0])
    (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert (out[cu_q[-2]:] == 0).all() and torch.isneginf(lse[:, cu_q[-2]:]).all()  # the last sequence has no keys


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([0, 3, 2, 9], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([1, 3, 9], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), "end at"),
    (torch.tensor([[0, 9]], dtype=torch.int32), "shape"),
    (torch.tensor([0.0, 9.0]), "int32 or int64"),
    ([0, 9], "torch.Tensor"),
])
def test_invalid_cu_seqlens_are_named(cu, match):
    q, k, v, _, cu_k = _packed([9], [4])
    with pytest.raises((ValueError, TypeError), match=match) as err:
        ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k)
    assert "cu_seqlens_q" in str(err.value)


def test_packed_shapes_and_batch_counts_are_checked():
    q, k, v, cu_q, cu_k = _packed([4, 5], [4, 5])
    with pytest.raises(ValueError, match="3 dims"):
        ref.flash_attention_varlen(q[None], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="same number of sequences"):
        ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="multiple"):
        ref.flash_attention_varlen(q[:, :3], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (3, 1)}])
def test_flash_attention_varlen_matches_the_reference(backend, kw):
    """The public function (one call per sequence for now) against the reference, outputs, lse and gradients;
    Triton in the interpreter on float32."""
    import longattn

    lens_q, lens_k = [5, 0, 19, 1, 7], [3, 4, 17, 6, 0]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    dtype = torch.float32 if backend == "triton" else torch.float64
    qs, ks, vs = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = longattn.flash_attention_varlen(qs, ks, vs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=19,
                                               return_lse=True, backend=backend, **kw)
    want, want_lse = ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **kw)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    do = torch.randn_like(want)
    out.backward(do.to(dtype))
    want.backward(do)
    for got, w in ((qs.grad, q.grad), (ks.grad, k.grad), (vs.grad, v.grad)):
        torch.testing.assert_close(got.double(), w, **tol)
    plain = longattn.flash_attention_varlen(qs, ks, vs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend, **kw)
    torch.testing.assert_close(plain, out)


def test_flash_attention_varlen_hints_and_empty_batch():
    import longattn

    q, k, v, cu_q, cu_k = _packed([4, 5], [4, 5])
    with pytest.raises(ValueError, match="max_seqlen_q"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4)
    with pytest.raises(TypeError, match="causal"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=1)
    empty = torch.zeros(1, dtype=torch.int32)
    out, lse = longattn.flash_attention_varlen(q[:0], k[:0], v[:0], cu_seqlens_q=empty, cu_seqlens_k=empty,
                                               return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
