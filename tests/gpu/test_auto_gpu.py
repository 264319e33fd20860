"""GPU tests of ``backend="auto"``: whichever kernel it runs (SDPA's default or ours), the answer is the
reference's, with and without grouped-query heads, causal or not, forward and backward, and zero-size calls keep
their graph on the GPU too."""
import pytest
import torch

import _rows as rows

import longattn
from longattn import reference as ref
from longattn.utils import auto_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b):
    assert torch.isfinite(a).all()
    return rows.rel(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [40, 64, 128, 256])
@pytest.mark.parametrize("causal,n,m,hq,hk", [(False, 999, 999, 8, 8), (True, 1537, 1537, 8, 2),
                                              (True, 300, 777, 4, 4), (False, 513, 1025, 6, 3)])
def test_auto_matches_reference(dtype, d, causal, n, m, hq, hk):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q = torch.randn(2, n, hq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, m, hk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn(2, n, hq, d, device="cuda", dtype=dtype, generator=g)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = longattn.flash_attention(qs, ks, vs, causal=causal)
    out.backward(do)
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    want = ref.flash_attention(q32, k32, v32, causal=causal)
    want.backward(do.float())
    tol = 2e-2 if dtype != torch.float32 else 2e-3
    assert _rel(out, want) < tol
    for got, ref_grad in ((qs.grad, q32.grad), (ks.grad, k32.grad), (vs.grad, v32.grad)):
        assert _rel(got, ref_grad) < tol
    choice = auto_backend(q, k, causal=causal, needs_grad=True)
    if causal and n != m:
        assert choice != "sdpa"  # SDPA aligns causal top-left: it must not run this call


def test_auto_zero_size_on_gpu():
    q = torch.randn(0, 64, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = longattn.flash_attention(q, q, q)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape
