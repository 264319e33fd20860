"""Autocast: every route follows SDPA's rule. Under ``torch.autocast(device, dtype)`` the floating inputs (float16,
bfloat16, float32) are cast to the autocast dtype and the output has that dtype, whether SDPA, the PyTorch backend or
the Triton kernels run the call; float64 inputs are left alone; gradients reach float32 leaves."""
import pytest
import torch

import longattn
from longattn import reference as R

CALLS = {
    "dense causal (SDPA's route)": lambda q, k, v, **kw: longattn.flash_attention(q, k, v, causal=True, **kw),
    "window": lambda q, k, v, **kw: longattn.flash_attention(q, k, v, window=(8, 0), **kw),
    "softcap": lambda q, k, v, **kw: longattn.flash_attention(q, k, v, softcap=5.0, **kw),
    "lse": lambda q, k, v, **kw: longattn.flash_attention(q, k, v, return_lse=True, **kw)[0],
    "dilated": lambda q, k, v, **kw: longattn.dilated_attention(q, k, v, segment_lengths=(16,), dilation_rates=(2,),
                                                                **kw),
    "block sparse": lambda q, k, v, **kw: longattn.block_sparse_attention(
        q, k, v, block_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool), block_size=16, **kw),
    "varlen": lambda q, k, v, **kw: longattn.flash_attention_varlen(
        q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 20, 40], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 20, 40], dtype=torch.int32), causal=True, **kw)[None],
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_every_route_returns_the_autocast_dtype(name, backend):
    x = torch.randn(1, 40, 2, 16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        out = CALLS[name](x, x, x, backend=backend)
    assert out.dtype == torch.bfloat16
    plain = CALLS[name](*(x.detach().bfloat16().float(),) * 3, backend="torch")  # the same inputs, rounded
    assert (out.float() - plain).abs().max() <= 2e-2  # bfloat16 rounding of the output only
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_float16_autocast_and_float64_inputs():
    x = torch.randn(1, 24, 2, 16)
    with torch.autocast("cpu", torch.float16):
        assert longattn.flash_attention(x, x, x, window=(4, 4)).dtype == torch.float16
        d = x.double()
        out = longattn.flash_attention(d, d, d, window=(4, 4))
    assert out.dtype == torch.float64
    assert torch.allclose(out, R.flash_attention(d, d, d, window=(4, 4)), atol=1e-12)


def test_the_torch_backend_accumulates_in_float32_under_autocast():
    """Inside the call autocast is off: the PyTorch backend's float32 products are not recast to bfloat16, so its
    result on bfloat16 inputs equals the one outside autocast."""
    x = torch.randn(1, 64, 2, 32).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        inside = longattn.flash_attention(x, x, x, window=(16, 0), backend="torch")
    assert torch.equal(inside, longattn.flash_attention(x, x, x, window=(16, 0), backend="torch"))
