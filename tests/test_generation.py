"""Generation with a KV cache: MultiheadDilatedAttention's prefill + decode steps against its forward on the whole
sequence, and LongNet.generate against recomputing the full forward for every token (CPU, float64; Triton in the
interpreter, float32)."""
import pytest
import torch

from longattn.models import LongNet, LongNetConfig
from longattn.models.generation import KVCache
from longattn.nn import MultiheadDilatedAttention


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("head_split", [False, True])
def test_prefill_and_decode_equal_forward(backend, dtype, page_size, head_split):
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(32, 4, (4, 8, 16), (1, 2, 4), num_kv_heads=2, causal=True, rotary=True,
                                     head_split=head_split, backend=backend).to(dtype).eval()
    x = torch.randn(2, 23, 32, dtype=dtype)
    prompt, steps = 6, [1, 3, 1, 5, 7]  # several tokens per step too (speculative decoding, chunked prefill)
    with torch.no_grad():
        want = attn(x)
        cache = KVCache(1, 2, 23, 2, 8, dtype=dtype, page_size=page_size)
        kc, vc = cache.layers[0]
        got = [attn.prefill(x[:, :prompt], kc, vc, cache.block_table)]
        cache.seqlens.fill_(prompt)
        at = prompt
        for n in steps:
            got.append(attn.decode(x[:, at:at + n], kc, vc, cache.seqlens, cache.block_table))
            cache.seqlens += n
            at += n
    tol = {} if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(got, dim=1), want, **tol)


@pytest.mark.parametrize("page_size", [None, 8])
def test_generate_equals_recomputing_the_whole_sequence(page_size):
    torch.manual_seed(1)
    cfg = LongNetConfig(vocab_size=61, embed_dim=32, num_heads=4, num_kv_heads=2, num_layers=2,
                        segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), backend="torch")
    model = LongNet(cfg).double().eval()
    with torch.no_grad():  # make the logits spread out, so greedy picks are well separated
        model.embedding.weight.mul_(8)
    tokens = torch.randint(0, 61, (3, 5))
    got = model.generate(tokens, 24, page_size=page_size)
    want = tokens
    with torch.no_grad():
        for _ in range(24):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, want)
    sampled = model.generate(tokens, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (3, 13) and torch.equal(sampled[:, :5], tokens)


def test_generate_bad_arguments():
    cfg = LongNetConfig(vocab_size=11, embed_dim=16, num_heads=2, num_layers=1, segment_lengths=(4,),
                        dilation_rates=(1,), backend="torch")
    model = LongNet(cfg)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(tokens, -1)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(tokens, 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="page_size"):
        model.generate(tokens, 2, page_size=0)
    with pytest.raises(ValueError, match="tokens"):
        model.generate(tokens.float(), 2)
    with pytest.raises(ValueError, match="causal"):
        LongNet(LongNetConfig(vocab_size=11, embed_dim=16, num_heads=2, num_layers=1, segment_lengths=(4,),
                              dilation_rates=(1,), causal=False)).generate(tokens, 2)


def test_decode_takes_an_int_length_and_prefill_names_a_cache_that_does_not_fit():
    """``decode`` with rotary embeddings takes the length as an int, as the KV-cache functions do; ``prefill`` names
    a cache too short for the prompt, of other heads, or of another batch."""
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(32, 4, (4, 8), (1, 2), num_kv_heads=2, causal=True, rotary=True,
                                     backend="torch").double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x)
        kc, vc = (torch.zeros(2, 12, 2, 8, dtype=torch.float64) for _ in range(2))
        first = attn.prefill(x[:, :6], kc, vc)
        rest = attn.decode(x[:, 6:], kc, vc, 6)
        torch.testing.assert_close(torch.cat([first, rest], dim=1), want)
        with pytest.raises(ValueError, match="cache holds 4 rows a sequence, fewer than the prompt's 6 tokens"):
            attn.prefill(x[:, :6], kc[:, :4], vc[:, :4])
        with pytest.raises(ValueError, match=r"k_cache must be \(2, max_len, 2, 8\)"):
            attn.prefill(x[:, :6], torch.zeros(2, 12, 4, 8, dtype=torch.float64), vc)
        with pytest.raises(ValueError, match="k_cache must have batch 2"):
            attn.prefill(x[:, :6], kc[:1], vc[:1])
        with pytest.raises(ValueError, match="cache_seqlens must be an int or a"):
            attn.decode(x[:, 6:], kc, vc, torch.tensor([6]))


@pytest.mark.parametrize("kw,error", [
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature="1"), "temperature must be a finite number >= 0"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(top_k=True), "top_k must be a positive int or None"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 0"),
])
def test_generate_names_a_bad_sampling_argument(kw, error):
    cfg = LongNetConfig(vocab_size=11, embed_dim=16, num_heads=2, num_layers=1, segment_lengths=(4,),
                        dilation_rates=(1,), backend="torch")
    model = LongNet(cfg).eval()
    args = dict(max_new_tokens=2) | kw
    with pytest.raises(ValueError, match=error):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **args)


@pytest.mark.parametrize("page_size", [None, 4])
def test_generate_under_autocast_caches_the_autocast_dtype(page_size):
    """Under torch.autocast the projections give bfloat16 keys and values: generate's cache holds that dtype (a
    float32 cache was refused by prefill, naming a k_cache the caller never gave), and the tokens are those of
    recomputing the whole sequence under the same autocast."""
    torch.manual_seed(2)
    cfg = LongNetConfig(vocab_size=40, embed_dim=32, num_heads=4, num_layers=2, segment_lengths=(4, 8),
                        dilation_rates=(1, 2), backend="torch")
    model = LongNet(cfg).eval()
    tokens = torch.randint(0, 40, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.generate(tokens, 4, page_size=page_size)
        want = tokens
        with torch.no_grad():
            for _ in range(4):
                want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got.shape == (2, 9)
    assert (got[:, 5:] == want[:, 5:]).float().mean() >= 0.75  # (bfloat16 rounding may break a near tie)


def test_decode_takes_a_numpy_int_length_as_the_kvcache_functions_do():
    import numpy as np
    torch.manual_seed(3)
    attn = MultiheadDilatedAttention(32, 2, (4,), (1,), causal=True, rotary=True, dtype=torch.float64).eval()
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    with torch.no_grad():
        outs = []
        for length in (3, np.int64(3)):
            kc, vc = torch.zeros(1, 8, 2, 16, dtype=torch.float64), torch.zeros(1, 8, 2, 16, dtype=torch.float64)
            attn.prefill(x[:, :3], kc, vc)
            outs.append(attn.decode(x[:, 3:], kc, vc, length))
    torch.testing.assert_close(outs[1], outs[0])


def test_prefill_outside_no_grad_leaves_the_cache_without_a_graph():
    """Outside torch.no_grad() prefill's output is differentiable, but the cache receives values only: it does not
    become part of (and keep alive) the prompt's autograd graph."""
    attn = MultiheadDilatedAttention(32, 2, (4,), (1,), causal=True, rotary=True, dtype=torch.float64)
    x = torch.randn(1, 3, 32, dtype=torch.float64, requires_grad=True)
    kc, vc = torch.zeros(1, 8, 2, 16, dtype=torch.float64), torch.zeros(1, 8, 2, 16, dtype=torch.float64)
    out = attn.prefill(x, kc, vc)
    assert out.requires_grad
    assert not kc.requires_grad and kc.grad_fn is None and not vc.requires_grad and vc.grad_fn is None
    with torch.no_grad():
        _, want_k, want_v = attn.project(x)
    torch.testing.assert_close(kc[:, :3], want_k)
    torch.testing.assert_close(vc[:, :3], want_v)


@pytest.mark.parametrize("max_new", [0, 2])
def test_generate_returns_a_new_int64_tensor_also_for_no_new_tokens_and_no_rows(max_new):
    cfg = LongNetConfig(vocab_size=20, embed_dim=16, num_heads=2, num_layers=1, segment_lengths=(4,),
                        dilation_rates=(1,), backend="torch")
    model = LongNet(cfg).eval()
    tokens = torch.randint(0, 20, (2, 3), dtype=torch.int32)
    got = model.generate(tokens, max_new)
    assert got is not tokens and got.dtype == torch.int64 and got.shape == (2, 3 + max_new)
    assert torch.equal(got[:, :3], tokens.long())
    empty = model.generate(torch.zeros(0, 3, dtype=torch.long), max_new)
    assert empty.shape == (0, 3 + max_new) and empty.dtype == torch.int64


def test_prefill_refuses_a_page_twice_among_the_pages_it_fills():
    """A block table naming one page for two sequences' prompts (or twice in one row): the second prompt's keys
    were written over the first's silently; refused by name."""
    attn = MultiheadDilatedAttention(32, 4, (4, 8), (1, 2), num_kv_heads=2, causal=True).eval()
    kc, vc = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    x = torch.randn(2, 6, 32)
    for table in ([[0, 1, 2], [3, 1, 4]], [[0, 0, 2], [3, 4, 5]]):
        with pytest.raises(ValueError, match=r"prefill: block_table names page [01] more than once among the 2 "
                                             r"pages a sequence's prompt fills"):
            attn.prefill(x, kc, vc, torch.tensor(table, dtype=torch.int32))
    attn.prefill(x, kc, vc, torch.tensor([[0, 1, 5], [3, 4, 5]], dtype=torch.int32))  # (page 5 unused: taken)


def test_prefill_and_decode_write_caches_made_under_inference_mode():
    """Caches allocated under torch.inference_mode() and filled outside it, as the Triton kernels (and
    FlashAttention's) take them: PyTorch's in-place write raised "Inplace update to inference tensor"."""
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(32, 4, (4, 8), (1, 2), num_kv_heads=2, causal=True, rotary=True).eval()
    x = torch.randn(2, 7, 32)
    with torch.inference_mode():
        kc, vc = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    with torch.no_grad():
        want = attn(x)
        got = torch.cat([attn.prefill(x[:, :5], kc, vc), attn.decode(x[:, 5:], kc, vc, 5)], 1)
    torch.testing.assert_close(got, want)


def test_generate_page_size_is_checked_by_generate_as_an_int_not_a_bool():
    """A new user's review: ``page_size=True`` ran as pages of one token (a bool taken as an int, where the package
    refuses bools as ints), a bad page size was named by the internal ``KVCache``, and NumPy ints (taken as ints by
    the attention functions, ``cache_seqlens=np.int64(n)``) were refused for ``page_size``, ``max_new_tokens`` and
    ``top_k``."""
    np = pytest.importorskip("numpy")
    cfg = LongNetConfig(vocab_size=11, embed_dim=16, num_heads=2, num_layers=1, segment_lengths=(4,),
                        dilation_rates=(1,), backend="torch")
    model = LongNet(cfg)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match="LongNet.generate: page_size must be a positive int"):
            model.generate(tokens, 2, page_size=bad)
    with pytest.raises(ValueError, match="KVCache: page_size"):
        KVCache(1, 1, 4, 2, 8, page_size=True)
    want = model.generate(tokens, 3, temperature=1.0, top_k=2, page_size=2, generator=torch.Generator().manual_seed(0))
    got = model.generate(tokens, np.int64(3), temperature=1.0, top_k=np.int64(2), page_size=np.int32(2),
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)
