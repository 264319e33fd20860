"""The reference against independent definitions, and the torch backend against the reference (float64)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import longattn
from longattn import reference as ref

F64 = torch.float64


def rand(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def qkv(b, n, m, hq, hk, d, seed=0, grad=False):
    return rand(b, n, hq, d, seed=seed, grad=grad), rand(b, m, hk, d, seed=seed + 1, grad=grad), \
        rand(b, m, hk, d, seed=seed + 2, grad=grad)


def naive_attention(q, k, v, allowed, scale):
    """A loop-per-query definition, independent of the reference's vectorised code."""
    b, n, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.zeros_like(q)
    for bb in range(b):
        for h in range(hq):
            for i in range(n):
                keys = allowed[i].nonzero().flatten()
                if len(keys) == 0:
                    continue
                s = torch.stack([q[bb, i, h] @ k[bb, j, h // group] * scale for j in keys])
                p = torch.softmax(s, 0)
                out[bb, i, h] = sum(p[t] * v[bb, j, h // group] for t, j in enumerate(keys))
    return out


@pytest.mark.parametrize("n,m,causal,window", [(7, 7, False, (-1, -1)), (5, 9, True, (-1, -1)),
                                               (9, 5, True, (-1, -1)), (8, 8, False, (2, 1))])
def test_flash_matches_per_query_loop(n, m, causal, window):
    q, k, v = qkv(2, n, m, 4, 2, 8)
    allowed = torch.zeros(n, m, dtype=torch.bool)
    left, right = window
    for i in range(n):
        pos = i + m - n
        for j in range(m):
            ok = (not causal or j <= pos) and (left < 0 or j >= pos - left) and (right < 0 or j <= pos + right)
            allowed[i, j] = ok
    want = naive_attention(q, k, v, allowed, 8 ** -0.5)
    torch.testing.assert_close(ref.flash_attention(q, k, v, causal=causal, window=window), want)


def test_gqa_equals_repeated_heads():
    q, k, v = qkv(1, 6, 7, 6, 2, 4)
    got = ref.flash_attention(q, k, v, causal=True)
    want = ref.flash_attention(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2), causal=True)
    torch.testing.assert_close(got, want)


def test_fully_masked_rows_zero_and_no_nan_gradients():
    q, k, v = qkv(1, 9, 4, 2, 2, 4, grad=True)
    out, lse = ref.flash_attention(q, k, v, causal=True, return_lse=True)  # rows 0..4 see no key
    assert (out[:, :5] == 0).all() and (lse[..., :5] == -math.inf).all() and torch.isfinite(lse[..., 5:]).all()
    (out.sum() + lse[..., 5:].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_one_full_branch_equals_flash():
    q, k, v = qkv(2, 11, 11, 4, 2, 8)
    for w in (11, 16):
        got = ref.dilated_attention(q, k, v, segment_lengths=[w], dilation_rates=[1], causal=True)
        torch.testing.assert_close(got, ref.flash_attention(q, k, v, causal=True))


def test_two_identical_branches_equal_one():
    q, k, v = qkv(1, 13, 13, 4, 4, 8)
    one = ref.dilated_attention(q, k, v, segment_lengths=[4], dilation_rates=[2])
    two = ref.dilated_attention(q, k, v, segment_lengths=[4, 4], dilation_rates=[2, 2])
    torch.testing.assert_close(one, two)


def test_head_split_one_branch_equals_default():
    q, k, v = qkv(1, 13, 13, 3, 3, 8)
    a = ref.dilated_attention(q, k, v, segment_lengths=[5], dilation_rates=[1], head_split=True)
    b = ref.dilated_attention(q, k, v, segment_lengths=[5], dilation_rates=[1])
    torch.testing.assert_close(a, b)


def test_dilated_branch_selection_by_hand():
    """N=10, w=4, r=2: head 0 (offset 0) takes positions 0,2 | 4,6 | 8; head 1 (offset 1) takes 1,3 | 5,7 | 9."""
    q, k, v = qkv(1, 10, 10, 2, 2, 4)
    out = ref.dilated_attention(q, k, v, segment_lengths=[4], dilation_rates=[2])
    groups = {0: [[0, 2], [4, 6], [8]], 1: [[1, 3], [5, 7], [9]]}
    for h, segs in groups.items():
        for seg in segs:
            for i in seg:
                s = torch.stack([q[0, i, h] @ k[0, j, h] for j in seg]) * 0.5
                want = (torch.softmax(s, 0)[:, None] * v[0, seg, h]).sum(0)
                torch.testing.assert_close(out[0, i, h], want)


def test_block_sparse_all_true_equals_flash():
    q, k, v = qkv(2, 10, 13, 2, 1, 4)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    got = ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=4, causal=True)
    torch.testing.assert_close(got, ref.flash_attention(q, k, v, causal=True))


def test_block_sparse_matches_loop():
    q, k, v = qkv(1, 10, 9, 2, 2, 4)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)[None, None]
    allowed = torch.zeros(10, 9, dtype=torch.bool)
    for i in range(10):
        for j in range(9):
            allowed[i, j] = mask[0, 0, i // 2, j // 3]
    want = naive_attention(q, k, v, allowed, 0.5)
    torch.testing.assert_close(ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=(2, 3)), want)


def test_gradcheck_all_three():
    q, k, v = qkv(1, 5, 6, 2, 1, 3, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ref.flash_attention(a, b, c, causal=True), (q, k, v))
    q, k, v = qkv(1, 7, 7, 2, 2, 3, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ref.dilated_attention(
        a, b, c, segment_lengths=[3, 7], dilation_rates=[1, 2], causal=True), (q, k, v))
    q, k, v = qkv(1, 5, 6, 2, 1, 3, grad=True)
    mask = torch.tensor([[[[True, False], [True, True]]]])
    assert torch.autograd.gradcheck(lambda a, b, c: ref.block_sparse_attention(
        a, b, c, block_mask=mask, block_size=3), (q, k, v))


shapes = st.tuples(st.integers(1, 2), st.integers(1, 23), st.integers(1, 23), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
                   st.integers(1, 9))


@settings(max_examples=25, deadline=None)
@given(shapes, st.booleans(), st.integers(-1, 6), st.integers(-1, 6))
def test_torch_backend_flash_matches_reference(shape, causal, left, right):
    b, n, m, (hq, hk), d = shape
    q, k, v = qkv(b, n, m, hq, hk, d)
    got, lse = longattn.flash_attention(q, k, v, causal=causal, window=(left, right), return_lse=True,
                                        backend="torch")
    want, rlse = ref.flash_attention(q, k, v, causal=causal, window=(left, right), return_lse=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, rlse)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(2, 2), (4, 2), (3, 1), (5, 5)]),
       st.lists(st.tuples(st.integers(1, 24), st.integers(1, 6)), min_size=1, max_size=3),
       st.booleans(), st.booleans())
def test_torch_backend_dilated_matches_reference(n, heads, branches, causal, head_split):
    hq, hk = heads
    q, k, v = qkv(1, n, n, hq, hk, 4)
    segs, rates = [w for w, _ in branches], [r for _, r in branches]
    kw = dict(segment_lengths=segs, dilation_rates=rates, causal=causal, head_split=head_split)
    got, lse = longattn.dilated_attention(q, k, v, return_lse=True, backend="torch", **kw)
    want, rlse = ref.dilated_attention(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, rlse)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.sampled_from([1, 2, 4, 5, (3, 2)]), st.booleans(),
       st.integers(0, 2 ** 16))
def test_torch_backend_block_sparse_matches_reference(n, m, block, causal, seed):
    bq, bk = (block, block) if isinstance(block, int) else block
    q, k, v = qkv(2, n, m, 2, 1, 4, seed=seed)
    mask = torch.rand(2, 1, -(-n // bq), -(-m // bk), generator=torch.Generator().manual_seed(seed)) < 0.5
    kw = dict(block_mask=mask, block_size=block, causal=causal)
    got = longattn.block_sparse_attention(q, k, v, backend="torch", **kw)
    torch.testing.assert_close(got, ref.block_sparse_attention(q, k, v, **kw))


def test_torch_backend_gradients_match_reference():
    q, k, v = qkv(1, 30, 30, 4, 2, 8, grad=True)
    kw = dict(segment_lengths=[8, 16], dilation_rates=[1, 4], causal=True)
    g1 = torch.autograd.grad(longattn.dilated_attention(q, k, v, backend="torch", **kw).square().sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.dilated_attention(q, k, v, **kw).square().sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_torch_backend_half_inputs_compute_in_float32():
    q, k, v = (x.half() for x in qkv(1, 40, 40, 2, 2, 16))
    out, lse = longattn.flash_attention(q, k, v, causal=True, return_lse=True, backend="torch")
    want = ref.flash_attention(q.double(), k.double(), v.double(), causal=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert (out.double() - want).abs().max() < 5e-3


def test_ops_backward_matches_autograd():
    from longattn import ops

    q, k, v = qkv(1, 12, 20, 4, 2, 8, grad=True)
    do = rand(1, 12, 4, 8, seed=7)
    out = ref.flash_attention(q, k, v, causal=True)
    want = torch.autograd.grad(out, (q, k, v), do)
    o, lse = ops.attention_forward(q.detach(), k.detach(), v.detach(), causal=True, backend="torch")
    got = ops.attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse, causal=True, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
