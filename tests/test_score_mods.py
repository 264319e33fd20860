"""Logit soft-capping and ALiBi (with sinks, all three together): the reference against a by-hand definition, the
PyTorch backend (float64) and the Triton kernels (the interpreter, float32) against the reference (outputs,
log-sum-exp, gradients), packed batches with empty sequences, decode against contiguous, paged and float8 caches (the
PyTorch backend and the Triton decode kernels in the interpreter, float32 and float16), and the argument checks."""
import math

import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.utils import cu_seqlens_of

TOL = dict(rtol=1e-7, atol=1e-7)


def _by_hand(q, k, v, allowed, scale, softcap, slopes, sinks):
    B, N, H, D = q.shape
    M, group = k.shape[1], H // k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((B, H, N), float("-inf"), dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                entries = []
                for j in range(M):
                    if not allowed[i, j]:
                        continue
                    s = float(q[b, i, h] @ k[b, j, h // group]) * scale
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[b, h]) * abs(i + M - N - j)
                    entries.append((s, j))
                scores = [s for s, _ in entries] + ([float(sinks[h])] if sinks is not None else [])
                if not scores:
                    continue
                top = max(scores)
                total = sum(math.exp(s - top) for s in scores)
                lse[b, h, i] = top + math.log(total)
                for s, j in entries:
                    out[b, i, h] += math.exp(s - top) / total * v[b, j, h // group]
    return out, lse


@pytest.mark.parametrize("softcap, alibi, sinks", [(5.0, False, False), (0.0, True, False), (2.0, True, True)])
def test_reference_matches_the_definition(softcap, alibi, sinks):
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64) * 3
    k, v = torch.randn(2, 2, 7, 2, 8, dtype=torch.float64)
    slopes = torch.rand(2, 4) if alibi else None
    sink = torch.randn(4, dtype=torch.float64) if sinks else None
    for causal, window in ((False, (-1, -1)), (True, (2, -1))):
        allowed = ref.flash_mask(5, 7, causal, window)
        want, want_lse = _by_hand(q, k, v, allowed, 8 ** -0.5, softcap, slopes, sink)
        out, lse = ref.flash_attention(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes,
                                       sinks=sink, return_lse=True)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)


def _grads(fn, xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out, lse = fn(*xs)
    torch.manual_seed(3)
    (out * torch.randn(out.shape, dtype=out.dtype)).sum().backward()  # (randn_like would follow the strides)
    return out, lse, [x.grad for x in xs]


@pytest.mark.parametrize("causal, window, n, m", [(False, (-1, -1), 23, 23), (True, (-1, -1), 11, 30),
                                                  (True, (3, -1), 30, 30)])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "all"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_flash_attention(causal, window, n, m, mods, backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = TOL if backend == "torch" else dict(rtol=2e-4, atol=2e-4)
    q = torch.randn(2, n, 4, 16, dtype=torch.float64) * 2
    k, v = torch.randn(2, 2, m, 2, 16, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    kw = dict(causal=causal, window=window, return_lse=True,
              softcap=0.0 if mods == "alibi" else 3.0,
              alibi_slopes=None if mods == "softcap" else torch.rand(4, dtype=torch.float32))
    extra = [sinks] if mods == "all" else []

    def ours(q, k, v, *s):
        out, lse = longattn.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), backend=backend,
                                            sinks=s[0] if s else None, **kw)
        return out.double(), lse.double()

    def theirs(q, k, v, *s):
        return ref.flash_attention(q, k, v, sinks=s[0] if s else None, **kw)

    got, want = _grads(ours, [q, k, v, *extra]), _grads(theirs, [q, k, v, *extra])
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_per_sequence_slopes_and_empty_sequences(backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = TOL if backend == "torch" else dict(rtol=2e-4, atol=2e-4)
    lens_q, lens_k = [5, 0, 9, 3], [7, 4, 9, 0]
    cu_q, cu_k = cu_seqlens_of(lens_q), cu_seqlens_of(lens_k)
    q = torch.randn(sum(lens_q), 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, sum(lens_k), 2, 16, dtype=torch.float64)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, softcap=4.0, alibi_slopes=torch.rand(4, 4),
              sinks=torch.randn(4, dtype=torch.float64), return_lse=True)
    def ours(q, k, v):
        out, lse = longattn.flash_attention_varlen(q.to(dtype), k.to(dtype), v.to(dtype), backend=backend, **kw)
        return out.double(), lse.double()

    got = _grads(ours, [q, k, v])
    want = _grads(lambda q, k, v: ref.flash_attention_varlen(q, k, v, **kw), [q, k, v])
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        torch.testing.assert_close(a, b, **tol)
    for b in range(4):  # each sequence alone, its row of slopes
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 > q0 and k1 > k0:
            alone = ref.flash_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, softcap=4.0,
                                        alibi_slopes=kw["alibi_slopes"][b], sinks=kw["sinks"])
            torch.testing.assert_close(got[0][q0:q1], alone[0], **tol)


DECODE_TOL = {torch.float64: TOL, torch.float32: dict(rtol=2e-5, atol=2e-5),
              torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _slopes(kind, B, hq):
    """ALiBi slopes as the kernels meet them: ``(Hq,)`` (a broadcast row), or ``(B, Hq)`` non-contiguous."""
    if kind == "head":
        return torch.rand(hq) * 0.5
    return (torch.rand(hq, B) * 0.5).t()


def _decode_case(n_new, page, append, dtype, fp8=False, capacity=24, lens=(5, 0, 17)):
    """q, new k/v (or None), caches (``capacity`` rows per sequence; paged: pages in a random order), block table,
    lengths and descale factors of a decode call with GQA (4 query heads on 2 KV heads)."""
    B, hq, hk, d = 3, 4, 2, 16
    q = torch.randn(B, n_new, hq, d, dtype=torch.float64).to(dtype)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k, v = (torch.randn(B, n_new, hk, d, dtype=torch.float64).to(cache_dtype) for _ in range(2))
    if page is None:
        kc, vc = (torch.randn(B, capacity, hk, d, dtype=torch.float64).to(cache_dtype) for _ in range(2))
        table = None
    else:
        n_pages = B * -(-capacity // page)
        kc, vc = (torch.randn(n_pages, page, hk, d, dtype=torch.float64).to(cache_dtype) for _ in range(2))
        table = torch.randperm(n_pages).view(B, -1).to(torch.int32)
    lens = torch.tensor(lens, dtype=torch.int32)
    if not append:
        k = v = None
        lens = lens + n_new  # the new tokens' rows are already cached
    descales = dict(k_descale=torch.rand(B, hk) + 0.5, v_descale=torch.rand(B, hk) + 0.5) if fp8 else {}
    return q, k, v, kc, vc, table, lens, descales


def _decode_reference(q, k, v, kc, vc, table, descales, **kw):
    """The float64 reference on the (dequantised) inputs; the caches are not touched."""
    kd, vd = descales.get("k_descale"), descales.get("v_descale")
    if kd is not None:  # float8 caches: the dequantised logical rows of each sequence
        rows = (lambda c: c if table is None else c[table.long()].reshape(q.shape[0], -1, *c.shape[2:]))
        kc, vc, table = ref.dequantize_fp8(rows(kc), kd), ref.dequantize_fp8(rows(vc), vd), None
        k, v = (None if x is None else ref.dequantize_fp8(x, f) for x, f in ((k, kd), (v, vd)))
    as64 = (lambda x: None if x is None else x.double())
    return ref.flash_attention_with_kvcache(as64(q), as64(kc).clone(), as64(vc).clone(), as64(k), as64(v),
                                           block_table=table, **kw)


@pytest.mark.parametrize("n_new, page, append", [(1, None, True), (3, None, True), (2, None, False),
                                                 (2, 8, True), (1, 16, True), (3, 8, False)])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "all"])
@pytest.mark.parametrize("backend, dtype", [("torch", torch.float64), ("triton", torch.float32),
                                            ("triton", torch.float16)])
def test_decode(n_new, page, append, mods, backend, dtype):
    if dtype == torch.float16 and mods != "all":
        pytest.skip("float16 runs the case with all three modifications (the suite's time)")
    torch.manual_seed(n_new + 10 * (page or 0))
    q, k, v, kc, vc, table, lens, _ = _decode_case(n_new, page, append, dtype)
    q = q * 2  # scores past the cap
    mod_kw = dict(softcap=0.0 if mods == "alibi" else 3.0,
                  alibi_slopes=None if mods == "softcap" else _slopes("head" if mods == "alibi" else "batch", 3, 4),
                  sinks=torch.randn(4, dtype=torch.float64) if mods == "all" else None)
    for band in (dict(), dict(window=(4, -1)), dict(causal=False, window=(3, 1))):
        kw = dict(cache_seqlens=lens, return_lse=True, **band, **mod_kw)
        want, want_lse = _decode_reference(q, k, v, kc, vc, table, {}, **kw)
        out, lse = longattn.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, block_table=table,
                                                         backend=backend, **kw)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, **DECODE_TOL[dtype])
        torch.testing.assert_close(lse.double(), want_lse, **DECODE_TOL[dtype])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("page", [None, 32, 64])
def test_decode_kernels_float8_caches_and_key_splits(page, fp8):
    torch.manual_seed(5)
    q, k, v, kc, vc, table, lens, descales = _decode_case(2, page, True, torch.float32, fp8=fp8, capacity=192,
                                                          lens=(5, 0, 150))
    kw = dict(cache_seqlens=lens, return_lse=True, softcap=2.0, alibi_slopes=_slopes("batch", 3, 4),
              sinks=torch.randn(4), window=(100, -1))
    want, want_lse = _decode_reference(q * 3, k, v, kc, vc, table, descales, **kw)
    for splits in (1, 3):
        out, lse = longattn.flash_attention_with_kvcache(q * 3, kc.clone(), vc.clone(), k, v, block_table=table,
                                                         backend="triton", num_splits=splits, **descales, **kw)
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


def test_decode_kernels_run_them_and_read_each_calls_slopes():
    from longattn.backends.triton import decode_launch, support
    from longattn.call import AttentionCall, Branch

    torch.manual_seed(6)
    q, _, _, kc, vc, table, lens, _ = _decode_case(1, None, False, torch.float32)
    decode_launch.PLANS.clear()
    for slopes in (torch.rand(3, 4), torch.rand(3, 4) * 3):  # one signature, one plan: it must read each call's
        kw = dict(cache_seqlens=lens, softcap=2.0, alibi_slopes=slopes)
        want = _decode_reference(q, None, None, kc, vc, None, {}, **kw)
        torch.testing.assert_close(longattn.flash_attention_with_kvcache(q, kc, vc, backend="triton", **kw).double(),
                                   want, rtol=2e-5, atol=2e-5)
    (plan,) = decode_launch.PLANS.plans()
    assert plan.split.kwargs["SOFTCAP"] and plan.split.kwargs["ALIBI"]
    # the decode kernels take them; dilated decode does not
    call = AttentionCall(scale=0.25, softcap=2.0, alibi=slopes, cache=object())
    assert support.call_unsupported_reason(call) is None
    dilated = AttentionCall(scale=0.25, softcap=2.0, branches=(Branch(4, 1, 0, 4),), cache=object())
    assert "dilated" in support.call_unsupported_reason(dilated)


def test_readme_says_where_float8_calls_with_soft_capping_or_alibi_run():
    """No kernel computes soft-capping or ALiBi on float8 inputs (the Triton forward's float8 tile leaves them out,
    so the Triton backend refuses such calls and ``auto`` runs the PyTorch backend): the README said the Triton
    forward ran them."""
    from pathlib import Path

    from longattn.backends.triton import support
    from longattn.call import AttentionCall

    for mods in (dict(softcap=2.0), dict(alibi=torch.rand(1, 4))):
        call = AttentionCall(scale=0.25, descale=object(), **mods)
        assert "float8" in support.call_unsupported_reason(call)
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "float8 calls with either run the PyTorch backend" in readme
    assert "float8 calls with either, run the Triton forward" not in readme


@pytest.mark.parametrize("kw, err, match", [
    (dict(softcap=-1.0), ValueError, "softcap"), (dict(softcap="1"), TypeError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"), (dict(softcap=float("inf")), ValueError, "softcap"),
    # Finite caps past float32's arithmetic gave NaN outputs (or gradients) without a word.
    (dict(softcap=1e39), ValueError, "softcap must be 0 \\(off\\) or between"),
    (dict(softcap=1e-40), ValueError, "softcap must be 0 \\(off\\) or between"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, 4)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes"),
    # No backend computes the slopes' gradient (the Triton one gave None, the PyTorch one a value): refused alike.
    (dict(alibi_slopes=torch.ones(4, requires_grad=True)), ValueError, "alibi_slopes must not require a gradient"),
])
def test_bad_arguments_are_named(kw, err, match):
    q = torch.randn(1, 3, 4, 8)
    k = q[:, :, :2]
    with pytest.raises(err, match=match):
        longattn.flash_attention(q, k, k, **kw)
    with pytest.raises(err, match=match):
        longattn.flash_attention_varlen(q[0], k[0], k[0], cu_seqlens_q=cu_seqlens_of([3]),
                                        cu_seqlens_k=cu_seqlens_of([3]), **kw)
    with pytest.raises(err, match=match):
        longattn.flash_attention_with_kvcache(q, k, k, cache_seqlens=3, **kw)


def test_slopes_that_require_a_gradient_run_where_no_gradient_is_recorded():
    q = torch.randn(1, 5, 4, 8)
    slopes = torch.rand(4, requires_grad=True)
    with torch.no_grad():
        out = longattn.flash_attention(q, q, q, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(out, longattn.flash_attention(q, q, q, causal=True, alibi_slopes=slopes.detach()))


@pytest.mark.parametrize("cap", [1e4, 1e8])
def test_large_softcap_forward_backward(cap):
    """A cap far above the scores (``cap * tanh(s / cap)`` nearly ``s``): the Triton kernels' tanh near 0 within
    float32's rounding, not ``cap * 1e-7`` off (it was 1e-2 off the reference at 1e5, 1.6 at 1e8)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    out, lse = longattn.flash_attention(q, k, v, causal=True, softcap=cap, return_lse=True, backend="triton")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want, want_lse = ref.flash_attention(qd, kd, vd, causal=True, softcap=cap, return_lse=True)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    go = torch.randn_like(want)
    want.backward(go)
    out.backward(go.float())
    for got, exp in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(got.grad.double(), exp.grad, rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cap", [1e-30, 1e30])
def test_softcaps_at_the_bounds_are_finite_and_exact(cap, backend):
    """The smallest and largest caps taken (``SOFTCAP_RANGE``) give finite outputs, log-sum-exp and gradients that
    match the reference on float32 inputs, a query of zeros (scores exactly 0) included; beyond them float32's
    arithmetic gave NaN (the Triton kernels' cap * log2(e) from 2.4e38 and 2 / cap below 1e-38, float32 inputs
    from 3.4e38, the PyTorch backend's gradients from 1.7e38)."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, 16) for _ in range(3))
    q[0, 0] = 0
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = longattn.flash_attention(*xs, causal=True, softcap=cap, return_lse=True, backend=backend)
    want, want_lse = ref.flash_attention(*x64, causal=True, softcap=cap, return_lse=True)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    go = torch.randn_like(want) * 100
    out.backward(go.float())
    want.backward(go)
    for got, exp in zip(xs, x64):
        torch.testing.assert_close(got.grad.double(), exp.grad, rtol=0, atol=2e-4)
    kc, vc = torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    got = longattn.flash_attention_with_kvcache(q[:, :2], kc, vc, cache_seqlens=6, softcap=cap, backend=backend)
    want = ref.flash_attention_with_kvcache(q[:, :2].double(), kc.double(), vc.double(), cache_seqlens=6, softcap=cap)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("cap", [1e4, 1e8])
def test_large_softcap_decode(cap):
    """The decode kernel's soft-capping with a cap far above the scores, as the forward's."""
    torch.manual_seed(1)
    q = torch.randn(2, 3, 2, 16)
    kc, vc = torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    lens = torch.tensor([17, 40], dtype=torch.int32)
    got = longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, softcap=cap, backend="triton")
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens, softcap=cap)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
