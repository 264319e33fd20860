"""Autograd beyond ``.backward()``: ``torch.func`` transforms and forward-mode AD, against the reference (float64,
PyTorch backend) and refused by name where the kernels cannot follow (the Triton backend, in the interpreter)."""
import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import longattn
from longattn import reference as ref


def _qkv(n=6, m=7, hq=2, hk=1, d=4, dtype=torch.float64, batch=()):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*batch, 1, s, h, d, generator=g, dtype=dtype) for s, h in ((n, hq), (m, hk), (m, hk)))


def _close(a, b, tol=1e-10):
    assert a.shape == b.shape and torch.allclose(a, b.to(a.dtype), atol=tol, rtol=tol), (a - b).abs().max()


_SINKS = torch.tensor([0.3, -0.8], dtype=torch.float64)
_MASK = torch.tensor([[True, False], [True, True]])[None, None]
_CALLS = {  # name: (lib or reference module, q, k, v) -> (out, lse)
    "flash": lambda m, q, k, v, **kw: m.flash_attention(q, k, v, causal=True, sinks=_SINKS, softcap=2.0,
                                                        return_lse=True, **kw),
    "dilated": lambda m, q, k, v, **kw: m.dilated_attention(q, k[:, :6], v[:, :6], segment_lengths=[3, 6],
                                                            dilation_rates=[1, 2], return_lse=True, **kw),
    "block_sparse": lambda m, q, k, v, **kw: m.block_sparse_attention(q, k, v, block_mask=_MASK, block_size=4,
                                                                      return_lse=True, **kw),
}


@pytest.mark.parametrize("budget", [None, 7])  # 7: every chunk one query row (many checkpointed chunks before)
@pytest.mark.parametrize("name", sorted(_CALLS))
def test_torch_func_grad_and_hessian_match_the_reference(name, budget):
    """torch.func.grad (and jacrev) failed on the PyTorch backend, the default's route for these calls on the CPU:
    its chunks are checkpointed, and torch.func disables the saved-tensor hooks a checkpoint installs ("don't yet
    support saved tensor hooks"). They now run without checkpoints there: gradients and Hessians as the
    reference's."""
    call = _CALLS[name]

    def loss(module, **kw):
        def f(q, k, v):
            out, lse = call(module, q, k, v, **kw)
            return (out ** 2).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()
        return f

    q, k, v = _qkv()
    with longattn.routing(torch_score_budget=budget) if budget else contextlib.nullcontext():
        got = grad(loss(longattn, backend="torch"), argnums=(0, 1, 2))(q, k, v)
        got_h = jacfwd(jacrev(loss(longattn, backend="auto")))(q, k, v)
    want = grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    want_h = jacfwd(jacrev(loss(ref)))(q, k, v)
    for a, b in zip(got, want):
        _close(a, b)
    for a, b in zip(got_h, want_h):
        _close(a, b)


def test_forward_mode_ad_matches_the_reference_under_auto():
    """A forward-mode tangent through the default backend: on the CPU, "auto" ran PyTorch's SDPA kernel, which has
    no forward derivative (NotImplementedError); such inputs now run the PyTorch backend."""
    q, k, v = _qkv()
    tq, tk, tv = _qkv(n=6, m=7)
    for kw in (dict(), dict(causal=True, return_lse=True)):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in ((q, tq), (k, tk), (v, tv))]
            got = longattn.flash_attention(*duals, **kw)
            got = [fwAD.unpack_dual(x).tangent for x in (got if isinstance(got, tuple) else (got,))]
        want = jvp(lambda a, b, c: ref.flash_attention(a, b, c, **kw), (q, k, v), (tq, tk, tv))[1]
        for a, b in zip(got, want if isinstance(want, tuple) else (want,)):
            _close(a, b)
    vq, vk, vv = _qkv(batch=(3,))
    _close(vmap(lambda a, b, c: longattn.flash_attention(a, b, c))(vq, vk, vv),
           vmap(lambda a, b, c: ref.flash_attention(a, b, c))(vq, vk, vv))


@pytest.mark.parametrize("mode", ["forward_ad", "forward_ad_no_grad", "vmap", "grad", "jvp"])
def test_triton_backend_refuses_transforms_by_name(mode):
    """The Triton kernels read raw memory and define no forward derivative or batching rule: a forward-mode tangent
    was dropped silently (the output had none, read as a zero derivative), and under torch.func the kernels failed
    deep inside ("Cannot access data pointer of Tensor that doesn't have storage"). Refused by name now, naming
    the backend that computes it; the same call on "auto" runs the PyTorch backend."""
    q, k, v = _qkv(dtype=torch.float32)
    call = lambda a, b, c, backend="triton": longattn.flash_attention(a, b, c, causal=True, backend=backend)  # noqa
    match = r"flash_attention: backend='triton' cannot run: (a torch.func transform|forward-mode AD).*backend='torch'"
    if mode.startswith("forward_ad"):
        with fwAD.dual_level(), (torch.no_grad() if mode.endswith("no_grad") else torch.enable_grad()):
            dq = fwAD.make_dual(q, torch.ones_like(q))
            with pytest.raises(ValueError, match=match):
                call(dq, k, v)
            tangent = fwAD.unpack_dual(call(dq, k, v, backend="auto")).tangent
        assert tangent is not None and tangent.abs().sum() > 0
        return
    transform = {"vmap": lambda f: vmap(f), "grad": lambda f: grad(lambda *a: f(*a).sum()),
                 "jvp": lambda f: (lambda *a: jvp(f, a, a))}[mode]
    args = _qkv(dtype=torch.float32, batch=(2,)) if mode == "vmap" else (q, k, v)
    with pytest.raises(ValueError, match=match):
        transform(call)(*args)
    transform(lambda a, b, c: call(a, b, c, backend="auto"))(*args)


def test_explicit_passes_refuse_transforms_by_name_on_the_triton_backend():
    """ops.attention_forward under vmap reached the kernels with batched tensors and failed deep inside."""
    q, k, v = _qkv(dtype=torch.float32, batch=(2,))
    with pytest.raises(ValueError, match=r"attention_forward: backend='triton' cannot run: a torch.func transform"):
        vmap(lambda a, b, c: longattn.ops.attention_forward(a, b, c, backend="triton")[0])(q, k, v)
    out = vmap(lambda a, b, c: longattn.ops.attention_forward(a, b, c, backend="auto")[0])(q, k, v)
    _close(out, torch.stack([ref.flash_attention(*(x[i] for x in (q, k, v))) for i in range(2)]), tol=1e-5)


@pytest.mark.parametrize("budget", [None, 7])
@pytest.mark.parametrize("what", ["alibi", "alibi_varlen", "block_mask"])
def test_pytorch_backend_refuses_a_backward_after_its_alibi_or_block_mask_changed_in_place(what, budget):
    """The PyTorch backend recomputes each checkpointed chunk in the backward, reading ALiBi's slopes and the block
    mask again: modified in place after the forward, they silently gave the gradients of other values (off by
    0.5-2 here). Refused now, as PyTorch refuses a saved tensor modified in place (and the Triton backend, which
    saves the slopes, does); unmodified, the gradients are the reference's."""
    q, k, v = (x.requires_grad_() for x in _qkv(n=8, m=8))
    slopes = torch.tensor([0.5, 1.0], dtype=torch.float32)
    mask = torch.tensor([[True, False], [True, True]])[None, None].clone()
    cu = torch.tensor([0, 3, 8])

    def run(**kw):
        if what == "alibi":
            return longattn.flash_attention(q, k, v, alibi_slopes=slopes, causal=True, **kw)
        if what == "alibi_varlen":
            return longattn.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                   alibi_slopes=slopes.expand(2, 2), **kw)
        return longattn.block_sparse_attention(q, k, v, block_mask=mask, block_size=4, **kw)

    want = torch.autograd.grad(run(backend="torch").sum(), (q, k, v))
    with longattn.routing(torch_score_budget=budget) if budget else contextlib.nullcontext():
        out = run(backend="torch")
        changed, name = (mask, "block_mask") if what == "block_mask" else (slopes, "alibi_slopes")
        kept = changed.clone()
        changed.copy_(~changed if changed.dtype == torch.bool else changed * 3)
        with pytest.raises(RuntimeError, match=rf"modified by an inplace operation: {name} is at version"):
            torch.autograd.grad(out.sum(), (q, k, v))
        changed.copy_(kept)
        got = torch.autograd.grad(run(backend="torch").sum(), (q, k, v))  # (a call after the change: no error)
    ref_fn = {"alibi": lambda: ref.flash_attention(q, k, v, alibi_slopes=slopes, causal=True),
              "alibi_varlen": lambda: ref.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                 alibi_slopes=slopes.expand(2, 2)),
              "block_mask": lambda: ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=4)}[what]
    for a, b, c in zip(got, want, torch.autograd.grad(ref_fn().sum(), (q, k, v))):
        _close(a, c)
        _close(b, c)


@pytest.mark.parametrize("empty", ["keys", "queries"])
def test_zero_size_calls_under_torch_func_and_forward_ad(empty):
    """A call with no keys (or no queries) returns its zeros from an autograd Function, which torch.func and
    forward-mode AD refused ("must override the setup_context staticmethod", "You must implement the jvp function").
    Zeros now, with zero gradients and tangents, as the reference gives."""
    q, k, v = _qkv(n=0 if empty == "queries" else 3, m=0 if empty == "keys" else 4)
    f = lambda a, b, c: longattn.flash_attention(a, b, c, causal=True)  # noqa: E731
    for got in (grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v), jvp(f, (q, k, v), (q, k, v)),
                vmap(f)(*(x[None] for x in (q, k, v)))):
        for x in got:
            assert not x.abs().sum()
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(f(fwAD.make_dual(q, torch.ones_like(q)), k, v)).tangent
    assert tangent is not None and tangent.shape == (1, q.shape[1], 2, 4) and not tangent.abs().sum()
    out = f(*(x.requires_grad_() for x in (q, k, v)))  # (plain autograd: the Function, as before)
    assert type(out.grad_fn).__name__ == "_NoKeysBackward" and out.grad_fn is not None
