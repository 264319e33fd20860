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


def _poisoned_lse(lse):
    """Where a row's log-sum-exp must say "this row is NaN": NaN, or +inf from +inf scores; never -inf (which
    means "no key": a merge by log-sum-exp would then drop the row) nor a finite value."""
    return torch.isnan(lse) | torch.isposinf(lse)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_sum_exp_of_a_row_with_a_non_finite_score_is_not_minus_inf(value, backend):
    """The rows that see a NaN (or +inf) score return a NaN (or +inf) log-sum-exp on every entry point, also after
    a merge of dilated branches; the other rows keep theirs, and rows without keys keep -inf."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 12, 4, 8, generator=gen) for _ in range(3))
    q = q.abs() + 0.1  # (a +inf in k then gives +inf scores)
    k[0, 9, 0, 0] = value  # seen by queries 9.. of head 0 (causal)
    want_out, want = R.flash_attention(q.double(), k.double(), v.double(), causal=True, return_lse=True)
    out, lse = longattn.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert torch.equal(_poisoned_lse(lse), _poisoned_lse(want)) and _poisoned_lse(lse[0, 0, 9:]).all()
    assert torch.equal(torch.isnan(out), torch.isnan(want_out))
    for cu in ([0, 12], [0, 5, 5, 12]):  # packed: the poisoned key in the last document, an empty one before it
        cu_t = torch.tensor(cu, dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, causal=True, return_lse=True)
        want = R.flash_attention_varlen(q[0].double(), k[0].double(), v[0].double(), **kw)[1]
        lse = longattn.flash_attention_varlen(q[0], k[0], v[0], backend=backend, **kw)[1]
        assert torch.equal(_poisoned_lse(lse), _poisoned_lse(want)) and torch.equal(lse.isneginf(), want.isneginf())
    kw = dict(segment_lengths=(4, 12), dilation_rates=(1, 1), causal=True, return_lse=True)  # a merge of branches
    want = R.dilated_attention(q.double(), k.double(), v.double(), **kw)[1]
    lse = longattn.dilated_attention(q, k, v, backend=backend, **kw)[1]
    assert torch.equal(_poisoned_lse(lse), _poisoned_lse(want)) and _poisoned_lse(lse[0, 0, 9:]).all()
    kc, vc = k[:, :10].expand(2, 10, 4, 8).contiguous(), v[:, :10].expand(2, 10, 4, 8).contiguous()
    lens = torch.tensor([10, 9], dtype=torch.int32)  # the second sequence does not reach the poisoned key
    want = R.flash_attention_with_kvcache(q[:, :2].double().expand(2, 2, 4, 8), kc.double(), vc.double(),
                                          cache_seqlens=lens, return_lse=True)[1]
    lse = longattn.flash_attention_with_kvcache(q[:, :2].expand(2, 2, 4, 8), kc, vc, cache_seqlens=lens,
                                                return_lse=True, backend=backend)[1]
    assert torch.equal(_poisoned_lse(lse), _poisoned_lse(want)) and _poisoned_lse(lse[0, 0, 1]).all()


def test_merge_partial_keeps_a_nan_log_sum_exp():
    from longattn.call import merge_partial

    out = torch.ones(1, 3, 1, 2)
    lse_a = torch.tensor([[[float("nan")], [0.0], [float("-inf")]]])
    lse_b = torch.tensor([[[1.0], [float("nan")], [float("-inf")]]])
    merged, lse = merge_partial(out, lse_a, out, lse_b)
    assert torch.isnan(lse[0, :2]).all() and torch.isneginf(lse[0, 2]).all()
    assert torch.isnan(merged[0, :2]).all() and (merged[0, 2] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_nan_key_gives_nan_gradients_to_every_key_its_rows_see(backend):
    """A NaN key makes the rows that see it NaN, and so the gradients of every key those rows see (the reference's
    IEEE answer): before, their log-sum-exp of -inf made the backward treat them as rows without keys."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 6, 2, 16, generator=gen) for _ in range(3))
    k[0, 5, 0, 3] = float("nan")  # seen by query 5 only (causal), which sees every key of head 0
    grad = torch.randn(1, 6, 2, 16, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad((longattn.flash_attention(*leaves, causal=True, backend=backend) * grad).sum(), leaves)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((R.flash_attention(*ref, causal=True) * grad.double()).sum(), ref)
    for g, w in zip(got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w))
    assert torch.isnan(got[1][0, :, 0]).all() and torch.isnan(got[2][0, :, 0]).all()
    assert torch.isfinite(got[1][0, :, 1]).all() and torch.isfinite(got[2][0, :, 1]).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_poisoned_branch_keeps_the_merged_log_sum_exp_non_finite(value, backend):
    """Dilated attention (forward and decode) where one branch sees the NaN (or +inf) key and the other branch does
    not: the merged log-sum-exp is NaN (or +inf), not the other branch's finite value."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=gen) for _ in range(3))
    q = q.abs() + 0.1
    k[0, 5, 0, 3] = value  # query 6 of head 0: key 5 in its first branch's segment [4, 8), not in its second branch
    kw = dict(segment_lengths=[4, 12], dilation_rates=[1, 2], causal=True, return_lse=True)
    want = R.dilated_attention(q.double(), k.double(), v.double(), **kw)[1]
    lse = longattn.dilated_attention(q, k, v, backend=backend, **kw)[1]
    assert torch.equal(_poisoned_lse(lse), _poisoned_lse(want)) and _poisoned_lse(lse[0, 0, 6])
    kw = dict(segment_lengths=[4, 12], dilation_rates=[1, 2], return_lse=True)
    with torch.no_grad():  # queries 6, 7 appended after 6 cached rows
        lse = longattn.dilated_attention_with_kvcache(q[:, 6:8], k[:, :8].clone(), v[:, :8].clone(), k[:, 6:8],
                                                      v[:, 6:8], cache_seqlens=6, backend=backend, **kw)[1]
    want = R.dilated_attention_with_kvcache(q[:, 6:8].double(), k[:, :6].double(), v[:, :6].double(),
                                            k[:, 6:8].double(), v[:, 6:8].double(), cache_seqlens=6, **kw)[1]
    assert torch.equal(_poisoned_lse(lse), _poisoned_lse(want)) and _poisoned_lse(lse[0, 0, 0])
    assert torch.equal(lse.isneginf(), want.isneginf())


@pytest.mark.parametrize("causal", [False, True])
def test_keys_of_minus_inf_score_in_an_unmasked_block_have_weight_zero(causal):
    """A score of -inf is a key of weight 0 (the reference): the Triton forward's unmasked key blocks subtracted a
    row maximum of -inf from -inf scores, so a row whose first key block scored -inf throughout came out NaN (every
    row here), and its log-sum-exp NaN where it has no key."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 128, 2, 16, generator=gen) for _ in range(3))
    q = q.abs() + 0.1
    k[0, :64, :, 0] = float("-inf")  # scores -inf in the first key blocks, for every query
    for keys in (k, k[:, :16]):  # the second: every key -inf, a row without keys (output 0, lse -inf)
        want_out, want = R.flash_attention(q.double(), keys.double(), v[:, :keys.shape[1]].double(), causal=causal,
                                           return_lse=True)
        out, lse = longattn.flash_attention(q, keys, v[:, :keys.shape[1]], causal=causal, return_lse=True,
                                            backend="triton")
        _same(out, want_out)
        assert torch.equal(lse.isneginf(), want.isneginf()) and not lse.isnan().any()
