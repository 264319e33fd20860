"""FlashAttention-4 as a backend, on the CPU: the dispatch's choice among SDPA's default, FA4 and our kernels follows
the measured table; the adapter hands FA4 longattn's call (band, sinks, soft-cap, packed batches) as FA4's interface
takes it, checked against a stand-in for ``flash_attn.cute`` that computes FA4's documented semantics by the
reference. The real FA4 runs in tests/gpu/test_fa4_gpu.py."""
from types import SimpleNamespace

import pytest
import torch

import longattn
from longattn import reference as R
from longattn.backends import auto_table, dispatch, fa4


def _fa4_window(causal, window_size):
    left, right = (-1 if x is None else x for x in window_size)
    return causal, (left, right)


def _fake_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
               deterministic=False, return_lse=False):
    causal, window = _fa4_window(causal, window_size)
    out, lse = R.flash_attention(q.double(), k.double(), v.double(), causal=causal, window=window, scale=softmax_scale,
                                 return_lse=True, sinks=None if learnable_sink is None else learnable_sink.double(),
                                 softcap=softcap)
    return out.to(q.dtype), _fa4_lse(lse, return_lse, q, k, v)


def _fake_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                 causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, deterministic=False,
                 return_lse=False):
    causal, window = _fa4_window(causal, window_size)
    out, lse = R.flash_attention_varlen(q.double(), k.double(), v.double(), cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k, causal=causal, window=window, scale=softmax_scale,
                                        return_lse=True, softcap=softcap,
                                        sinks=None if learnable_sink is None else learnable_sink.double())
    return out.to(q.dtype), _fa4_lse(lse, return_lse, q, k, v)


def _fa4_lse(lse, return_lse, *inputs):
    """FA4's second result: the log-sum-exp where it was asked for or autograd needs it, else None."""
    needed = return_lse or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))
    return lse.float() if needed else None


@pytest.fixture
def fake_fa4(monkeypatch):
    """FA4 'installed' (a stand-in module) and running on the CPU (its device checks passed)."""
    monkeypatch.setattr(fa4, "_module", lambda: SimpleNamespace(flash_attn_func=_fake_func,
                                                               flash_attn_varlen_func=_fake_varlen))
    monkeypatch.setattr(fa4, "device_reason", lambda q: None)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 0)), dict(window=(3, 4)), dict(causal=True, window=(6, 2)),
                                dict(softcap=2.0, causal=True), dict(return_lse=True)])
def test_backend_fa4_hands_fa4_the_call_longattn_defines(fake_fa4, kw):
    q = torch.randn(2, 19, 4, 16).half()
    k, v = (torch.randn(2, 23, 2, 16).half() for _ in range(2))
    sinks = torch.randn(4) if "softcap" in kw else None
    got = longattn.flash_attention(q, k, v, backend="fa4", sinks=sinks, **kw)
    want = R.flash_attention(q.double(), k.double(), v.double(), sinks=None if sinks is None else sinks.double(), **kw)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.allclose(a.double(), b, atol=2e-3)


def test_backend_fa4_asks_fa4_for_the_lse_only_where_it_is_read(fake_fa4, monkeypatch):
    asked = []

    def func(*args, return_lse=False, **kwargs):
        asked.append(return_lse)
        return _fake_func(*args, return_lse=return_lse, **kwargs)

    monkeypatch.setattr(fa4, "_module", lambda: SimpleNamespace(flash_attn_func=func, flash_attn_varlen_func=None))
    q = torch.randn(1, 9, 2, 16).half()
    with torch.no_grad():
        out = longattn.flash_attention(q, q, q, causal=True, backend="fa4")
        out2, lse = longattn.flash_attention(q, q, q, causal=True, backend="fa4", return_lse=True)
    assert asked == [False, True] and torch.equal(out, out2) and lse.shape == (1, 2, 9)


def test_backend_fa4_packed_batch(fake_fa4):
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, 4, 16).half() for _ in range(3))
    out, lse = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                               return_lse=True, backend="fa4")
    want, wlse = R.flash_attention_varlen(q.double(), k.double(), v.double(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          causal=True, return_lse=True)
    assert torch.allclose(out.double(), want, atol=2e-3) and torch.allclose(lse.double(), wlse, atol=1e-5)


def test_backend_fa4_refuses_what_fa4_does_not_compute(fake_fa4):
    q = torch.randn(1, 8, 2, 16).half()
    with pytest.raises(ValueError, match="backend='fa4' cannot run: ALiBi"):
        longattn.flash_attention(q, q, q, alibi_slopes=torch.ones(2), backend="fa4")
    with pytest.raises(ValueError, match="backend='fa4' cannot run: dilated"):
        longattn.dilated_attention(q, q, q, segment_lengths=(4,), dilation_rates=(2,), backend="fa4")
    with pytest.raises(ValueError, match="backend='fa4' cannot run: dtype torch.float32"):
        longattn.flash_attention(q.float(), q.float(), q.float(), backend="fa4")
    # (FA4's tanh is the hardware's approximation: a capped score off by up to cap x 8e-6, large for large caps)
    with pytest.raises(ValueError, match="backend='fa4' cannot run: a soft-cap above 64"):
        longattn.flash_attention(q, q, q, softcap=1e4, backend="fa4")
    longattn.flash_attention(q, q, q, softcap=64.0, backend="fa4")


def test_backend_fa4_without_fa4_is_a_named_error():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="backend='fa4' cannot run: not a CUDA tensor"):
        longattn.flash_attention(q, q, q, backend="fa4")


def test_fa4_kinds():
    from longattn.call import SeqLens, flash_call
    from dataclasses import replace
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert fa4.kind_of(flash_call(1.0)) == "dense" and fa4.kind_of(flash_call(1.0, True)) == "causal"
    assert fa4.kind_of(flash_call(1.0, False, (8, 0))) == "window"
    assert fa4.kind_of(flash_call(1.0, True, (8, -1))) == "window"
    assert fa4.kind_of(replace(flash_call(1.0, True), sinks=torch.zeros(2))) == "sinks"
    assert fa4.kind_of(replace(flash_call(1.0, True), seqlens=SeqLens(cu, cu, 4, 4), sinks=torch.zeros(2))) == "packed"
    assert fa4.kind_of(replace(flash_call(1.0, True), softcap=5.0, seqlens=SeqLens(cu, cu, 4, 4))) == "softcap"


def _choose(monkeypatch, *, kind, keys, needs_grad, sdpa, triton=True, d=128):
    monkeypatch.setattr(auto_table, "device_class", lambda device: "sm90")
    q = torch.empty(1, 4, 2, d)
    sdpa_call = dispatch.SdpaCall(kind == "causal", False, needs_grad) if sdpa else None
    monkeypatch.setattr(dispatch.triton_support, "unsupported_reason", lambda *a: None if triton else "no")
    monkeypatch.setattr(dispatch, "choose", dispatch.choose)
    # (a CPU tensor is 'not a CUDA tensor' for the Triton kernels: pretend a GPU for the order under test)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return dispatch.choose("auto", q, fn="t", sdpa=sdpa_call, fa4=dispatch.Fa4Call(kind, keys, needs_grad))


@pytest.mark.parametrize("kind,keys,needs_grad,sdpa,d,want", [
    ("dense", 1024, False, True, 128, "sdpa"),      # N = 1k forwards: SDPA's default measured fastest
    ("dense", 4096, False, True, 128, "fa4"),
    ("causal", 1024, True, True, 64, "fa4"),        # D=64 causal fwd+bwd at 1k: FA4 measured faster than SDPA
    ("causal", 4096, True, True, 64, "fa4"),
    ("dense", 1024, True, True, 64, "fa4"),         # forward+backward: FA4 at every other row
    ("causal", 1024, False, True, 64, "sdpa"),
    ("causal", 1024, False, False, 64, "triton"),   # no SDPA (N != M, lse): our kernels before FA4 there
    ("window", 8192, True, False, 128, "fa4"),
    ("softcap", 8192, False, False, 128, "triton"),  # our kernels measured faster with soft-capping
    ("window", 8192, True, False, 64, "triton"),    # unmeasured at D=64: FA4 not chosen
    ("dense", 4096, False, True, 256, "sdpa"),      # unmeasured at D=256: the table without FA4
])
def test_auto_picks_the_measured_fastest_among_sdpa_fa4_and_ours(monkeypatch, kind, keys, needs_grad, sdpa, d, want):
    assert _choose(monkeypatch, kind=kind, keys=keys, needs_grad=needs_grad, sdpa=sdpa, d=d) == want


def test_auto_without_fa4_is_unchanged(monkeypatch):
    monkeypatch.setattr(auto_table, "device_class", lambda device: "sm90")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(dispatch.triton_support, "unsupported_reason", lambda *a: None)
    q = torch.empty(1, 4, 2, 128)
    assert dispatch.choose("auto", q, fn="t", sdpa=dispatch.SdpaCall(False, False, True)) == "sdpa"
    assert dispatch.choose("auto", q, fn="t", sdpa=None) == "triton"


def test_backend_fa4_packed_batch_passes_views_so_its_backward_copies_nothing(fake_fa4, monkeypatch):
    """The packed batch's one batch row is dropped by a view: an index's backward would zero-fill q-, k- and v-sized
    gradients and copy FA4's into them (measured: 9% of a packed forward+backward)."""
    made_by = []

    def varlen(q, k, v, **kw):
        made_by.extend(type(x.grad_fn).__name__ for x in (q, k, v))
        return _fake_varlen(q, k, v, **kw)

    monkeypatch.setattr(fa4, "_module", lambda: SimpleNamespace(flash_attn_func=_fake_func,
                                                               flash_attn_varlen_func=varlen))
    cu = torch.tensor([0, 9, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, 4, 16).half().requires_grad_() for _ in range(3))
    out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="fa4")
    assert len(made_by) == 3 and not [n for n in made_by if n.startswith(("Select", "Index"))], made_by
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_auto_orders_packed_batches_by_their_longest_document():
    from longattn.backends.auto_table import FA4, TRITON, order_with_fa4
    assert order_with_fa4("sm90", "fwd_bwd", "packed", 128, keys=1024)[0] == TRITON
    assert order_with_fa4("sm90", "fwd_bwd", "packed", 128, keys=16384)[0] == FA4
    assert order_with_fa4("sm90", "fwd", "packed", 128, keys=1024)[0] == FA4


def test_explicit_passes_of_the_ring_blocks_refuse_fa4_by_name(fake_fa4, monkeypatch):
    """The ring's blocks run the explicit forward and backward (float32 partial outputs merged by log-sum-exp, the
    backward from the merged statistics), which FA4's whole-call autograd does not offer: a named refusal, and
    auto's plan for them never names FA4."""
    from longattn import runner
    from longattn.call import flash_call
    from longattn.backends import auto_table
    monkeypatch.setattr(auto_table, "device_class", lambda device: "sm90")
    q = torch.randn(1, 8192, 16, 128).half()
    call = flash_call(128 ** -0.5, True)
    with pytest.raises(ValueError, match="backend='fa4' cannot run: explicit forward or backward passes"):
        runner.forward(q[:, :8], q[:, :8], q[:, :8], call, backend="fa4", fn="ring_attention")
    assert runner.choose("auto", q, call, fn="ring_attention", k=q, v=q) == "fa4"  # the whole call: the table's FA4
    assert runner.choose("auto", q, call, fn="ring_attention") != "fa4"  # a block's explicit pass


def test_fa4_refuses_batched_gradients_by_name(fake_fa4):
    """is_grads_batched=True runs the backward under vmap, whose gradients FA4's kernels cannot read (PyTorch's own
    error there names nothing the caller wrote): refused by name before FA4's backward runs."""
    q, k, v = (torch.randn(1, 9, 2, 16).half().requires_grad_() for _ in range(3))
    out = longattn.flash_attention(q, k, v, causal=True, backend="fa4")
    with pytest.raises(RuntimeError, match=r"backend 'fa4'.*batched output gradients"):
        torch.autograd.grad(out, q, torch.randn(3, *out.shape).half(), is_grads_batched=True)
    dq, = torch.autograd.grad(out, q, torch.randn_like(out))  # one at a time: fine
    assert dq.shape == q.shape


def test_fa4_refuses_a_second_derivative_instead_of_returning_none(fake_fa4):
    """FA4's gradients carry no graph: under create_graph=True the second derivative would silently be zero."""
    q, k, v = (torch.randn(1, 9, 2, 16).half().requires_grad_() for _ in range(3))
    out = longattn.flash_attention(q, k, v, causal=True, backend="fa4")
    dq, = torch.autograd.grad(out.float().sum(), q, retain_graph=True)  # a first derivative: fine
    assert dq.shape == q.shape
    with pytest.raises(RuntimeError, match=r"backend 'fa4'.*second derivatives"):
        torch.autograd.grad(out.float().sum(), q, create_graph=True)
