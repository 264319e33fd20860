"""Code ported from FlashAttention, PyTorch's SDPA and FlexAttention: the peers' conventions for the arguments
longattn shares with them, checked against a float64 implementation written from FlashAttention's documentation
(not :mod:`longattn.reference`), and clear errors where a peer's spelling or layout would otherwise be misread."""
import math

import pytest
import torch

import longattn
from longattn.nn import DilatedAttention, MultiheadDilatedAttention


def fa_semantics(q, k, v, *, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0, alibi_slopes=None):
    """FlashAttention 2's documented ``flash_attn_func`` in float64, one (batch, head) at a time: query head ``h``
    reads key/value head ``h // (Hq // Hk)``; query ``i`` sits at key position ``i + M - N`` (bottom-right);
    ``window_size=(left, right)`` with -1 unbounded, ``causal`` setting ``right`` to 0; ``softcap`` 0 is off;
    ALiBi adds ``-slope * |i + M - N - j|`` after the soft-cap. Returns ``(out, lse)``, lse ``(B, Hq, N)``."""
    q, k, v = q.double(), k.double(), v.double()
    b_, n, hq, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window[0], 0 if causal else window[1]
    pos = torch.arange(n)[:, None] + m - n
    j = torch.arange(m)[None, :]
    keep = torch.ones(n, m, dtype=torch.bool)
    if left >= 0:
        keep &= j >= pos - left
    if right >= 0:
        keep &= j <= pos + right
    out = torch.zeros(b_, n, hq, d, dtype=torch.float64)
    lse = torch.full((b_, hq, n), -math.inf, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            kv = h // (hq // hk)
            s = q[b, :, h] @ k[b, :, kv].T * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                s = s - float(slope) * (pos - j).abs()
            s = s.masked_fill(~keep, -math.inf)
            rows = keep.any(1)
            lse[b, h, rows] = torch.logsumexp(s[rows], 1)
            out[b, rows, h] = torch.softmax(s[rows], 1) @ v[b, :, kv]
    return out, lse


CASES = [  # (N, M, Hq, Hk, flash_attention's keywords)
    (5, 9, 6, 2, dict(causal=True)),  # N < M: bottom-right, every query sees a key
    (9, 4, 4, 1, dict(causal=True)),  # N > M: the first N - M queries see no key
    (7, 7, 6, 3, dict(window=(2, 1), softcap=1.5)),
    (6, 8, 4, 2, dict(window=(-1, 2), alibi_slopes="heads")),
    (8, 6, 4, 4, dict(causal=True, window=(3, -1), alibi_slopes="batch", scale=0.3)),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n, m, hq, hk, kw", CASES)
def test_flash_attention_has_flash_attn_funcs_meaning(backend, n, m, hq, hk, kw, gen):
    q = torch.randn(2, n, hq, 16, generator=gen)
    k, v = (torch.randn(2, m, hk, 16, generator=gen) for _ in range(2))
    kw = dict(kw)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = torch.rand(hq if kw["alibi_slopes"] == "heads" else (2, hq), generator=gen)
    out, lse = longattn.flash_attention(q, k, v, return_lse=True, backend=backend, **kw)
    fa_kw = {("softmax_scale" if name == "scale" else name): x for name, x in kw.items()}
    want_out, want_lse = fa_semantics(q, k, v, **fa_kw)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=0)


def _raises_with_layout_hint(call):
    with pytest.raises(ValueError, match=r"SDPA's or FlexAttention's \(batch, heads, seq, head_dim\) need "
                                         r"\.transpose\(1, 2\)") as info:
        call()
    return str(info.value)


def test_sdpa_layout_where_the_heads_do_not_fit_says_to_transpose():
    """Cross-attention in SDPA's (B, H, N, D): read as (B, N, H, D), 10 query heads over 7 key heads."""
    q = torch.randn(2, 8, 10, 16)  # (B, H, N, D)
    k = torch.randn(2, 4, 7, 16)  # (B, Hk, M, D)
    message = _raises_with_layout_hint(lambda: longattn.flash_attention(q, k, k, backend="torch"))
    assert "the number of query heads (10, q)" in message
    longattn.flash_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), backend="torch")
    with pytest.raises(ValueError) as info:  # (no hint where SDPA's layout would not fit either: 5 over 4 heads)
        longattn.flash_attention(torch.randn(2, 5, 10, 16), k, k, backend="torch")
    assert "transpose" not in str(info.value)


def test_sdpa_layout_grouped_self_attention_of_dilated_attention_says_to_transpose():
    q, k = torch.randn(1, 8, 12, 16), torch.randn(1, 2, 12, 16)  # (B, Hq, N, D), (B, Hk, N, D)
    message = _raises_with_layout_hint(lambda: longattn.dilated_attention(
        q, k, k, segment_lengths=[4], dilation_rates=[1], backend="torch"))
    assert "self-attention needs k and v as long as q" in message


def test_a_genuine_n_not_m_to_dilated_attention_gets_no_layout_hint():
    """(B, N, H, D) tensors with N = 2M: SDPA's layout read as ours would fit too (2M heads over M), but heads far
    outnumbering rows is the wrong reading: transposing would attend across heads."""
    q, k = torch.randn(1, 64, 4, 16), torch.randn(1, 32, 4, 16)
    with pytest.raises(ValueError, match="self-attention needs k and v as long as q") as info:
        longattn.dilated_attention(q, k, k, segment_lengths=[16], dilation_rates=[1], backend="torch")
    assert "transpose" not in str(info.value)


def test_flexattention_layout_with_its_block_mask_says_to_transpose():
    q, k = torch.randn(1, 4, 64, 16), torch.randn(1, 4, 64, 16)  # (B, H, N, D): passes as 64 heads over 4 rows
    mask = torch.rand(1, 4, 4, 4) < 0.5  # blocks of 16 over N = M = 64
    message = _raises_with_layout_hint(lambda: longattn.block_sparse_attention(
        q, k, k, block_mask=mask, block_size=16, backend="torch"))
    assert "block_mask must have shape" in message
    out = longattn.block_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), block_mask=mask,
                                          block_size=16, backend="torch")
    assert out.shape == (1, 64, 4, 16)


def test_kvcache_layout_hint_only_where_transposing_q_would_fit_the_caches_heads():
    """The caches' stand-in keys read as one head in SDPA's layout, so every head-count error hinted to transpose,
    also a grouped-query mismatch in the right layout (3 query heads over 2 cached ones)."""
    kc = torch.randn(2, 32, 2, 16)
    with pytest.raises(ValueError, match="the number of query heads") as info:
        longattn.flash_attention_with_kvcache(torch.randn(2, 1, 3, 16), kc, kc.clone(), cache_seqlens=4)
    assert "transpose" not in str(info.value)
    message = _raises_with_layout_hint(lambda: longattn.flash_attention_with_kvcache(
        torch.randn(2, 4, 1, 16), kc, kc.clone(), cache_seqlens=4))  # (B, Hq, Nq, D): 4 query heads over 2
    assert "the number of query heads (1, q)" in message


def test_packed_inputs_get_no_layout_hint():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="the number of query heads") as info:
        longattn.flash_attention_varlen(torch.randn(8, 5, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16),
                                        cu_seqlens_q=cu, cu_seqlens_k=cu, backend="torch")
    assert "transpose" not in str(info.value)


@pytest.mark.parametrize("window, side", [((None, 0), "left"), ((4, None), "right")])
def test_flashattention4s_none_window_side_is_refused_naming_minus_one(window, side):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match=rf"window {side} must be an int >= 0, or -1 for unbounded .*got None; "
                                        r"FlashAttention-4's None \(unbounded\) is -1 here"):
        longattn.flash_attention(q, q, q, window=window, backend="torch")


def test_multihead_dilated_attention_called_as_nn_multiheadattention_names_cu_seqlens():
    """``layer(query, key)`` would hand the key to ``cu_seqlens``: refused by name, not as a shape of x."""
    layer = MultiheadDilatedAttention(32, 4, [4], [1], backend="torch")
    x = torch.randn(2, 8, 32)
    with pytest.raises(TypeError, match=r"cu_seqlens must be an int32 \(or int64\) tensor .*got torch.float32 "
                                        r"\(2, 8, 32\): this layer is self-attention"):
        layer(x, x)


def test_dilated_modules_name_a_mask_passed_where_cu_seqlens_goes():
    """SDPA's ``attn_mask`` as ``DilatedAttention``'s fourth argument, a ``key_padding_mask`` as the layer's second:
    they reached the packed path, whose error spoke of q's or x's dims."""
    q = torch.randn(2, 16, 4, 8)
    attention = DilatedAttention([4, 8], [1, 2], backend="torch")
    for mask in (torch.zeros(2, 1, 16, 16), torch.ones(16, 16, dtype=torch.bool)):
        with pytest.raises(TypeError, match=r"DilatedAttention: cu_seqlens must be an int32 \(or int64\) tensor .*"
                                            r"the module takes no attention mask"):
            attention(q, q, q, mask)
    layer = MultiheadDilatedAttention(32, 4, [4], [1], backend="torch")
    with pytest.raises(TypeError, match=r"got torch.bool \(2, 16\): this layer takes no key_padding_mask"):
        layer(torch.randn(2, 16, 32), torch.zeros(2, 16, dtype=torch.bool))
