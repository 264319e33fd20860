"""FP8 inputs on the CPU: the PyTorch backend against the float64 reference on the dequantised values,
the descale conventions (per tensor, per batch row and key/value head, per sequence of a packed batch), the
forward-only rule and the argument checks. The Triton FP8 kernels run on sm_89/sm_90 only (the interpreter does not
round to float8 as the GPU does): ``tests/gpu/test_fp8_gpu.py``."""
import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.utils import cu_seqlens_of

F8 = torch.float8_e4m3fn


def _fp8(shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(F8)


def _descales(kind, b, hk, gen):
    if kind == "none":
        return None, None, None
    if kind == "tensor":
        return tuple(torch.rand(1, generator=gen) + 0.25 for _ in range(3))
    return tuple(torch.rand(b, hk, generator=gen) + 0.25 for _ in range(3))


def _deq(x, d):
    return ref.dequantize_fp8(x, d)


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (5, 2)}])
def test_flash_fp8_is_the_reference_on_dequantised_values(kind, kw, gen):
    B, N, M, Hq, Hk, D = 2, 37, 53, 6, 2, 24
    q, k, v = _fp8((B, N, Hq, D), gen), _fp8((B, M, Hk, D), gen), _fp8((B, M, Hk, D), gen)
    qd, kd, vd = _descales(kind, B, Hk, gen)
    out, lse = longattn.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32,
                                        return_lse=True, backend="torch", **kw)
    want, want_lse = ref.flash_attention(_deq(q, qd), _deq(k, kd), _deq(v, vd), return_lse=True, **kw)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-5)


def test_output_is_bfloat16_by_default(gen):
    q = _fp8((1, 9, 2, 16), gen)
    out = longattn.flash_attention(q, q, q, backend="torch")
    want = ref.flash_attention(*(_deq(q, None),) * 3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


def test_descale_changes_the_result_as_defined(gen):
    """A factor on q and its inverse on k cancel; a factor on v scales the output."""
    q, k, v = (_fp8((1, 11, 2, 16), gen) for _ in range(3))
    base = longattn.flash_attention(q, k, v, out_dtype=torch.float32, backend="torch")
    two, half = torch.tensor([2.0]), torch.tensor([0.5])
    same = longattn.flash_attention(q, k, v, q_descale=two, k_descale=half, out_dtype=torch.float32, backend="torch")
    torch.testing.assert_close(same, base)
    scaled = longattn.flash_attention(q, k, v, v_descale=two, out_dtype=torch.float32, backend="torch")
    torch.testing.assert_close(scaled, 2 * base)
    sharper = longattn.flash_attention(q, k, v, q_descale=two, out_dtype=torch.float32, backend="torch")
    assert not torch.allclose(sharper, base)


def test_varlen_fp8_per_sequence_descales(gen):
    lens_q, lens_k, Hq, Hk, D = [5, 0, 17, 1], [3, 4, 17, 6], 4, 2, 16
    q, k, v = _fp8((sum(lens_q), Hq, D), gen), _fp8((sum(lens_k), Hk, D), gen), _fp8((sum(lens_k), Hk, D), gen)
    cu = lambda lens: cu_seqlens_of(lens, "cpu")  # noqa: E731
    qd, kd, vd = (torch.rand(len(lens_q), Hk, generator=gen) + 0.25 for _ in range(3))
    out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), causal=True,
                                          q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32,
                                          backend="torch")
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        if lens_q[b] == 0:
            continue
        qs, ks, vs = q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]]
        want = ref.flash_attention(_deq(qs, qd[b:b + 1]), _deq(ks, kd[b:b + 1]), _deq(vs, vd[b:b + 1]), causal=True)
        torch.testing.assert_close(out[cq[b]:cq[b + 1]].double(), want[0], atol=2e-5, rtol=1e-5)


def test_dilated_fp8(gen):
    B, N, H, D = 2, 45, 4, 16
    q, k, v = (_fp8((B, N, H, D), gen) for _ in range(3))
    qd, kd, vd = _descales("head", B, H, gen)
    kw = dict(segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True)
    out = longattn.dilated_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32,
                                     backend="torch", **kw)
    want = ref.dilated_attention(_deq(q, qd), _deq(k, kd), _deq(v, vd), **kw)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


def test_a_nan_float8_key_gives_nan_rows_and_log_sum_exps(gen):
    """float8_e4m3fn has a NaN: the queries that see a NaN key output NaN with a NaN log-sum-exp (not the -inf of
    a query without keys, nor another dilated branch's finite value), as the reference on the dequantised values."""
    q, k, v = (_fp8((1, 10, 2, 16), gen) for _ in range(3))
    k[0, 4, 0, 0] = float("nan")
    kw = dict(out_dtype=torch.float32, return_lse=True, backend="torch")
    out, lse = longattn.flash_attention(q, k, v, causal=True, **kw)
    assert torch.isnan(out[0, 4:, 0]).all() and torch.isnan(lse[0, 0, 4:]).all()
    assert torch.isfinite(out[0, :4]).all() and torch.isfinite(lse[0, 0, :4]).all() and torch.isfinite(lse[0, 1]).all()
    dil = dict(segment_lengths=[2, 10], dilation_rates=[1, 2], causal=True)
    out, lse = longattn.dilated_attention(q, k, v, **dil, **kw)
    want, want_lse = ref.dilated_attention(*(_deq(x, None) for x in (q, k, v)), **dil, return_lse=True)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    assert torch.isnan(lse[0, 0, 5]) and torch.isnan(lse[0, 0, 6])  # (a NaN key in one branch of two: NaN)


def test_empty_fp8_call(gen):
    q, k = _fp8((2, 0, 2, 16), gen), _fp8((2, 5, 2, 16), gen)
    out, lse = longattn.flash_attention(q, k, k, return_lse=True)
    assert out.shape == (2, 0, 2, 16) and out.dtype == torch.bfloat16 and lse.shape == (2, 2, 0)


def test_quantize_fp8_round_trip(gen):
    x = torch.randn(2, 33, 4, 16, generator=gen)
    x[:, :, 1] *= 50  # one loud head: per-head factors keep the quiet heads' precision
    for per_head in (False, True):
        x8, d = longattn.quantize_fp8(x, per_head=per_head)
        assert x8.dtype == F8 and d.dtype == torch.float32 and d.shape == ((2, 4) if per_head else (1,))
        back = ref.dequantize_fp8(x8, d, torch.float32)
        # e4m3 keeps 3 mantissa bits: a rounding error of at most 2**-4 of the value (normal range)
        assert ((back - x).abs() <= 2 ** -4 * x.abs() + d.max() * 2 ** -9).all()
    err_t = (ref.dequantize_fp8(*longattn.quantize_fp8(x), torch.float32) - x)[:, :, 0].abs().max()
    err_h = (ref.dequantize_fp8(*longattn.quantize_fp8(x, per_head=True), torch.float32) - x)[:, :, 0].abs().max()
    assert err_h < err_t


def test_quantize_fp8_per_key_value_head_feeds_a_grouped_query_call(gen):
    """``kv_heads`` gives the queries of a grouped-query call one factor per group of query heads ``(B, Hk)``, the
    descale shape the call takes (FlashAttention-3's); the round trip keeps every head within e4m3's rounding."""
    q = torch.randn(2, 9, 4, 16, generator=gen)
    q[:, :, 3] *= 20  # a loud head: its group's factor follows it, the other group's does not
    q8, dq = longattn.quantize_fp8(q, per_head=True, kv_heads=2)
    assert dq.shape == (2, 2)
    assert torch.equal(dq[:, 1], q[:, :, 2:].abs().amax(dim=(1, 2, 3)) / torch.finfo(F8).max)
    back = ref.dequantize_fp8(q8, dq, torch.float32)
    assert ((back - q).abs() <= 2 ** -4 * q.abs() + dq.max() * 2 ** -9).all()
    k8, dk = longattn.quantize_fp8(torch.randn(2, 7, 2, 16, generator=gen), per_head=True)
    out = longattn.flash_attention(q8, k8, k8, q_descale=dq, k_descale=dk, v_descale=dk)
    want = ref.flash_attention(back.double(), *(2 * [ref.dequantize_fp8(k8, dk)]))
    assert (out.double() - want).abs().max() < 2e-2
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="kv_heads"):
            longattn.quantize_fp8(q, per_head=True, kv_heads=bad)
    with pytest.raises(ValueError, match="per_head=True"):
        longattn.quantize_fp8(q, kv_heads=2)


# --- argument checks ---------------------------------------------------------------------------------------------

def _inputs(gen, b=2, hk=2):
    return _fp8((b, 9, 4, 16), gen), _fp8((b, 7, hk, 16), gen), _fp8((b, 7, hk, 16), gen)


@pytest.mark.parametrize("descale, err, match", [
    (torch.ones(2), ValueError, r"q_descale must have shape \(1,\) .*\(2, 2\)"),
    (torch.ones(2, 4), ValueError, r"q_descale must have shape"),
    (torch.ones(1, dtype=torch.float64), TypeError, "q_descale must have dtype float32"),
    (1.0, TypeError, "q_descale must be a float32 torch.Tensor"),
    (torch.ones(1, device="meta"), ValueError, "q_descale must be on the inputs' device"),
])
def test_bad_descales_are_named(descale, err, match, gen):
    q, k, v = _inputs(gen)
    with pytest.raises(err, match=match):
        longattn.flash_attention(q, k, v, q_descale=descale)


def test_mixed_and_unsupported_dtypes(gen):
    q, k, v = _inputs(gen)
    with pytest.raises(TypeError, match="share one dtype"):
        longattn.flash_attention(q, k.to(torch.bfloat16), v)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        longattn.flash_attention(*(x.to(torch.float8_e5m2) for x in (q, k, v)))
    with pytest.raises(TypeError, match="out_dtype"):
        longattn.flash_attention(q, k, v, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="allowed: float16"):  # the backward-capable APIs take no float8
        longattn.block_sparse_attention(q, k, v, block_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=16)


def test_descales_with_other_dtypes_are_refused(gen):
    q = torch.randn(1, 5, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_descale, out_dtype apply to float8_e4m3fn inputs only"):
        longattn.flash_attention(q, q, q, k_descale=torch.ones(1), out_dtype=torch.float32)


def test_fp8_is_forward_only(gen):
    q, k, v = _inputs(gen)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="forward only"):
        longattn.flash_attention(q, k, v)
    with torch.no_grad():
        assert longattn.flash_attention(q, k, v).shape == (2, 9, 4, 16)


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_that_require_grad_are_refused(name, gen):
    """FP8 is forward only on every route: the Triton kernels read the factors as constants (no gradient), so a
    factor that requires grad is an error everywhere, not a gradient on the PyTorch backend and none on the GPU."""
    q, k, v = _inputs(gen)
    d = torch.full((1,), 0.5, requires_grad=True)
    for fn, kw in ((longattn.flash_attention, {}),
                   (longattn.dilated_attention, dict(segment_lengths=[4], dilation_rates=[1]))):
        kk, vv = (k, v) if fn is longattn.flash_attention else (q[:, :, :2], q[:, :, :2])
        with pytest.raises(ValueError, match=f"{name} must not require grad"):
            fn(q, kk, vv, backend="torch", **{name: d}, **kw)
        with torch.no_grad():  # (no graph is recorded: the factor is a constant there)
            assert not fn(q, kk, vv, backend="torch", **{name: d}, **kw).requires_grad
    cu = cu_seqlens_of([9], "cpu")
    with pytest.raises(ValueError, match=f"{name} must not require grad"):
        longattn.flash_attention_varlen(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, backend="torch",
                                        **{name: d})


@pytest.mark.parametrize("name", ["k_descale", "v_descale"])
def test_fp8_cache_descales_that_require_grad_are_refused(name, gen):
    q = torch.randn(2, 1, 4, 16)
    kc, vc = _fp8((2, 8, 2, 16), gen), _fp8((2, 8, 2, 16), gen)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    d = torch.ones(1, requires_grad=True)
    with pytest.raises(ValueError, match=f"inference only .*{name}"):
        longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="torch", **{name: d})
    with pytest.raises(ValueError, match=f"inference only .*{name}"):
        longattn.dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, segment_lengths=[4],
                                                dilation_rates=[1], backend="torch", **{name: d})


def test_triton_backend_refuses_fp8_in_the_interpreter(gen):
    q, k, v = _inputs(gen)
    with pytest.raises(ValueError, match="float8"):
        longattn.flash_attention(q, k, v, backend="triton")


# --- decode against float8 caches --------------------------------------------------------------------------------

def _deq_cache(cache, descale, block_table, batch):
    """A float8 cache's dequantised logical rows per sequence ``(B, capacity, Hk, D)`` in float64 (contiguous, or
    paged through ``block_table``), so that per-sequence factors apply to the right rows."""
    rows = cache if block_table is None else cache[block_table.long()].reshape(batch, -1, *cache.shape[2:])
    return ref.dequantize_fp8(rows, descale)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kind", ["tensor", "head"])
def test_decode_with_fp8_caches(backend, paged, kind, gen):
    B, Hq, Hk, D, cap, n_q = 3, 4, 2, 16, 48, 2
    lens = torch.tensor([5, 0, 37], dtype=torch.int32)
    q = torch.randn(B, n_q, Hq, D, generator=gen)
    k_new, v_new = _fp8((B, n_q, Hk, D), gen), _fp8((B, n_q, Hk, D), gen)
    if paged:
        page, n_pages = 16, 12
        k_cache, v_cache = _fp8((n_pages, page, Hk, D), gen), _fp8((n_pages, page, Hk, D), gen)
        block_table = torch.randperm(n_pages, generator=gen)[:B * cap // page].view(B, -1).to(torch.int32)
    else:
        k_cache, v_cache = _fp8((B, cap, Hk, D), gen), _fp8((B, cap, Hk, D), gen)
        block_table = None
    kd, vd = (torch.rand((1,) if kind == "tensor" else (B, Hk), generator=gen) + 0.25 for _ in range(2))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = longattn.flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                     block_table=block_table, k_descale=kd, v_descale=vd,
                                                     return_lse=True, backend=backend)
    assert out.dtype == q.dtype
    kc, vc = _deq_cache(k_before, kd, block_table, B), _deq_cache(v_before, vd, block_table, B)
    want, want_lse = ref.flash_attention_with_kvcache(q.double(), kc, vc, ref.dequantize_fp8(k_new, kd),
                                                      ref.dequantize_fp8(v_new, vd), cache_seqlens=lens,
                                                      return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-5)
    # the new tokens were written, as float8, at each sequence's end
    rows = _deq_cache(k_cache, None, block_table, B)
    for b in range(B):
        torch.testing.assert_close(rows[b, lens[b]:lens[b] + n_q], k_new[b].double())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dilated_decode_with_fp8_caches(backend, gen):
    B, H, D, cap = 2, 4, 16, 70
    lens = torch.tensor([64, 33], dtype=torch.int32)
    q = torch.randn(B, 1, H, D, generator=gen)
    k_cache, v_cache = _fp8((B, cap, H, D), gen), _fp8((B, cap, H, D), gen)
    kd, vd = (torch.rand(B, H, generator=gen) + 0.25 for _ in range(2))
    kw = dict(segment_lengths=[16, 32], dilation_rates=[1, 2])
    out = longattn.dilated_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_descale=kd,
                                                  v_descale=vd, backend=backend, **kw)
    want = ref.dilated_attention_with_kvcache(q.double(), ref.dequantize_fp8(k_cache, kd),
                                              ref.dequantize_fp8(v_cache, vd), cache_seqlens=lens, **kw)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


def test_fp8_cache_arguments_are_checked(gen):
    q = torch.randn(2, 1, 4, 16)
    kc, vc = _fp8((2, 8, 2, 16), gen), _fp8((2, 8, 2, 16), gen)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    fa = longattn.flash_attention_with_kvcache
    with pytest.raises(ValueError, match=r"k_descale must have shape \(1,\) .*\(2, 2\)"):
        fa(q, kc, vc, cache_seqlens=lens, k_descale=torch.ones(4))
    with pytest.raises(TypeError, match="v_descale must have dtype float32"):
        fa(q, kc, vc, cache_seqlens=lens, v_descale=torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="k_descale applies to float8_e4m3fn caches only"):
        fa(q, kc.float(), vc.float(), cache_seqlens=lens, k_descale=torch.ones(1))
    with pytest.raises(TypeError, match="float8 caches need both"):
        fa(q, kc, vc.float(), cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"k must be \(2, 1, 2, 16\) torch.float8_e4m3fn"):
        fa(q, kc, vc, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16), cache_seqlens=lens)


@pytest.mark.parametrize("shape", [(2, 100, 3, 16), (1, 77, 2, 24), (1, 1, 2, 16)])
def test_seq_major_copy_in_the_interpreter(shape, gen):
    """The FP8 forward's copy of V with the keys innermost (a byte transpose kernel)."""
    from longattn.backends.triton.fp8_layout import seq_major

    v = _fp8(shape, gen)
    s = seq_major(v)
    assert s.shape == v.shape and (s.shape[1] == 1 or (s.stride(1) == 1 and s.stride(3) % 16 == 0))
    assert torch.equal(s.view(torch.uint8), v.view(torch.uint8))


def _permute_v_keys(s):
    """The Gluon FP8 forward's value layout in plain PyTorch: sequence-major ``s (..., M)`` (keys last) as
    ``(..., M')``, ``M'`` = ``M`` rounded up to 16, key ``16 g + 8 c3 + 4 c2 + 2 c1 + c0`` at ``16 g + 8 c2 + 4 c1 +
    2 c3 + c0``, the padding zero."""
    M = s.shape[-1]
    padded = s.new_zeros((*s.shape[:-1], -(-M // 16) * 16))
    padded[..., :M] = s
    j = torch.arange(padded.shape[-1])
    c0, c1, c2, c3 = j & 1, (j >> 1) & 1, (j >> 2) & 1, (j >> 3) & 1
    out = torch.empty_like(padded)
    out[..., j - j % 16 + 8 * c2 + 4 * c1 + 2 * c3 + c0] = padded
    return out


@pytest.mark.parametrize("shape", [(2, 100, 3, 16), (1, 77, 2, 24), (1, 1, 2, 16), (3, 130, 1, 128), (2, 64, 2, 32)])
@pytest.mark.parametrize("given", ["rows", "seq_major", "torch"])
def test_permuted_seq_major_copy(shape, given, gen, monkeypatch):
    """The Gluon FP8 forward's copy of V (``seq_major(v, permuted=True)``, the Triton kernel in the interpreter, or
    PyTorch's copy outside it): ``(B, M', Hk, D)``, sequence-major, the keys of each group of 16 permuted and the
    padding zero, from ``v (B, M, Hk, D)`` or from values already sequence-major (padding bytes not zero, unread)."""
    from longattn.backends.triton.fp8_layout import seq_major

    B, M, Hk, D = shape
    Mp = -(-M // 16) * 16
    v = _fp8(shape, gen)
    want = _permute_v_keys(v.view(torch.uint8).permute(0, 2, 3, 1))
    if given == "seq_major":
        rows = torch.randint(1, 255, (B, Hk, D, Mp + 16), generator=gen, dtype=torch.uint8)
        rows[..., :M] = v.view(torch.uint8).permute(0, 2, 3, 1)
        v = rows.view(F8).permute(0, 3, 1, 2)[:, :M]
    if given == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    s = seq_major(v, permuted=True)
    assert s.shape == (B, Mp, Hk, D) and s.stride() == (Hk * D * Mp, 1, D * Mp, Mp)
    assert torch.equal(s.view(torch.uint8).permute(0, 2, 3, 1), want)
    if given == "rows" and M > 1:  # the Triton forward's layout: unpermuted, the padding zero too
        s = seq_major(v)
        rows = s.as_strided((B, Hk, D, Mp), (s.stride(0), s.stride(2), s.stride(3), 1)).view(torch.uint8)
        assert torch.equal(rows[..., M:], torch.zeros_like(rows[..., M:])) and s.shape == v.shape


def test_decode_with_fp8_caches_and_bfloat16_queries(gen):
    """bfloat16 queries against float8 caches: the kernels scale them by a power of two into float16 (exact) and
    multiply in float16; the result is the reference's up to the bfloat16 output's rounding."""
    B, Hq, Hk, D, cap = 2, 4, 2, 32, 40
    lens = torch.tensor([33, 7], dtype=torch.int32)
    q = (torch.randn(B, 1, Hq, D, generator=gen) * 1e4).to(torch.bfloat16)
    q[0, 0, 0, :4] = torch.tensor([1e-30, -3e-20, 2e6, 1e-3])  # beyond float16's range, and tiny, in one program
    kc, vc = _fp8((B, cap, Hk, D), gen), _fp8((B, cap, Hk, D), gen)
    kd, vd = torch.rand(B, Hk, generator=gen) * 1e-5 + 1e-6, torch.rand(1, generator=gen) + 0.25
    want = ref.flash_attention_with_kvcache(q.double(), ref.dequantize_fp8(kc, kd), ref.dequantize_fp8(vc, vd),
                                            cache_seqlens=lens)
    for backend in ("torch", "triton"):
        out = longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=kd, v_descale=vd,
                                                    backend=backend)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)


# ------------------------------------------------------------------------------------- queries and keys rotated

@pytest.mark.parametrize("d", [64, 128, 96, 8])
def test_rotation_is_orthogonal_and_seeded(d):
    from longattn._fp8 import rotation
    r = rotation(d, seed=3, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(r, rotation(d, seed=3, dtype=torch.float64))
    assert not torch.equal(r, rotation(d, seed=4, dtype=torch.float64))


def test_rotated_queries_and_keys_give_the_same_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 11, 2, 32, generator=g, dtype=torch.float64) for _ in range(2))
    qr, kr = longattn.rotate_qk(q, k)
    assert qr.dtype == kr.dtype == torch.float64 and not torch.allclose(qr, q)
    torch.testing.assert_close(ref.flash_attention(qr, kr, v, causal=True), ref.flash_attention(q, k, v, causal=True),
                               atol=1e-12, rtol=0)
    packed = longattn.rotate_qk(q[0].float(), k[0].float())  # (total, heads, head_dim)
    assert packed[0].shape == q[0].shape and packed[0].dtype == torch.float32


def test_rotation_lowers_the_fp8_error_of_outlier_channels():
    """Four head-dim channels of q and k 16x the others (as language models' queries and keys have): their
    quantisation factor is set by the outliers; rotated first, the error against float64 is several times lower.
    Gaussian inputs: no change."""
    def error(outlier: float, rotate: bool, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 64, 2, 64, generator=g, dtype=torch.float64) for _ in range(3))
        ch = torch.randperm(64, generator=g)[:4]
        q[..., ch] *= outlier
        k[..., ch] *= outlier
        want = ref.flash_attention(q, k, v, causal=True)
        qq, kk = longattn.rotate_qk(q.float(), k.float()) if rotate else (q.float(), k.float())
        (q8, qs), (k8, ks), (v8, vs) = (longattn.quantize_fp8(x, per_head=True) for x in (qq, kk, v.float()))
        got = longattn.flash_attention(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs,
                                       out_dtype=torch.float32, backend="torch")
        return ((got.double() - want).norm() / want.norm()).item()
    for seed in range(3):
        assert error(16.0, False, seed) > 2 * error(16.0, True, seed)
        assert error(1.0, True, seed) < 1.2 * error(1.0, False, seed)


def test_rotate_qk_bad_input_is_named():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="rotate_qk: q and k must share head_dim"):
        longattn.rotate_qk(q, torch.randn(1, 4, 2, 8))
    with pytest.raises(TypeError, match="rotate_qk: k must have dtype"):
        longattn.rotate_qk(q, q.to(torch.int32))
    with pytest.raises(ValueError, match="rotate_qk: q must have 4 dims"):
        longattn.rotate_qk(q[0, 0], q)
