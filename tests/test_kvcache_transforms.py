"""KV-cache calls under torch.func transforms and forward-mode AD: vmap runs the PyTorch backend (appending into
each batched cache in place), kernel backends and differentiation are refused by name."""
import pytest
import torch
from torch.autograd import forward_ad

from longattn import flash_attention_with_kvcache
from longattn.reference import flash_attention_with_kvcache as reference


def _inputs(dtype=torch.float64, batch=2, m=8):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(batch, 1, 4, 8), r(batch, m, 2, 8), r(batch, m, 2, 8), r(batch, 1, 2, 8), r(batch, 1, 2, 8)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_vmap_over_caches_appends_into_each(backend):
    lens = torch.tensor([3, 5], dtype=torch.int32)
    runs = [_inputs(), tuple(x + 1 for x in _inputs())]
    batched = [torch.stack([a, b]) for a, b in zip(*runs)]
    out = torch.func.vmap(lambda q, kc, vc, k, v: flash_attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, backend=backend))(*batched)
    for i, (q, kc, vc, k, v) in enumerate(runs):
        want = flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, backend="torch")
        torch.testing.assert_close(out[i], want)
        torch.testing.assert_close(batched[1][i], kc)  # appended in place in the batched cache
        torch.testing.assert_close(batched[2][i], vc)


def test_vmap_refused_by_kernel_backend_and_batched_lengths():
    q, kc, vc, _, _ = _inputs()
    stack = lambda x: torch.stack([x, x])  # noqa: E731
    with pytest.raises(ValueError, match="backend='triton' cannot run: a torch.func transform"):
        torch.func.vmap(lambda q, kc, vc: flash_attention_with_kvcache(q, kc, vc, cache_seqlens=3,
                                                                       backend="triton"))(stack(q), stack(kc), stack(vc))
    lens = torch.tensor([[3, 5], [2, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens is batched by vmap"):
        torch.func.vmap(lambda q, kc, vc, n: flash_attention_with_kvcache(q, kc, vc, cache_seqlens=n))(
            stack(q), stack(kc), stack(vc), lens)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_forward_ad_tangent_refused(backend):
    q, kc, vc, _, _ = _inputs(torch.float32)
    with forward_ad.dual_level():
        qd = forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(ValueError, match="inference only.*forward-mode AD tangent"):
            flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=3, backend=backend)
    with pytest.raises(ValueError, match="inference only.*forward-mode AD tangent"):
        torch.func.jvp(lambda x: flash_attention_with_kvcache(x, kc, vc, cache_seqlens=3, backend=backend), (q,),
                       (torch.ones_like(q),))


def test_func_grad_refused():
    q, kc, vc, _, _ = _inputs()
    with pytest.raises(ValueError, match="inference only.*torch.func transform"):
        torch.func.grad(lambda x: flash_attention_with_kvcache(x, kc, vc, cache_seqlens=3).sum())(q)


def test_plain_call_unchanged_against_reference():
    q, kc, vc, k, v = _inputs()
    kc2, vc2 = kc.clone(), vc.clone()
    out = flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=4)
    want = reference(q, kc2, vc2, k, v, cache_seqlens=torch.tensor([4, 4], dtype=torch.int32))
    torch.testing.assert_close(out, want if not isinstance(want, tuple) else want[0])
    torch.testing.assert_close(kc[:, 4:5], k)  # appended at row cache_seqlens
