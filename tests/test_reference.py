"""The reference (the specification) against independent, loop-per-query definitions, in float64.

The definitions here are written from the semantics in the README, one query at a time, and share no
code with ``longattn.reference``.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longattn import reference as ref

F64 = torch.float64


def rand(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def qkv(b, n, m, hq, hk, d, seed=0, grad=False):
    return (rand(b, n, hq, d, seed=seed, grad=grad), rand(b, m, hk, d, seed=seed + 1, grad=grad),
            rand(b, m, hk, d, seed=seed + 2, grad=grad))


# ------------------------------------------------------------------------------------ independent definitions


def naive(q, k, v, keys_of, scale):
    """``keys_of(b, h, i)`` lists the key positions query ``i`` of head ``h`` attends to (repeats count twice).

    Returns out and lse, computed one query at a time; a query with no key gets 0 and -inf.
    """
    b, n, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((b, hq, n), -math.inf, dtype=q.dtype)
    for bb in range(b):
        for h in range(hq):
            for i in range(n):
                keys = keys_of(bb, h, i)
                if not keys:
                    continue
                s = torch.stack([q[bb, i, h] @ k[bb, j, h // group] for j in keys]) * scale
                lse[bb, h, i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[bb, i, h] = sum(p[t] * v[bb, j, h // group] for t, j in enumerate(keys))
    return out, lse


def flash_keys(n, m, causal, window):
    left, right = window

    def keys_of(b, h, i):
        pos = i + m - n  # bottom-right alignment
        return [j for j in range(m) if (not causal or j <= pos) and (left < 0 or j >= pos - left)
                and (right < 0 or j <= pos + right)]

    return keys_of


def dilated_keys(n, hq, segs, rates, causal, head_split):
    """LongNet by the letter: per branch, the query's segment, the positions of its head's offset; all branches'
    key lists concatenated (softmax over the concatenation == softmax-denominator merge of the branches)."""
    k_br = len(segs)
    if head_split:
        sizes = [hq // k_br + (i < hq % k_br) for i in range(k_br)]
        group_of = [g for g, size in enumerate(sizes) for _ in range(size)]

    def keys_of(b, h, i):
        keys = []
        for br, (w, r) in enumerate(zip(segs, rates)):
            if head_split and group_of[h] != br:
                continue
            o = br % r if head_split else h % r
            s = (i // w) * w
            sel = [p for p in range(s, min(s + w, n)) if p - s >= o and (p - s - o) % r == 0]
            if i in sel:
                keys += [j for j in sel if not causal or j <= i]
        return keys

    return keys_of


def block_keys(n, m, mask, bq, bk, causal):
    def keys_of(b, h, i):
        blk = mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0]
        return [j for j in range(m) if blk[i // bq, j // bk] and (not causal or j <= i + m - n)]

    return keys_of


def check(got, want):
    out, lse = got
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(lse, want[1])


# ------------------------------------------------------------------------------------------ flash_attention


@pytest.mark.parametrize("n,m,causal,window", [(7, 7, False, (-1, -1)), (5, 9, True, (-1, -1)),
                                               (9, 5, True, (-1, -1)), (8, 8, False, (2, 1)),
                                               (6, 10, True, (3, -1)), (10, 6, False, (0, 0))])
def test_flash_matches_definition(n, m, causal, window):
    q, k, v = qkv(2, n, m, 4, 2, 5)
    got = ref.flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    check(got, naive(q, k, v, flash_keys(n, m, causal, window), 5 ** -0.5))


def test_flash_mask_is_bottom_right_aligned():
    mask = ref.flash_mask(2, 4, causal=True)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert ref.flash_mask(3, 3, window=(1, 0)).tolist() == [[True, False, False], [True, True, False],
                                                             [False, True, True]]


def test_scale_argument():
    q, k, v = qkv(1, 4, 6, 2, 2, 8)
    check(ref.flash_attention(q, k, v, scale=0.3, return_lse=True), naive(q, k, v, flash_keys(4, 6, False, (-1, -1)),
                                                                          0.3))


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
    assert (q.grad[:, :5] == 0).all()


# ---------------------------------------------------------------------------------------- dilated_attention


def test_one_full_branch_equals_flash():
    q, k, v = qkv(2, 11, 11, 4, 2, 8)
    for w in (11, 16):
        for causal in (False, True):
            got = ref.dilated_attention(q, k, v, segment_lengths=[w], dilation_rates=[1], causal=causal,
                                        return_lse=True)
            check(got, ref.flash_attention(q, k, v, causal=causal, return_lse=True))


def test_two_identical_branches_equal_one():
    q, k, v = qkv(1, 13, 13, 4, 4, 8)
    one, lse1 = ref.dilated_attention(q, k, v, segment_lengths=[4], dilation_rates=[2], return_lse=True)
    two, lse2 = ref.dilated_attention(q, k, v, segment_lengths=[4, 4], dilation_rates=[2, 2], return_lse=True)
    torch.testing.assert_close(one, two)
    torch.testing.assert_close(lse2, lse1 + math.log(2))  # the same keys counted twice


def test_head_split_one_branch_equals_default():
    q, k, v = qkv(1, 13, 13, 3, 3, 8)
    for r in (1, 2):
        a = ref.dilated_attention(q, k, v, segment_lengths=[5], dilation_rates=[r], head_split=True)
        b = ref.dilated_attention(q, k, v, segment_lengths=[5], dilation_rates=[r])
        if r == 1:
            torch.testing.assert_close(a, b)
        else:  # head_split: every head of the single group uses offset 0 % r = 0; default: offset h % r
            torch.testing.assert_close(a[:, :, 0], b[:, :, 0])
            torch.testing.assert_close(a[:, :, 2], b[:, :, 2])
            assert not torch.allclose(a[:, :, 1], b[:, :, 1])


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


@pytest.mark.parametrize("segs,rates,causal,head_split,hq,hk", [
    ([4, 8], [1, 2], False, False, 4, 2),
    ([3, 7], [1, 3], True, False, 3, 1),
    ([2, 5, 9], [1, 2, 4], True, True, 5, 5),
    ([6], [2], False, True, 2, 1),
])
def test_dilated_matches_definition(segs, rates, causal, head_split, hq, hk):
    n = 11
    q, k, v = qkv(2, n, n, hq, hk, 3)
    kw = dict(segment_lengths=segs, dilation_rates=rates, causal=causal, head_split=head_split)
    check(ref.dilated_attention(q, k, v, return_lse=True, **kw),
          naive(q, k, v, dilated_keys(n, hq, segs, rates, causal, head_split), 3 ** -0.5))


def test_dilated_unselected_queries_output_zero_without_nan_gradients():
    # w=2, r=4: heads with offset 2 or 3 select nothing in their segments of 2 positions
    q, k, v = qkv(1, 7, 7, 4, 4, 3, grad=True)
    out, lse = ref.dilated_attention(q, k, v, segment_lengths=[2], dilation_rates=[4], return_lse=True)
    assert (out[:, :, 2:] == 0).all() and (lse[:, 2:] == -math.inf).all()
    # position p is offset p % 2 of its segment: head 0 takes the even positions, head 1 the odd ones
    assert (out[:, 1::2, 0] == 0).all() and (out[:, 0::2, 1] == 0).all()
    assert (out[:, 0::2, 0] != 0).all() and (out[:, 1::2, 1] != 0).all()
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# --------------------------------------------------------------------------------- block_sparse_attention


def test_block_sparse_all_true_equals_flash():
    q, k, v = qkv(2, 10, 13, 2, 1, 4)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    for causal in (False, True):
        got = ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=4, causal=causal, return_lse=True)
        check(got, ref.flash_attention(q, k, v, causal=causal, return_lse=True))


@pytest.mark.parametrize("mask_b,mask_h,causal", [(1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True)])
def test_block_sparse_matches_definition(mask_b, mask_h, causal):
    q, k, v = qkv(2, 10, 9, 2, 1, 4)
    mask = torch.rand(mask_b, mask_h, 5, 3, generator=torch.Generator().manual_seed(3)) < 0.5
    mask[..., 3, :] = False  # query rows 6, 7 see nothing
    got = ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=(2, 3), causal=causal, return_lse=True)
    check(got, naive(q, k, v, block_keys(10, 9, mask, 2, 3, causal), 0.5))
    assert (got[0][:, 6:8] == 0).all()


# ----------------------------------------------------------------------------------------------- gradients


def test_gradcheck_all_three():
    q, k, v = qkv(1, 5, 6, 2, 1, 3, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ref.flash_attention(a, b, c, causal=True), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ref.flash_attention(a, b, c, window=(1, 2), return_lse=True),
                                    (q, k, v))
    q, k, v = qkv(1, 7, 7, 2, 2, 3, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ref.dilated_attention(
        a, b, c, segment_lengths=[3, 7], dilation_rates=[1, 2], causal=True, return_lse=True), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ref.dilated_attention(
        a, b, c, segment_lengths=[2, 4], dilation_rates=[1, 2], head_split=True), (q, k, v))
    q, k, v = qkv(1, 5, 6, 2, 1, 3, grad=True)
    mask = torch.tensor([[[[True, False], [False, True]]]])
    assert torch.autograd.gradcheck(lambda a, b, c: ref.block_sparse_attention(
        a, b, c, block_mask=mask, block_size=3, causal=True), (q, k, v))


# ---------------------------------------------------------------------------------- property tests (hypothesis)

heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(0, 8), st.integers(0, 8), heads, st.integers(1, 4), st.booleans(),
       st.integers(-1, 4), st.integers(-1, 4))
def test_property_flash(b, n, m, hh, d, causal, left, right):
    q, k, v = qkv(b, n, m, *hh, d, seed=n * 31 + m)
    got = ref.flash_attention(q, k, v, causal=causal, window=(left, right), return_lse=True)
    check(got, naive(q, k, v, flash_keys(n, m, causal, (left, right)), d ** -0.5))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), heads, st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=3),
       st.booleans(), st.booleans())
def test_property_dilated(n, hh, branches, causal, head_split):
    q, k, v = qkv(1, n, n, *hh, 2, seed=n)
    segs, rates = [w for w, _ in branches], [r for _, r in branches]
    got = ref.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, causal=causal,
                                head_split=head_split, return_lse=True)
    check(got, naive(q, k, v, dilated_keys(n, hh[0], segs, rates, causal, head_split), 2 ** -0.5))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 4), st.integers(1, 4), st.booleans(),
       st.integers(0, 1000))
def test_property_block_sparse(n, m, bq, bk, causal, seed):
    q, k, v = qkv(1, n, m, 2, 1, 2, seed=seed)
    mask = torch.rand(1, 2, -(-n // bq), -(-m // bk), generator=torch.Generator().manual_seed(seed)) < 0.6
    got = ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=(bq, bk), causal=causal, return_lse=True)
    check(got, naive(q, k, v, block_keys(n, m, mask, bq, bk, causal), 2 ** -0.5))
