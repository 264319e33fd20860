"""The PyTorch backend (``backend="torch"``) and the explicit forward/backward of ``longattn.ops`` against the
reference, in float64: values, log-sum-exps and gradients, including the chunked paths."""
import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import longattn
from longattn import ops
from longattn import reference as ref
from longattn.backends.torch import chunked as tb
from longattn.call import dilated_branches

F64 = torch.float64


def rand(*shape, seed=0, grad=False, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype).requires_grad_(grad)


def qkv(b, n, m, hq, hk, d, seed=0, grad=False, dtype=F64):
    return (rand(b, n, hq, d, seed=seed, grad=grad, dtype=dtype), rand(b, m, hk, d, seed=seed + 1, grad=grad,
                                                                       dtype=dtype),
            rand(b, m, hk, d, seed=seed + 2, grad=grad, dtype=dtype))


def same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def grads(fn, q, k, v, seed=9):
    """Output, lse and the gradients of a random linear function of both."""
    out, lse = fn(q, k, v)
    g_out = rand(*out.shape, seed=seed)
    g_lse = rand(*lse.shape, seed=seed + 1)
    loss = (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * g_lse).sum()
    return (out, lse) + torch.autograd.grad(loss, (q, k, v))


def score_budget(budget):
    """The backend's score budget for a block (None: the default's)."""
    return longattn.routing(torch_score_budget=budget) if budget else contextlib.nullcontext()


@pytest.fixture
def tiny_chunks():
    """A score budget so small that every chunk is one query row of one batch entry."""
    with longattn.routing(torch_score_budget=7):
        yield


# ----------------------------------------------------------------------------- public API == reference


@settings(max_examples=25, deadline=None)
@given(st.tuples(st.integers(1, 2), st.integers(0, 23), st.integers(0, 23),
                 st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(1, 9)),
       st.booleans(), st.integers(-1, 6), st.integers(-1, 6), st.sampled_from([None, 7, 40]))
def test_flash_matches_reference(shape, causal, left, right, budget):
    b, n, m, (hq, hk), d = shape
    q, k, v = qkv(b, n, m, hq, hk, d, seed=n + 3 * m)
    kw = dict(causal=causal, window=(left, right), return_lse=True)
    with score_budget(budget):
        got = longattn.flash_attention(q, k, v, backend="torch", **kw)
    same(got, ref.flash_attention(q, k, v, **kw))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(2, 2), (4, 2), (3, 1), (5, 5), (6, 3), (6, 2)]),
       st.lists(st.tuples(st.integers(1, 24), st.integers(1, 6)), min_size=1, max_size=3),
       st.booleans(), st.booleans(), st.sampled_from([None, 5, 64]))
def test_dilated_matches_reference(n, heads, branches, causal, head_split, budget):
    hq, hk = heads
    head_split = head_split and len(branches) <= hq  # (more branches than heads: refused, tested elsewhere)
    q, k, v = qkv(2, n, n, hq, hk, 4, seed=n)
    segs, rates = [w for w, _ in branches], [r for _, r in branches]
    kw = dict(segment_lengths=segs, dilation_rates=rates, causal=causal, head_split=head_split, return_lse=True)
    with score_budget(budget):
        got = longattn.dilated_attention(q, k, v, backend="torch", **kw)
    same(got, ref.dilated_attention(q, k, v, **kw))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.sampled_from([1, 2, 4, 5, (3, 2), (2, 7)]), st.booleans(),
       st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]), st.integers(0, 2 ** 16), st.sampled_from([None, 9, 100]))
def test_block_sparse_matches_reference(n, m, block, causal, mask_bh, seed, budget):
    bq, bk = (block, block) if isinstance(block, int) else block
    q, k, v = qkv(2, n, m, 2, 1, 4, seed=seed)
    mask = torch.rand(*mask_bh, -(-n // bq), -(-m // bk), generator=torch.Generator().manual_seed(seed)) < 0.5
    kw = dict(block_mask=mask, block_size=block, causal=causal, return_lse=True)
    with score_budget(budget):
        got = longattn.block_sparse_attention(q, k, v, backend="torch", **kw)
    same(got, ref.block_sparse_attention(q, k, v, **kw))


# ------------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("chunked", [False, True])
def test_gradients_match_reference(chunked):
    with score_budget(50 if chunked else None):
        _gradients_match_reference()


def _gradients_match_reference():
    q, k, v = qkv(2, 19, 23, 4, 2, 5, grad=True)
    for kw in (dict(causal=True), dict(window=(3, 2)), dict(causal=True, window=(4, -1))):
        same(grads(lambda a, b, c: longattn.flash_attention(a, b, c, return_lse=True, backend="torch", **kw), q, k, v),
             grads(lambda a, b, c: ref.flash_attention(a, b, c, return_lse=True, **kw), q, k, v))
    mask = torch.rand(2, 1, 4, 3, generator=torch.Generator().manual_seed(0)) < 0.6
    kw = dict(block_mask=mask, block_size=(5, 8), causal=True, return_lse=True)
    same(grads(lambda a, b, c: longattn.block_sparse_attention(a, b, c, backend="torch", **kw), q, k, v),
         grads(lambda a, b, c: ref.block_sparse_attention(a, b, c, **kw), q, k, v))
    q, k, v = qkv(1, 30, 30, 6, 2, 4, grad=True)
    for kw in (dict(segment_lengths=[8, 16], dilation_rates=[1, 4], causal=True),
               dict(segment_lengths=[5, 7, 30], dilation_rates=[1, 2, 3], head_split=True)):
        same(grads(lambda a, b, c: longattn.dilated_attention(a, b, c, return_lse=True, backend="torch", **kw),
                   q, k, v),
             grads(lambda a, b, c: ref.dilated_attention(a, b, c, return_lse=True, **kw), q, k, v))


def test_gradcheck():
    q, k, v = qkv(1, 5, 6, 2, 1, 3, grad=True)  # every row sees a key: the lse has a finite gradient
    assert torch.autograd.gradcheck(lambda a, b, c: tb.flash_attention(a, b, c, causal=True, window=(2, -1),
                                                                       scale=0.7), (q, k, v))
    q, k, v = qkv(1, 7, 7, 2, 2, 2, grad=True)
    branches = dilated_branches(7, 2, [3, 7], [1, 2], head_split=False)
    assert torch.autograd.gradcheck(lambda a, b, c: tb.dilated_attention(a, b, c, branches=branches, causal=True,
                                                                         scale=0.5), (q, k, v))


def test_rows_without_keys_give_zero_and_finite_gradients(tiny_chunks):
    q, k, v = qkv(1, 9, 4, 2, 2, 4, grad=True)
    out, lse = longattn.flash_attention(q, k, v, causal=True, return_lse=True, backend="torch")
    assert (out[:, :5] == 0).all() and (lse[..., :5] == -math.inf).all()
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v)) and (q.grad[:, :5] == 0).all()
    mask = torch.zeros(1, 1, 3, 1, dtype=torch.bool)
    out, lse = longattn.block_sparse_attention(q, k, v, block_mask=mask, block_size=4, return_lse=True,
                                               backend="torch")
    assert (out == 0).all() and (lse == -math.inf).all()


def test_empty_sequences():
    q, k, v = qkv(2, 0, 5, 2, 1, 4)
    out, lse = longattn.flash_attention(q, k, v, return_lse=True, backend="torch")
    assert out.shape == q.shape and lse.shape == (2, 2, 0)
    q, k, v = qkv(2, 3, 0, 2, 1, 4)
    out, lse = longattn.flash_attention(q, k, v, return_lse=True, backend="torch")
    assert (out == 0).all() and (lse == -math.inf).all()


# ---------------------------------------------------------------------------------- chunking and precision


def test_chunks_respect_the_budget_and_cover_every_row():
    n, m, heads = 37, 41, 3
    keys = tb._band_keys(n, m, 5, 0)  # window (5, 0)
    seen = torch.zeros(2, n, dtype=torch.int64)
    with longattn.routing(torch_score_budget=200):
        chunks = list(tb._chunks(2, n, m, heads, keys))
    for bs, a, b, lo, hi in chunks:
        assert (bs.stop - bs.start) * heads * (b - a) * (hi - lo) <= 200
        assert (lo, hi) == keys(a, b)
        seen[bs, a:b] += 1
    assert (seen == 1).all()


def test_window_chunks_skip_far_keys():
    with longattn.routing(torch_score_budget=4 * 64):
        spans = [hi - lo for _, a, b, lo, hi in tb._chunks(1, 1000, 1000, 4, tb._band_keys(1000, 1000, 8, 8))]
    assert max(spans) <= 64 and len(spans) < 1000


def test_half_inputs_compute_in_float32():
    q, k, v = qkv(1, 40, 40, 2, 2, 16, dtype=torch.float16)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    out, lse = longattn.flash_attention(q, k, v, causal=True, return_lse=True, backend="torch")
    want, want_lse = ref.flash_attention(q64, k64, v64, causal=True, return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert (out.double() - want).abs().max() < 2e-3 and (lse.double() - want_lse).abs().max() < 1e-4
    kw = dict(segment_lengths=[8, 16], dilation_rates=[1, 2])
    out, lse = longattn.dilated_attention(q, k, v, return_lse=True, backend="torch", **kw)
    want = ref.dilated_attention(q64, k64, v64, **kw)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and (out.double() - want).abs().max() < 2e-3


# ------------------------------------------------------------------------- explicit forward and backward (ops)


def test_ops_backward_with_full_lse_equals_autograd():
    q, k, v = qkv(2, 12, 20, 4, 2, 8, grad=True)
    do = rand(2, 12, 4, 8, seed=7)
    for kw in (dict(causal=True), dict(window=(3, 4)), dict()):
        want = torch.autograd.grad(ref.flash_attention(q, k, v, **kw), (q, k, v), do)
        o, lse = ops.attention_forward(q.detach(), k.detach(), v.detach(), backend="torch", **kw)
        assert lse.dtype == torch.float32 or q.dtype == F64
        same(ops.attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse, backend="torch", **kw), want)


@pytest.mark.parametrize("causal", [False, True])
def test_ops_key_halves_merge_to_the_full_result(causal):
    """Ring attention's algebra: keys split in two, forwards merged by lse, each half's backward fed the merged
    (o, lse): the merged output is the full one and the two halves' gradients add up to the full gradients."""
    n, m, half = 10, 16, 9
    q, k, v = qkv(1, n, m, 4, 2, 6, grad=True)
    do = rand(1, n, 4, 6, seed=5)
    full = ref.flash_attention(q, k, v, causal=causal)
    dq, dk, dv = torch.autograd.grad(full, (q, k, v), do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    # causal over all m keys (j <= i + m - n) is, for the first half, the window (-1, m - half) of its own
    # alignment and, for the second half, its own causal mask (rows 0..2 see none of the second half)
    kw1 = dict(window=(-1, m - half)) if causal else {}
    o1, l1 = ops.attention_forward(qd, kd[:, :half], vd[:, :half], backend="torch", **kw1)
    o2, l2 = ops.attention_forward(qd, kd[:, half:], vd[:, half:], causal=causal, backend="torch")
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).transpose(1, 2)[..., None]
    w2 = torch.exp(l2 - lse).transpose(1, 2)[..., None]
    o = w1 * o1 + w2 * o2
    torch.testing.assert_close(o, full.detach())
    g1 = ops.attention_backward(do, qd, kd[:, :half], vd[:, :half], o, lse, backend="torch", **kw1)
    g2 = ops.attention_backward(do, qd, kd[:, half:], vd[:, half:], o, lse, causal=causal, backend="torch")
    torch.testing.assert_close(g1[0] + g2[0], dq)
    torch.testing.assert_close(torch.cat([g1[1], g2[1]], 1), dk)
    torch.testing.assert_close(torch.cat([g1[2], g2[2]], 1), dv)


def test_ops_backward_never_multiplies_overflowing_masked_scores():
    """A masked key whose score would overflow exp() must not turn the gradient into NaN."""
    q = torch.zeros(1, 2, 1, 4)
    k = torch.zeros(1, 2, 1, 4)
    q[0, 0, 0, 0] = 10.0
    k[0, 1, 0, 0] = 30.0  # query 0 may not see key 1 (causal) but q0 . k1 = 300: exp(300) overflows float32
    v = torch.randn(1, 2, 1, 4)
    do = torch.randn(1, 2, 1, 4)
    o, lse = ops.attention_forward(q, k, v, causal=True, scale=1.0, backend="torch")
    got = ops.attention_backward(do, q, k, v, o, lse, causal=True, scale=1.0, backend="torch")
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(ref.flash_attention(qq, kk, vv, causal=True, scale=1.0), (qq, kk, vv), do.double())
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_ops_backward_chunked(tiny_chunks):
    q, k, v = qkv(2, 7, 9, 2, 1, 3)
    do = rand(2, 7, 2, 3, seed=4)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(ref.flash_attention(qq, kk, vv, window=(2, 1)), (qq, kk, vv), do)
    o, lse = ops.attention_forward(q, k, v, window=(2, 1), backend="torch")
    same(ops.attention_backward(do, q, k, v, o, lse, window=(2, 1), backend="torch"), want)
