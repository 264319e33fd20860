"""GPU, where FlashAttention-4 is installed: the FA4 backend computes longattn's semantics (the float64 reference):
dense, causal and windows aligned bottom-right with N != M, rows that see no key, grouped-query heads, sinks,
soft-capping, the log-sum-exp and its gradient, packed batches with empty sequences, deterministic backwards."""
from dataclasses import replace

import pytest
import torch

import _rows as rows

from longattn import reference as R
from longattn.backends import fa4
from longattn.call import SeqLens, flash_call

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not fa4.installed(), reason="needs FlashAttention-4 (flash_attn.cute)")]


def _rel(a, b):
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    return rows.rel(a, b)


CASES = [  # (n, m, hq, hk, d, causal, window, softcap, sinks)
    (1000, 1000, 8, 8, 128, False, (-1, -1), 0.0, False),
    (777, 1025, 8, 2, 64, True, (-1, -1), 0.0, False),
    (1025, 300, 4, 4, 128, True, (-1, -1), 0.0, False),  # N > M causal: the first rows see no key
    (513, 513, 6, 3, 64, False, (100, 20), 0.0, False),
    (640, 900, 8, 8, 128, False, (64, 0), 30.0, True),
    (300, 300, 4, 1, 256, True, (-1, -1), 0.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("deterministic", [False, True])
def test_fa4_matches_reference(case, deterministic):
    n, m, hq, hk, d, causal, window, softcap, with_sinks = case
    g = torch.Generator(device="cuda").manual_seed(n + d)
    dt = torch.bfloat16
    q = torch.randn(2, n, hq, d, device="cuda", dtype=dt, generator=g).requires_grad_()
    k, v = (torch.randn(2, m, hk, d, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(2))
    sinks = torch.randn(hq, device="cuda", generator=g).requires_grad_() if with_sinks else None
    scale = d ** -0.5
    call = replace(flash_call(scale, causal, window), sinks=sinks, softcap=softcap, deterministic=deterministic)
    assert fa4.unsupported_reason(q, call) is None
    out, lse = fa4.attention(q, k, v, call)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    (out.float() * do.float()).sum().backward(inputs=[q, k, v] + ([sinks] if with_sinks else []), retain_graph=True)
    got = [out, lse] + [x.grad.clone() for x in (q, k, v)] + ([sinks.grad.clone()] if with_sinks else [])
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    s64 = sinks.detach().double().requires_grad_() if with_sinks else None
    ro, rl = R.flash_attention(*leaves, causal=causal, window=window, scale=scale, return_lse=True, sinks=s64,
                               softcap=softcap)
    (ro * do.double()).sum().backward()
    want = [ro, rl] + [x.grad for x in leaves] + ([s64.grad] if with_sinks else [])
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, want):
        assert _rel(a, b) < (2e-2 if name != "lse" else 1e-3), name


def test_fa4_lse_gradient_and_packed_batch_with_empty_sequences():
    g = torch.Generator(device="cuda").manual_seed(5)
    lens = [300, 0, 1000, 17, 513]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    call = replace(flash_call(128 ** -0.5, True), seqlens=SeqLens(cu, cu, max(lens), max(lens)))
    out, lse = fa4.attention(q[None], k[None], v[None], call)
    dl = torch.randn_like(lse)
    (out.float().sum() + (lse * dl).sum()).backward()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rl = R.flash_attention_varlen(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)
    (ro.sum() + (rl * dl[0].double()).sum()).backward()
    assert _rel(out[0], ro) < 2e-2 and _rel(lse[0], rl) < 1e-3
    for a, b in zip((q, k, v), leaves):
        assert _rel(a.grad, b.grad) < 2e-2


def test_fa4_deterministic_backward_is_bitwise_reproducible():
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn_like(q)
    call = replace(flash_call(128 ** -0.5, True), deterministic=True)
    grads = []
    for _ in range(3):
        out, _ = fa4.attention(q, k, v, call)
        grads.append(torch.autograd.grad(out, (q, k, v), do))
    for later in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], later))


def test_auto_runs_fa4_where_the_table_says_and_matches_the_reference(monkeypatch):
    import longattn
    from longattn import explain
    calls = []
    real = fa4.attention
    monkeypatch.setattr(fa4, "attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    assert explain(longattn.flash_attention, q, k, v, causal=True).backend == "fa4"
    out = longattn.flash_attention(q, k, v, causal=True)
    out.float().sum().backward()
    assert calls == [1]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = R.flash_attention(*leaves, causal=True)
    ref.sum().backward()
    assert _rel(out, ref) < 2e-2 and all(_rel(a.grad, b.grad) < 2e-2 for a, b in zip((q, k, v), leaves))
    # soft-capping: the table measured our kernels faster
    assert explain(longattn.flash_attention, q, k, v, causal=True, softcap=30.0).backend == "triton"
    # a transposed (B, H, N, D) layout, as transformers passes it
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert _rel(longattn.flash_attention(qt, kt, vt, causal=True, backend="fa4"), ref) < 2e-2
