"""GPU tests of decode against float8 KV caches: the Triton decode kernels read float8 caches, widen them
to the queries' dtype in registers and fold the descale factors in; against the float64 reference on the
dequantised caches (tolerance of the bf16 decode path: the products are bf16, exactly as with a bf16 cache holding
the same values). Skipped unless the GPU has float8 support (sm_89 or newer)."""
import pytest
import torch

import longattn
from longattn import reference as ref

F8 = torch.float8_e4m3fn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with float8 support (sm_89 or newer)")


def _fp8(shape, g):
    return torch.randn(*shape, device="cuda", generator=g).to(F8)


def _rows(cache, table, batch):
    if table is None:
        return cache
    return cache.view(torch.uint8)[table.long()].reshape(batch, -1, *cache.shape[2:]).view(F8)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_fp8_cache(paged, n_q, d):
    g = torch.Generator(device="cuda").manual_seed(d + n_q)
    B, Hq, Hk, cap = 3, 8, 2, 1280
    lens = torch.tensor([1000, 0, 1277 - n_q], dtype=torch.int32, device="cuda")
    q = torch.randn(B, n_q, Hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kn, vn = _fp8((B, n_q, Hk, d), g), _fp8((B, n_q, Hk, d), g)
    if paged:
        kc, vc = _fp8((64, 64, Hk, d), g), _fp8((64, 64, Hk, d), g)
        table = torch.randperm(64, device="cuda", generator=g)[:B * cap // 64].view(B, -1).to(torch.int32)
    else:
        kc, vc = _fp8((B, cap, Hk, d), g), _fp8((B, cap, Hk, d), g)
        table = None
    kd, vd = (torch.rand(B, Hk, device="cuda", generator=g) + 0.25 for _ in range(2))
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                                     k_descale=kd, v_descale=vd, return_lse=True)
    want, want_lse = ref.flash_attention_with_kvcache(
        q.double(), ref.dequantize_fp8(_rows(kc0, table, B), kd), ref.dequantize_fp8(_rows(vc0, table, B), vd),
        ref.dequantize_fp8(kn, kd), ref.dequantize_fp8(vn, vd), cache_seqlens=lens, return_lse=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=2e-2, rtol=1e-3)
    rows = _rows(kc, table, B)
    for b in range(B):
        assert torch.equal(rows[b, int(lens[b]):int(lens[b]) + n_q].view(torch.uint8), kn[b].view(torch.uint8))
    torch_out = longattn.flash_attention_with_kvcache(q, kc0, vc0, kn, vn, cache_seqlens=lens, block_table=table,
                                                      k_descale=kd, v_descale=vd, backend="torch")
    torch.testing.assert_close(torch_out.double(), want, atol=2e-2, rtol=2e-2)


def test_dilated_decode_fp8_cache():
    g = torch.Generator(device="cuda").manual_seed(5)
    B, H, d, cap = 2, 8, 64, 5000
    lens = torch.tensor([4999, 2047], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc = _fp8((B, cap, H, d), g), _fp8((B, cap, H, d), g)
    kd, vd = torch.rand(1, device="cuda", generator=g) + 0.25, torch.rand(B, H, device="cuda", generator=g) + 0.25
    kw = dict(segment_lengths=[1024, 2048, 4096], dilation_rates=[1, 2, 4])
    out = longattn.dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=kd, v_descale=vd, **kw)
    want = ref.dilated_attention_with_kvcache(q.double(), ref.dequantize_fp8(kc, kd), ref.dequantize_fp8(vc, vd),
                                              cache_seqlens=lens, **kw)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
