"""Numerics at the edges, on the PyTorch backend and the Triton kernels (interpreter), against the float64
reference: rows that see no key on every entry point (0 output, -inf log-sum-exp, zero gradients, with a loss that
reads the log-sum-exp too), and extreme settings (scales, soft-caps, ALiBi slopes, sinks, logits past float16's
range)."""
import pytest
import torch

import longattn
from longattn import reference as R

I32 = torch.int32


def _grads(fn, tensors, out_grad, lse_grad):
    """``fn(*tensors) -> (out, lse)`` and the gradients of ``<out, out_grad> + <lse, lse_grad>`` over the finite
    entries of ``lse``."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    out, lse = fn(*leaves)
    live = torch.isfinite(lse)
    loss = (out.double() * out_grad).sum() + (torch.where(live, lse, 0).double() * lse_grad).sum()
    return out, lse, torch.autograd.grad(loss, leaves)


def _agrees(fn, ref, tensors, dtype, atol):
    """``fn`` in ``dtype`` against ``ref`` on the same (rounded) values in float64."""
    tensors = [t.to(dtype) for t in tensors]
    gen = torch.Generator().manual_seed(5)
    r_out, r_lse = ref(*[t.double() for t in tensors])
    out_grad = torch.randn(r_out.shape, generator=gen, dtype=torch.float64)
    lse_grad = torch.randn(r_lse.shape, generator=gen, dtype=torch.float64)
    out, lse, grads = _grads(fn, tensors, out_grad, lse_grad)
    r_out, r_lse, r_grads = _grads(ref, [t.double() for t in tensors], out_grad, lse_grad)
    assert lse.dtype == torch.float32 and lse.shape == r_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)) and torch.isfinite(out).all()
    live = torch.isfinite(r_lse)
    assert (lse[live].double() - r_lse[live]).abs().max() <= atol * max(1.0, r_lse[live].abs().max().item())
    assert (out.double() - r_out).abs().max() <= atol
    for g, w in zip(grads, r_grads):
        assert torch.isfinite(g).all() and (g.double() - w).abs().max() <= 5 * atol * max(1.0, w.abs().max().item())


def _rnd(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _no_key_calls(gen):
    """(name, fn(backend) -> (out, lse) on q, k, v, the reference, q, k, v), each with rows that see no key."""
    q, k, v = _rnd(1, 9, 2, 8, gen=gen), _rnd(1, 4, 2, 8, gen=gen), _rnd(1, 4, 2, 8, gen=gen)
    yield "causal N > M", (lambda be: lambda *t: longattn.flash_attention(*t, causal=True, return_lse=True,
                                                                            backend=be),
                           lambda *t: R.flash_attention(*t, causal=True, return_lse=True), (q, k, v))
    yield "window of no key", (lambda be: lambda *t: longattn.flash_attention(*t, window=(0, 0), return_lse=True,
                                                                                backend=be),
                               lambda *t: R.flash_attention(*t, window=(0, 0), return_lse=True), (q, k, v))
    cu_q, cu_k = torch.tensor([0, 3, 3, 7, 9], dtype=I32), torch.tensor([0, 0, 2, 2, 4], dtype=I32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)  # q-empty, k-empty documents
    yield "packed", (lambda be: lambda *t: longattn.flash_attention_varlen(*t, backend=be, **kw),
                     lambda *t: R.flash_attention_varlen(*t, **kw), (q[0], k[0], v[0]))
    q, k, v = _rnd(1, 40, 2, 8, gen=gen), _rnd(1, 40, 2, 8, gen=gen), _rnd(1, 40, 2, 8, gen=gen)
    mask = torch.zeros(1, 2, 3, 3, dtype=torch.bool)
    mask[0, 0, 0, 0] = mask[0, 0, 2, 1] = mask[0, 1, 1, 2] = True
    kw = dict(block_mask=mask, block_size=16, causal=True, return_lse=True)
    yield "block mask", (lambda be: lambda *t: longattn.block_sparse_attention(*t, backend=be, **kw),
                         lambda *t: R.block_sparse_attention(*t, **kw), (q, k, v))
    q, k, v = _rnd(1, 7, 4, 8, gen=gen), _rnd(1, 7, 4, 8, gen=gen), _rnd(1, 7, 4, 8, gen=gen)
    kw = dict(segment_lengths=(16, 4), dilation_rates=(8, 3), causal=True, return_lse=True)  # offsets past N
    yield "dilated", (lambda be: lambda *t: longattn.dilated_attention(*t, backend=be, **kw),
                      lambda *t: R.dilated_attention(*t, **kw), (q, k, v))


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float32), ("triton", torch.float32),
                                            ("triton", torch.float16)])
def test_rows_without_keys_on_every_entry_point(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    for name, (fn, ref, tensors) in _no_key_calls(gen):
        _agrees(fn(backend), ref, tensors, dtype, 2e-2 if dtype == torch.float16 else 1e-4)


def _extreme_settings(heads):
    # (scores of 1e4 and more: the kernels' backward, which reads P = exp(s - lse) from the float32 log-sum-exp as
    # FlashAttention's does, is off by a few 1e-3 there; the PyTorch backend recomputes the row maxima)
    yield dict(scale=1e3)
    yield dict(scale=1e-30)
    yield dict(softcap=1e-3)
    yield dict(softcap=1e6)
    for slope in (1e3, -1e3):
        yield dict(alibi_slopes=torch.full((heads,), slope))
        yield dict(alibi_slopes=torch.full((heads,), slope), window=(2, 1))
    for sink in (1e4, -1e4):
        yield dict(sinks=torch.full((heads,), sink), window=(0, 0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extreme_settings_against_the_reference(backend):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _rnd(1, 7, 2, 16, gen=gen), _rnd(1, 9, 2, 16, gen=gen), _rnd(1, 9, 2, 16, gen=gen)
    for kw in _extreme_settings(2):
        kw = dict(kw, causal=True, return_lse=True)
        _agrees(lambda *t: longattn.flash_attention(*t, backend=backend, **kw),
                lambda *t: R.flash_attention(*t, **kw), (q, k, v), torch.float32, 1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float16_logits_past_float16s_range(backend):
    """|q.k| ~ 1e4 to 1e5 with float16 inputs: the scores overflow float16 but the outputs do not."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = _rnd(1, 7, 2, 16, gen=gen, scale=80), _rnd(1, 9, 2, 16, gen=gen, scale=80), _rnd(1, 9, 2, 16, gen=gen)
    for causal in (False, True):
        _agrees(lambda *t: longattn.flash_attention(*t, causal=causal, return_lse=True, backend=backend),
                lambda *t: R.flash_attention(*t, causal=causal, return_lse=True), (q, k, v), torch.float16, 3e-2)
