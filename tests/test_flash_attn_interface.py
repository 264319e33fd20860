"""``longattn.flash_attn_interface``: FlashAttention 2's signatures (checked against the list below, copied from
flash-attn's source), each function against longattn's own function and against :mod:`longattn.reference` in
float64 on awkward shapes, FA2's own readings of ``window_size`` and of the lse of queries without keys (read in
FA2's ``csrc/flash_attn/flash_api.cpp`` and ``flash_fwd_kernel.h``), and the refusals."""
import importlib
import inspect
import math

import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                           flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                           flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

# flash-attn v2.8.3.post1 (commit a8aa52b1ab3e9ca574c8a33b3f35afc017ffa2e2, the current FA2 release),
# flash_attn/flash_attn_interface.py: every parameter positional-or-keyword, in this order, with these defaults.
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQ = inspect.Parameter.empty
FA2_SIGNATURES = {
    flash_attn_func: [("q", _REQ), ("k", _REQ), ("v", _REQ), *_COMMON],
    flash_attn_qkvpacked_func: [("qkv", _REQ), *_COMMON],
    flash_attn_kvpacked_func: [("q", _REQ), ("kv", _REQ), *_COMMON],
    flash_attn_varlen_func: [("q", _REQ), ("k", _REQ), ("v", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                             ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ), *_COMMON, ("block_table", None)],
    flash_attn_varlen_qkvpacked_func: [("qkv", _REQ), ("cu_seqlens", _REQ), ("max_seqlen", _REQ), *_COMMON],
    flash_attn_varlen_kvpacked_func: [("q", _REQ), ("kv", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                                      ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ), *_COMMON],
    flash_attn_with_kvcache: [("q", _REQ), ("k_cache", _REQ), ("v_cache", _REQ), ("k", None), ("v", None),
                              ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                              ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                              ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
                              ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
                              ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("fn", list(FA2_SIGNATURES), ids=lambda f: f.__name__)
def test_signature_is_fa2s(fn):
    params = inspect.signature(fn).parameters.values()
    assert [(p.name, p.default) for p in params] == FA2_SIGNATURES[fn]
    assert {p.kind for p in params} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}


def test_a_submodule_whose_functions_stay_off_the_top_level():
    assert "flash_attn_interface" in longattn.__all__
    assert longattn.flash_attn_interface is importlib.import_module("longattn.flash_attn_interface")
    assert not any(hasattr(longattn, name) for name in longattn.flash_attn_interface.__all__)


def _fa_lse(lse):
    """FA2's lse: ``+inf`` for a query that sees no key (longattn's functions and the reference give ``-inf``)."""
    return lse.masked_fill(torch.isneginf(lse), math.inf)


def _fa2_lse(lse, kw, offset, seq=None):
    """FA2's lse of a call with keywords ``kw``: ``+inf`` for a query without keys, and with ALiBi under a causal
    mask larger by ``slope * (i + M - N)`` (``offset``; ``seq``: each packed query's sequence), see
    :func:`test_alibi_lse_under_fa2s_causal_mask`. (No case here has another window that FA2 reads as causal.)"""
    lse = _fa_lse(lse)
    slopes = kw.get("alibi_slopes")
    if slopes is None or not kw.get("causal"):
        return lse
    return lse + (slopes.double()[seq].T if seq is not None else slopes.double()[..., None]) * offset


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _dense(b, n, m, hq, hk, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, hq, d, generator=g, dtype=torch.float64),
            *(torch.randn(b, m, hk, d, generator=g, dtype=torch.float64) for _ in range(2)))


DENSE_CASES = [  # (N, M, Hq, Hk, FA keywords); every window here reads as FA2's docstring says (none is a corner)
    (5, 9, 6, 2, {}),
    (5, 9, 6, 2, {"causal": True}),
    (9, 5, 6, 3, {"causal": True}),  # N > M: the first queries see no key (out 0, lse +inf)
    (7, 7, 4, 1, {"window_size": (2, 1)}),
    (5, 9, 4, 2, {"window_size": (3, -1), "causal": True, "softmax_scale": 0.3}),
    (6, 11, 4, 2, {"window_size": (-1, 2), "softcap": 5.0}),
    (4, 9, 4, 2, {"alibi_slopes": "heads", "causal": True}),
    (8, 6, 4, 4, {"alibi_slopes": "batch", "window_size": (2, 0), "softcap": 3.0}),
]


def _slopes(kw, b, hq):
    kw = dict(kw)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.linspace(0.1, 0.8, hq)
    elif kw.get("alibi_slopes") == "batch":
        kw["alibi_slopes"] = torch.linspace(0.05, 1.0, b * hq).view(b, hq)
    return kw


def _longattn_kw(kw):
    names = {"window_size": "window", "softmax_scale": "scale"}
    return {names.get(name, name): x for name, x in kw.items()}


@pytest.mark.parametrize("n,m,hq,hk,kw", DENSE_CASES)
def test_flash_attn_func(n, m, hq, hk, kw):
    q, k, v = _dense(2, n, m, hq, hk)
    kw = _slopes(kw, 2, hq)
    out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    own, own_lse = longattn.flash_attention(q, k, v, return_lse=True, **_longattn_kw(kw))
    want, want_lse = ref.flash_attention(q, k, v, return_lse=True, **_longattn_kw(kw))
    assert torch.equal(out, own) and torch.equal(lse, _fa2_lse(own_lse, kw, torch.arange(n) + m - n))
    _close(out, want)
    _close(lse, _fa2_lse(want_lse, kw, torch.arange(n) + m - n))
    assert lse.shape == (2, hq, n) and s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    _close(flash_attn_func(q, k, v, 0.0, *[kw.get(name, x) for name, x in _COMMON[1:-1]]), out)  # (positional)
    if n > m and kw.get("causal"):
        assert (out[:, :n - m] == 0).all() and (lse[..., :n - m] == math.inf).all()


def test_packed_functions_are_views_of_the_unpacked_ones():
    q, k, v = _dense(2, 6, 6, 4, 4)
    qkv = torch.stack([q, k, v], 2).requires_grad_()
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(3, 0))
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    want = flash_attn_func(q2, k2, v2, causal=True, window_size=(3, 0))
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    assert torch.equal(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], 2))
    q, k, v = _dense(2, 5, 8, 6, 2)
    got = flash_attn_kvpacked_func(q, torch.stack([k, v], 2), softcap=4.0, return_attn_probs=True)
    want = flash_attn_func(q, k, v, softcap=4.0, return_attn_probs=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# (cu_seqlens_q, cu_seqlens_k): sequence 1 is empty (no queries, no keys), sequence 2 has queries but no keys
CU_Q, CU_K = [0, 3, 3, 5, 10], [0, 4, 4, 4, 10]
_CU_SEQ = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3, 3])  # (each packed query's sequence, and its i + M - N)
_CU_OFFSET = torch.tensor([1, 2, 3, -2, -1, 1, 2, 3, 4, 5])


def _varlen(hq, hk, d=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(CU_Q[-1], hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(CU_K[-1], hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.tensor(CU_Q, dtype=torch.int32), torch.tensor(CU_K, dtype=torch.int32)


VARLEN_CASES = [{}, {"causal": True}, {"window_size": (2, 1)}, {"window_size": (1, 0), "softcap": 2.0},
                {"causal": True, "alibi_slopes": "batch"}, {"alibi_slopes": "heads", "softmax_scale": 0.5}]


@pytest.mark.parametrize("kw", VARLEN_CASES)
def test_flash_attn_varlen_func(kw):
    q, k, v, cu_q, cu_k = _varlen(6, 2)
    kw = _slopes(kw, len(CU_Q) - 1, 6)
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, return_attn_probs=True, **kw)
    lkw = _longattn_kw(kw)
    own, own_lse = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True,
                                                   **lkw)
    want, want_lse = ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **lkw)
    assert torch.equal(out, own) and torch.equal(lse, _fa2_lse(own_lse, kw, _CU_OFFSET, _CU_SEQ))
    _close(out, want)
    _close(lse, _fa2_lse(want_lse, kw, _CU_OFFSET, _CU_SEQ))
    assert lse.shape == (6, CU_Q[-1]) and s_dmask.shape == (0,)  # FA2 >= 2.6's unpadded (nheads, total_q)
    assert (out[3:5] == 0).all() and (lse[:, 3:5] == math.inf).all()  # (the sequence without keys)


def test_varlen_packed_functions():
    q, k, v, cu_q, cu_k = _varlen(4, 2)
    got = flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, 5, 6, causal=True,
                                          return_attn_probs=True)
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q, k, v, cu, _ = _varlen(4, 4)
    k, v = k[:10], v[:10]
    got = flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, 5, window_size=(1, 1))
    _close(got, ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, window=(1, 1)))


def test_window_corners_read_as_fa2_reads_them():
    """flash_api.cpp: a side >= the key length is unbounded (-1), causal sets the right side to 0, and with the left
    side bounded an unbounded right side is the key length: with more queries than keys, not unbounded."""
    q, k, v = _dense(1, 6, 2, 2, 2)
    out, lse, _ = flash_attn_func(q, k, v, window_size=(0, -1), return_attn_probs=True)  # right becomes 2
    assert (out[:, :2] == 0).all() and (lse[..., :2] == math.inf).all()  # query i sees keys i - 4 .. i - 2
    _close(out, ref.flash_attention(q, k, v, window=(0, 2)))
    out = flash_attn_func(q, k, v, window_size=(-1, 3))  # right 3 >= 2 keys: unbounded, every query sees both
    _close(out, ref.flash_attention(q, k, v))
    _close(flash_attn_func(q, k, v, window_size=(-7, -2)), out)  # (any negative side is unbounded)
    _close(flash_attn_func(q, k, v, softcap=-1.0), out)  # (softcap <= 0 is off)
    # varlen: the key length is max_seqlen_k as given (a larger hint than the longest sequence changes the reading)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 2], dtype=torch.int32)
    got = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 6, 2, window_size=(-1, 2))
    _close(got, out[0])
    got = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 6, 3, window_size=(-1, 2))
    _close(got, ref.flash_attention(q, k, v, window=(-1, 2))[0])


def _cache(b=3, cap=12, nq=2, hq=4, hk=2, d=16, page=None, seed=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, nq, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    if page is None:
        kc, vc = (torch.randn(b, cap, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
        return q, k, v, kc, vc, None
    pages = cap // page
    kc, vc = (torch.randn(b * pages + 1, page, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.randperm(b * pages + 1, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    return q, k, v, kc, vc, table


KV_CASES = [  # (cache_seqlens, append k and v, FA keywords)
    (torch.tensor([0, 5, 10], dtype=torch.int32), True, {}),
    (torch.tensor([0, 5, 10], dtype=torch.int32), True, {"causal": True, "window_size": (3, 0)}),
    (7, True, {"causal": True, "softcap": 4.0}),
    (7, False, {"alibi_slopes": "heads", "softmax_scale": 0.4}),
    (torch.tensor([3, 0, 12], dtype=torch.int32), False, {"causal": True, "alibi_slopes": "batch"}),
    (None, False, {}),
    (None, False, {"causal": True, "window_size": (4, -1)}),
]


@pytest.mark.parametrize("page", [None, 4])
@pytest.mark.parametrize("seqlens,append,kw", KV_CASES)
def test_flash_attn_with_kvcache(page, seqlens, append, kw):
    q, k, v, kc, vc, table = _cache(page=page)
    kw = _slopes(kw, 3, 4)
    lkw = {"causal": False, **_longattn_kw(kw)}  # (FA2's default; longattn's own function defaults to True)
    new = (k, v) if append else ()
    lens = 12 if seqlens is None else seqlens  # (None: the whole cache)
    want, want_lse = ref.flash_attention_with_kvcache(q, kc, vc, *new, cache_seqlens=lens, block_table=table,
                                                      return_lse=True, **lkw)
    kc2, vc2 = kc.clone(), vc.clone()
    own, own_lse = longattn.flash_attention_with_kvcache(q, kc2, vc2, *new, cache_seqlens=lens, block_table=table,
                                                         return_lse=True, **lkw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=seqlens, block_table=table,
                                       return_softmax_lse=True, **kw)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # (k, v appended in place, as longattn's function does)
    offset = (torch.as_tensor(lens).view(-1, 1, 1) + torch.arange(2) + (2 if append else 0) - 2).double()
    assert torch.equal(out, own) and torch.equal(lse, _fa2_lse(own_lse, kw, offset))
    _close(out, want)
    _close(lse, _fa2_lse(want_lse, kw, offset))
    assert lse.shape == (3, 4, 2)


def test_kvcache_defaults_and_no_keys():
    q, k, v, kc, vc, _ = _cache()
    lens = torch.tensor([0, 5, 10], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=lens)  # causal=False by default
    _close(out, ref.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=False))
    assert not torch.allclose(out, ref.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens))
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=0, return_softmax_lse=True)
    assert (out == 0).all() and (lse == math.inf).all()  # (no key: out 0, lse +inf, as FA2)
    out = flash_attn_with_kvcache(q.requires_grad_(), kc, vc, cache_seqlens=lens)  # (no graph, as FA2: no error)
    assert not out.requires_grad


def test_refusals_name_the_argument():
    q, k, v = _dense(1, 4, 4, 2, 2)
    qv, kv_, vv, cu_q, cu_k = _varlen(2, 2)
    cases = [
        (lambda: flash_attn_func(q, k, v, dropout_p=0.1), "dropout_p"),
        (lambda: flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), 0.1), "dropout_p"),
        (lambda: flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 5, 6, dropout_p=0.5), "dropout_p"),
        (lambda: flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 5, 6, block_table=cu_q[None]), "block_table"),
    ]
    qc, kn, vn, kc, vc, _ = _cache()
    lens = torch.tensor([0, 5, 10], dtype=torch.int32)
    cos = torch.ones(12, 8, dtype=torch.float64)
    for name, x in (("rotary_cos", cos), ("rotary_sin", cos), ("cache_batch_idx", lens), ("cache_leftpad", lens)):
        cases.append((lambda name=name, x=x: flash_attn_with_kvcache(qc, kc, vc, kn, vn, cache_seqlens=lens,
                                                                     **{name: x}), name))
    cases.append((lambda: flash_attn_with_kvcache(qc, kc, vc, kn, vn), "cache_seqlens"))
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()


def _fa2_alibi_causal_lse(lse, slopes, offset):
    """FA2's lse under a causal mask with ALiBi (mask.h adds ``slope * j``, not ``-slope * (i + M - N - j)``, when
    the mask is causal): longattn's lse plus ``slope * (i + M - N)``, ``offset`` being ``i + M - N``."""
    return _fa_lse(lse) + slopes.double()[..., None] * offset


@pytest.mark.parametrize("kw", [{"causal": True}, {"window_size": (-1, 0)}, {"causal": True, "window_size": (13, 3)},
                                {"causal": True, "softcap": 2.0}])
def test_alibi_lse_under_fa2s_causal_mask(kw):
    """mask.h: with ALiBi under a causal mask FA2 adds ``slope * j`` to the scores (the same softmax as the
    documented ``-slope * |i + M - N - j|``, but an lse larger by ``slope * (i + M - N)``); a window, however
    close to causal, uses the documented bias, and the outputs agree either way."""
    q, k, v = _dense(2, 4, 7, 4, 2)
    rkw = {"causal": True, "softcap": kw.get("softcap", 0.0)}  # (what the reference needs of kw)
    slopes = torch.linspace(0.1, 0.8, 4)
    out, lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)
    want, want_lse = ref.flash_attention(q, k, v, alibi_slopes=slopes, return_lse=True, **rkw)
    _close(out, want)
    _close(lse, _fa2_alibi_causal_lse(want_lse, slopes, torch.arange(4) + 3))
    local = flash_attn_func(q, k, v, alibi_slopes=slopes, window_size=(2, 0), return_attn_probs=True)[1]
    _close(local, ref.flash_attention(q, k, v, alibi_slopes=slopes, window=(2, 0), return_lse=True)[1])
    qv, kv_, vv, cu_q, cu_k = _varlen(4, 2)
    slopes = torch.linspace(0.05, 1.0, 16).view(4, 4)
    _, lse, _ = flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 5, 6, alibi_slopes=slopes, return_attn_probs=True,
                                       **kw)
    want_lse = ref.flash_attention_varlen(qv, kv_, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **rkw,
                                          alibi_slopes=slopes, return_lse=True)[1]
    _close(lse, _fa_lse(want_lse) + slopes.double()[_CU_SEQ].T * _CU_OFFSET)
    q, kn, vn, kc, vc, _ = _cache()
    lens = torch.tensor([0, 5, 10], dtype=torch.int32)
    slopes = torch.linspace(0.2, 0.5, 4)
    _, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, alibi_slopes=slopes,
                                     return_softmax_lse=True, **kw)
    want_lse = ref.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, **rkw,
                                                alibi_slopes=slopes, return_lse=True)[1]
    offset = (lens[:, None, None] + torch.arange(2)).double()  # (M_b = lens_b + 2 new keys, N = 2)
    _close(lse, _fa_lse(want_lse) + slopes.double()[:, None] * offset)


def test_kvcache_refuses_another_number_of_new_keys_than_queries():
    """FA2 appends ``k`` ``(B, seqlen_new, Hk, D)`` whatever seqlen_new; longattn's call appends one key a query, so
    another count is refused by name (not attended to wrongly, and not a failure inside longattn's checks)."""
    q, _, _, kc, vc, _ = _cache(nq=2)
    kn = torch.randn(3, 3, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="flash_attn_with_kvcache: k and v must have q's 2 new tokens"):
        flash_attn_with_kvcache(q, kc, vc, kn, kn.clone(), cache_seqlens=4, causal=True)


def test_kvcache_with_more_cache_rows_than_sequences():
    """FA2 reads a contiguous cache of any batch (``batch_size_c = kcache.size(0)``): sequence b is row b."""
    q, kn, vn, kc, vc, _ = _cache(b=3)
    big_k, big_v = torch.cat([kc, kc[:2] + 1]), torch.cat([vc, vc[:2] + 1])
    lens = torch.tensor([0, 5, 10], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, big_k, big_v, kn, vn, cache_seqlens=lens, causal=True)
    want = ref.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    _close(out, want)
    _close(big_k[0, :2], kn[0])  # (appended in place, into the caller's cache)


_CU5 = torch.tensor([0, 5], dtype=torch.int32)


@pytest.mark.parametrize("fn, args, name", [
    ("flash_attn_qkvpacked_func", lambda: (torch.randn(2, 5, 2, 4, 16),), "qkv"),
    ("flash_attn_qkvpacked_func", lambda: (torch.randn(2, 5, 4, 4, 16),), "qkv"),
    ("flash_attn_qkvpacked_func", lambda: (torch.randn(5, 3, 4, 16),), "qkv"),
    ("flash_attn_kvpacked_func", lambda: (torch.randn(2, 5, 4, 16), torch.randn(2, 5, 3, 4, 16)), "kv"),
    ("flash_attn_varlen_qkvpacked_func", lambda: (torch.randn(5, 2, 4, 16), _CU5, 5), "qkv"),
    ("flash_attn_varlen_kvpacked_func", lambda: (torch.randn(5, 4, 16), torch.randn(5, 3, 2, 16), _CU5, _CU5, 5, 5),
     "kv"),
])
def test_packed_functions_name_a_wrong_packing(fn, args, name):
    """A packed tensor whose packing dimension is not 3 (q, k, v) or 2 (k, v) is refused with its name and layout,
    never spread into the wrong arguments (before: an error about ``dropout_p``, or one about the arity)."""
    with pytest.raises(ValueError, match=rf"{fn}: {name} must have shape"):
        getattr(longattn.flash_attn_interface, fn)(*args())


@pytest.mark.parametrize("softcap", [None, "1", float("nan"), True])
def test_softcap_that_is_no_number_is_refused_by_name(softcap):
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises((TypeError, ValueError), match="softcap must be"):
        flash_attn_func(q, q, q, softcap=softcap)


@pytest.mark.parametrize("softcap", [0, -1, -2.5, float("-inf")])
def test_softcap_at_most_zero_is_off_as_in_fa2(softcap):
    q, k, v = (torch.randn(1, 7, 2, 16, dtype=torch.float64) for _ in range(3))
    assert torch.equal(flash_attn_func(q, k, v, softcap=softcap), flash_attn_func(q, k, v))
