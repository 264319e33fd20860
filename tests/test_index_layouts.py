"""Index tensors in any memory layout: ``cu_seqlens``, ``cache_seqlens`` and ``block_table`` given as strided views
(every other element of a longer tensor, a column-major table), int32 or int64, give the reference's answer on the
Triton kernels (in the interpreter) as on the PyTorch backend. The kernels read them as ``base + i``: the calls
hand them over int32 and contiguous (``longattn.call.int32_index``)."""
import pytest
import torch

import longattn
from longattn import reference as ref


def _every_other(values, dtype):
    """``values`` as a view with stride 2 (every other element of a tensor twice as long)."""
    return torch.tensor([x for v in values for x in (v, -7)], dtype=dtype)[::2]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_strided_cu_seqlens(dtype, backend, gen):
    q, k, v = (torch.randn(10, 2, 16, generator=gen) for _ in range(3))
    cu = _every_other([0, 4, 4, 10], dtype)
    assert cu.stride(0) == 2
    out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend=backend)
    want = ref.flash_attention_varlen(*(t.double() for t in (q, k, v)), cu_seqlens_q=cu.contiguous(),
                                      cu_seqlens_k=cu.contiguous(), causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    out = longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu, segment_lengths=[4], dilation_rates=[2],
                                            causal=True, backend=backend)
    want = ref.dilated_attention_varlen(*(t.double() for t in (q, k, v)), cu_seqlens=cu.contiguous(),
                                        segment_lengths=[4], dilation_rates=[2], causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_strided_cache_seqlens_and_a_column_major_block_table(dtype, backend, gen):
    B, Hk, D, pages, page = 2, 1, 16, 8, 4
    q = torch.randn(B, 1, 2, D, generator=gen)
    kc, vc = (torch.randn(pages, page, Hk, D, generator=gen) for _ in range(2))
    table = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]], dtype=dtype).t().contiguous().t()  # column-major
    lens = _every_other([13, 9], dtype)
    assert table.stride(1) != 1 and lens.stride(0) == 2
    with torch.no_grad():
        out = longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                    backend=backend)
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens.contiguous(),
                                            block_table=table.contiguous())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    kc, vc = (torch.randn(B, 16, Hk, D, generator=gen) for _ in range(2))  # a contiguous cache
    with torch.no_grad():
        out = longattn.dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, segment_lengths=[8],
                                                      dilation_rates=[2], backend=backend)
    want = ref.dilated_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens.contiguous(),
                                              segment_lengths=[8], dilation_rates=[2])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_nan_sink_gives_nan_in_decode_as_everywhere(backend, gen):
    """A NaN sink logit makes the softmax NaN on every route (the reference's answer), decode's split merge too: the
    output and the log-sum-exp (not -inf, which says 'no key' to a caller merging partial results)."""
    q = torch.randn(1, 1, 2, 16, generator=gen)
    k, v = (torch.randn(1, 6, 2, 16, generator=gen) for _ in range(2))
    sinks = torch.tensor([float("nan"), 0.5])
    with torch.no_grad():
        out, lse = longattn.flash_attention_with_kvcache(q, k, v, cache_seqlens=6, sinks=sinks, backend=backend,
                                                         return_lse=True)
    want, want_lse = ref.flash_attention(q.double(), k.double(), v.double(), sinks=sinks.double(), return_lse=True)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out[:, :, 0]).all()
    assert torch.isnan(lse[:, 0]).all() and torch.isnan(want_lse[:, 0]).all()
    torch.testing.assert_close(out[:, :, 1].double(), want[:, :, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, 1].double(), want_lse[:, 1], atol=1e-5, rtol=1e-5)
