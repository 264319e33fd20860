"""GPU: under CUDA autocast every route (SDPA, the Triton and Gluon kernels, the PyTorch backend) takes float32
inputs, casts them to the autocast dtype and returns it, forward and backward; non-finite inputs give the reference's
NaN rows on every route (SDPA's CUDA kernels, ours)."""
import pytest
import torch

import longattn
from longattn import reference as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(64, 0)), dict(softcap=5.0), dict(return_lse=True),
                                dict(causal=True, backend="triton"), dict(causal=True, backend="torch")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_returns_the_autocast_dtype(kw, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 300, 4, 64, device="cuda", generator=g, requires_grad=True)
    with torch.autocast("cuda", dtype):
        out = longattn.flash_attention(x, x, x, **kw)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == dtype
    mods = {key: val for key, val in kw.items() if key not in ("backend", "return_lse")}
    xr = x.detach().to(dtype).double()
    want = R.flash_attention(xr, xr, xr, **mods)
    assert (out.double() - want).abs().max() < 2e-2
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kind", ["nan q", "inf k", "nan k"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_rows_agree_on_every_route(kind, causal):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 257, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    target = q if kind == "nan q" else k
    target[0, 100, 0, 7] = float("nan") if "nan" in kind else float("inf")
    want = torch.isnan(R.flash_attention(q.double(), k.double(), v.double(), causal=causal)).any(-1)
    for backend in ("auto", "triton", "torch"):
        got = longattn.flash_attention(q, k, v, causal=causal, backend=backend)
        assert torch.equal(torch.isnan(got).any(-1), want), backend


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_log_sum_exp_of_rows_that_see_a_nan_key_is_nan(gluon, d, monkeypatch):
    """The kernels' log-sum-exp of a row that sees a NaN score is NaN (never -inf, "no key", which a merge by
    log-sum-exp would drop), on the Gluon forward, the Triton forward and the decode kernels."""
    monkeypatch.setenv("LONGATTN_GLUON", "1" if gluon else "0")
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, 300, 2, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    k[0, 200, 0, 5] = float("nan")  # seen by queries 200.. of head 0
    want = R.flash_attention(q.double(), k.double(), v.double(), causal=True, return_lse=True)[1]
    for backend in ("triton", "torch"):
        with longattn.routing(min_keys={}):  # (the Gluon forward takes short calls too)
            lse = longattn.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)[1]
        assert torch.equal(torch.isnan(lse), torch.isnan(want)) and torch.isnan(lse[0, 0, 200:]).all(), backend
    lens = torch.tensor([250], dtype=torch.int32, device="cuda")
    for backend in ("triton", "torch"):
        lse = longattn.flash_attention_with_kvcache(q[:, :1], k.clone(), v.clone(), cache_seqlens=lens,
                                                    return_lse=True, backend=backend)[1]
        assert torch.isnan(lse[0, 0]).all() and torch.isfinite(lse[0, 1]).all(), backend
