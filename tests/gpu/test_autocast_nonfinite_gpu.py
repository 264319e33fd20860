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
