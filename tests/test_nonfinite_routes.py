"""Non-finite inputs give the same answer on every route: the reference's IEEE rule (a NaN or +inf score among the
keys a query may attend makes its row NaN, a key it may not attend never affects it, a row with no key is 0),
whether ``auto`` runs SDPA's kernel, the PyTorch backend or the Triton kernels (interpreter)."""
import pytest
import torch

import longattn
from longattn import reference as R


def _same(got, want):
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.allclose(got.nan_to_num(), want.to(got.dtype).nan_to_num(), atol=1e-5)


def _poisoned(kind: str, n: int, dtype, gen):
    q = torch.randn(1, n, 2, 8, dtype=dtype, generator=gen)
    k = torch.randn(1, n, 1, 8, dtype=dtype, generator=gen)
    v = torch.randn(1, n, 1, 8, dtype=dtype, generator=gen)
    i, d = int(torch.randint(0, n, (1,), generator=gen)), int(torch.randint(0, 8, (1,), generator=gen))
    target, value = {"nan q": (q, float("nan")), "inf q": (q, float("inf")), "nan k": (k, float("nan")),
                     "inf k": (k, float("inf"))}[kind]
    target[0, i, 0, d] = value
    return q, k, v


@pytest.mark.parametrize("kind", ["nan q", "inf q", "nan k", "inf k"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_attention_routes_agree_on_non_finite_input(kind, causal, dtype, gen):
    for _ in range(6):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        q, k, v = _poisoned(kind, n, dtype, gen)
        want = R.flash_attention(q, k, v, causal=causal)
        for backend in ("auto", "torch", "triton"):
            if backend == "triton" and dtype == torch.float64:
                continue  # the kernels take float16/float32
            _same(longattn.flash_attention(q, k, v, causal=causal, backend=backend), want)


def test_a_nan_query_row_stays_nan_under_auto():
    """The case a diverging training run meets: one NaN in one query; CPU SDPA's kernel returns 0 for that row."""
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    q[0, 3, 0, 5] = float("nan")
    out = longattn.flash_attention(q, k, v)
    assert torch.isnan(out[0, 3, 0]).all()
    assert torch.isfinite(out[0, :3]).all() and torch.isfinite(out[0, 4:]).all() and torch.isfinite(out[0, 3, 1]).all()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_nan_query_and_stale_nan_cache_rows(backend):
    """Decode: a NaN query gives NaN (not 0); NaN garbage in cache rows past a sequence's length (an uninitialised
    cache) never reaches it (CPU SDPA's additive mask would spread it)."""
    gen = torch.Generator().manual_seed(3)
    kc, vc = (torch.randn(2, 16, 2, 8, generator=gen) for _ in range(2))
    kc[1, 12:] = float("nan")
    q = torch.randn(2, 1, 2, 8, generator=gen)
    lens = torch.tensor([14, 10], dtype=torch.int32)
    out = longattn.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=lens, backend=backend)
    assert torch.isfinite(out).all()
    want = R.flash_attention(q[1:], kc[1:, :10], vc[1:, :10])
    assert torch.allclose(out[1:], want, atol=1e-5)
    q[0, 0, 0, 1] = float("nan")
    out = longattn.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=10, backend=backend)
    assert torch.isnan(out[0, 0, 0]).all() and torch.isfinite(out[0, 0, 1]).all() and torch.isfinite(out[1]).all()
