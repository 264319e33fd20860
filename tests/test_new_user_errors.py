"""Clear errors for bad input to the KV cache, LongNet, quantize_fp8 and the nn layers (PyTorch backend on the CPU)."""
import warnings

import pytest
import torch

import longattn
from longattn import dilated_attention_with_kvcache, flash_attention_with_kvcache
from longattn.models import LongNet, LongNetConfig
from longattn.nn import MultiheadBlockSparseAttention, MultiheadDilatedAttention
from longattn.patterns import Local

B, HK, D = 2, 2, 16


@pytest.mark.parametrize("pages, page_size", [(4, 0), (0, 8), (0, 0)])
@pytest.mark.parametrize("dilated", [False, True])
def test_paged_cache_without_pages_or_rows_is_a_value_error(pages, page_size, dilated):
    q = torch.randn(B, 1, HK, D)
    cache = torch.randn(pages, page_size, HK, D)
    block_table = torch.zeros(B, 3, dtype=torch.int32)
    extra = {"segment_lengths": [4], "dilation_rates": [1]} if dilated else {}
    fn = dilated_attention_with_kvcache if dilated else flash_attention_with_kvcache
    with pytest.raises(ValueError, match=r"k_cache and v_cache need at least 1 page and a page size >= 1"):
        fn(q, cache, cache.clone(), cache_seqlens=0, block_table=block_table, backend="torch", **extra)


def test_int64_block_table_and_cache_seqlens_past_int32_are_checked_not_wrapped():
    """Values are checked before the cast to int32: 2**32 + 1 would wrap to page 1 (a silent wrong answer)."""
    q, cache = torch.randn(B, 1, HK, D), torch.randn(4, 8, HK, D)
    big = torch.full((B, 3), 2 ** 32 + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"block_table entries must index the 4 pages.*4294967297"):
        flash_attention_with_kvcache(q, cache, cache.clone(), cache_seqlens=5, block_table=big, backend="torch")
    lens = torch.full((B,), 2 ** 32 + 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"cache_seqlens \+ new tokens must lie in \[0, 24\].*4294967301"):
        flash_attention_with_kvcache(q, cache, cache.clone(), cache_seqlens=lens, block_table=big % 4,
                                     backend="torch")


def _longnet() -> LongNet:
    return LongNet(LongNetConfig(vocab_size=50, embed_dim=32, num_heads=4, num_layers=1, segment_lengths=[8],
                                 dilation_rates=[1], backend="torch"))


@pytest.mark.parametrize("bad, shown", [(50, r"\[0, 50\]"), (-1, r"\[-1, 7\]")])
def test_longnet_token_ids_outside_the_vocabulary_are_a_value_error(bad, shown):
    model = _longnet()
    tokens = torch.arange(16).reshape(2, 8) % 8
    tokens[1, 3] = bad
    calls = [lambda: model(tokens), lambda: model(tokens, tokens.clamp(min=0)), lambda: model.generate(tokens, 2)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"LongNet: tokens must be token ids in \[0, 50\) \(vocab_size\), got "
                                             rf"values in {shown}"):
            call()


def test_longnet_targets_outside_the_vocabulary_are_a_value_error_except_ignore_index():
    model = _longnet()
    tokens = torch.arange(16).reshape(2, 8) % 8
    targets = tokens.clone()
    targets[0, 0] = -100  # ignored
    assert torch.isfinite(model(tokens, targets))
    targets[1, 1] = 60
    with pytest.raises(ValueError, match=r"targets \(other than ignore_index -100\) must be token ids in \[0, 50\)"):
        model(tokens, targets)
    with pytest.raises(ValueError, match=r"targets must be an int64 tensor"):
        model(tokens, tokens.int())


def test_longnet_id_check_skips_meta_tensors():
    config = _longnet().config
    model = LongNet(config, device="meta")
    assert model(torch.zeros(2, 8, dtype=torch.long, device="meta")).shape == (2, 8, 50)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_quantize_fp8_refuses_non_finite_input(per_head, bad):
    x = torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)
    x[1, 2, 1, 3] = bad
    with pytest.raises(ValueError, match=r"quantize_fp8: x has non-finite values"):
        longattn.quantize_fp8(x, per_head=per_head)


@pytest.mark.parametrize("flag", ["False", 1, None])
def test_quantize_fp8_per_head_must_be_a_bool(flag):
    x = torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"quantize_fp8: per_head must be a bool"):
        longattn.quantize_fp8(x, per_head=flag)


def test_quantize_fp8_still_takes_bools_and_empty_input():
    x = torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)
    assert longattn.quantize_fp8(x, per_head=torch.tensor(True))[1].shape == (2, 2)
    assert longattn.quantize_fp8(x, per_head=False)[1].shape == (1,)
    assert torch.equal(longattn.quantize_fp8(x[:, :0], per_head=True)[1], torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"quantize_fp8: x must have dtype float16, bfloat16, float32 or float64"):
        longattn.quantize_fp8(torch.zeros(2, 8, 2, 16, dtype=torch.int64))


def _layers():
    return [MultiheadDilatedAttention(32, 4, [8], [1], backend="torch"),
            MultiheadBlockSparseAttention(32, 4, Local(1).builder(block_size=8), backend="torch")]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_nn_layers_advise_a_floating_dtype_for_non_floating_input(dtype):
    x = torch.zeros(2, 8, 32, dtype=dtype)
    for layer in _layers():
        with pytest.raises(TypeError, match=r"x must be a floating-point tensor .* x\.to\(torch\.float32\)") as info:
            layer(x)
        assert f"layer.to({dtype})" not in str(info.value)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="floating-point"):
            layer(x)


def test_nn_layers_float64_input_under_autocast_is_a_type_error():
    """Autocast leaves float64 alone, so it cannot reconcile float64 input with float32 parameters."""
    x = torch.zeros(2, 8, 32, dtype=torch.float64)
    for layer in _layers():
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=r"layer\.to\(torch\.float64"):
            layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x.float()).dtype == torch.bfloat16


def test_appending_to_an_expanded_cache_is_a_value_error():
    """An expanded cache (every batch row the same memory) would take sequence 0's new rows over sequence 1's."""
    q, new = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 2, 8)
    cache = torch.randn(1, 10, 2, 8).expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="k_cache has elements that share memory"):
        longattn.flash_attention_with_kvcache(q, cache, cache.clone(), new, new.clone(),
                                              cache_seqlens=torch.tensor([3, 6], dtype=torch.int32))
    out = longattn.flash_attention_with_kvcache(q, cache, cache, cache_seqlens=4)  # reading it is fine
    want = longattn.flash_attention(q, cache[:, :4], cache[:, :4], causal=True, backend="torch")
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("dilated", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_decode_with_no_sequence_or_no_cache_rows(dilated, append):
    """A batch of no sequences gives an empty result; a cache of no rows (nothing cached, nothing appended) zeros."""
    fn = longattn.dilated_attention_with_kvcache if dilated else longattn.flash_attention_with_kvcache
    extra = {"segment_lengths": [4], "dilation_rates": [1]} if dilated else {}
    q, new = torch.randn(0, 2, 4, 8), torch.randn(0, 2, 2, 8)
    cache = torch.zeros(0, 10, 2, 8)
    kv = (new, new.clone()) if append else ()
    out = fn(q, cache, cache.clone(), *kv, cache_seqlens=torch.zeros(0, dtype=torch.int32), **extra)
    assert out.shape == (0, 2, 4, 8)
    if not append:
        empty = torch.zeros(2, 0, 2, 8)
        out = fn(torch.randn(2, 2, 4, 8), empty, empty.clone(), cache_seqlens=0, **extra)
        assert out.shape == (2, 2, 4, 8) and (out == 0).all()


@pytest.mark.parametrize("args, kw, match", [(([1, 2, 3],), {}, "shard: x must be a torch.Tensor, got list"),
                                             ((torch.zeros(1, 8, 2, 4),), {"dim": 1.0}, "shard: dim must be an int")])
def test_shard_names_itself_in_type_errors(args, kw, match):
    from longattn.distributed import shard
    with pytest.raises(TypeError, match=match):
        shard(*args, **kw)


def test_shard_of_a_packed_tensor_along_the_wrong_dim_says_which_length_it_read(tmp_path):
    """``shard(x, cu_seqlens=cu)`` on a packed ``(total, heads, head_dim)`` tensor without ``dim=0`` read the heads'
    count as the packed length; the message now says so."""
    import torch.distributed as dist

    from longattn.distributed import shard
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        x, cu = torch.randn(16, 4, 8), torch.tensor([0, 5, 16], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"must end at the packed length 4, got 16 \(the packed length is x's "
                                             r"size along dim=1; a packed \(total, heads, head_dim\) tensor needs "
                                             r"dim=0\)"):
            shard(x, cu_seqlens=cu)
        assert shard(x, cu_seqlens=cu, dim=0).shape == x.shape
    finally:
        if made:
            dist.destroy_process_group()


def test_explicit_backward_names_a_wrong_output_or_lse_shape():
    from longattn import ops
    q = torch.randn(2, 6, 4, 16)
    k = v = torch.randn(2, 10, 2, 16)
    o, lse = ops.attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"attention_backward: lse must have shape \(2, 4, 6\)"):
        ops.attention_backward(torch.randn_like(o), q, k, v, o, lse[:, :, :3])
    with pytest.raises(ValueError, match=r"attention_backward: o must have shape \(2, 6, 4, 16\)"):
        ops.attention_backward(torch.randn_like(o), q, k, v, o[:, :3], lse)
    with pytest.raises(ValueError, match=r"attention_backward: do must have shape"):
        ops.attention_backward(o[:, :3], q, k, v, o, lse)


def test_explicit_backward_names_a_gradient_of_another_dtype():
    """A float32 ``do`` beside float16 inputs (the gradient of a merged float32 output) reached the Triton kernel's
    product and failed there; it is refused by name on every backend (FlashAttention's rule)."""
    from longattn import ops
    q = torch.randn(1, 5, 2, 16).half()
    o, lse = ops.attention_forward(q, q, q, causal=True, out_dtype=torch.float32)
    for backend in ("torch", "auto"):
        with pytest.raises(TypeError, match=r"attention_backward: do must have q's dtype torch.float16, got "
                                            r"torch.float32"):
            ops.attention_backward(o, q, q, q, o, lse, causal=True, backend=backend, grad_dtype=torch.float32)
    dq, dk, dv = ops.attention_backward(o.half(), q, q, q, o, lse, causal=True, grad_dtype=torch.float32)
    assert dq.dtype == torch.float32 and torch.isfinite(dq).all()


def test_explicit_backward_names_a_log_sum_exp_or_output_of_another_dtype():
    """An lse in half precision or an integer dtype gave gradients off by up to 1 on the PyTorch backend (and was
    read as float32 by the kernels); an output in another dtype than q's or float32 too: both refused by name."""
    from longattn import ops
    q = torch.randn(1, 5, 2, 16).half()
    o, lse = ops.attention_forward(q, q, q)
    do = torch.randn_like(o)
    for bad in (torch.float16, torch.float64, torch.int64):
        with pytest.raises(TypeError, match=rf"attention_backward: lse must be torch.float32 \(as attention_forward "
                                            rf"returns it for torch.float16 inputs\), got {bad}"):
            ops.attention_backward(do, q, q, q, o, lse.to(bad))
    with pytest.raises(TypeError, match=r"attention_backward: o must have q's dtype torch.float16 or be "
                                        r"torch.float32, got torch.bfloat16"):
        ops.attention_backward(do, q, q, q, o.bfloat16(), lse)
    q64 = q.double()
    o64, lse64 = ops.attention_forward(q64, q64, q64)
    assert lse64.dtype == torch.float64
    for lse_ in (lse64, lse64.float()):  # float64 inputs: their own float64 lse, or a float32 one
        dq, _, _ = ops.attention_backward(o64, q64, q64, q64, o64, lse_)
        assert torch.isfinite(dq).all()


def test_rotate_qk_names_its_seed_and_mixed_layouts():
    q = torch.randn(1, 4, 2, 8)
    for seed in (None, 1.5, True):
        with pytest.raises(TypeError, match="rotate_qk: seed must be an int"):
            longattn.rotate_qk(q, q, seed=seed)
    with pytest.raises(ValueError, match="rotate_qk: q and k must both be batch-first"):
        longattn.rotate_qk(q, q[0])


def test_kvcache_lengths_of_the_wrong_kind_say_an_int_is_allowed():
    q, c = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="cache_seqlens must be an int or a torch.Tensor"):
        longattn.flash_attention_with_kvcache(q, c, c, cache_seqlens=True)


def test_utils_is_an_attribute_after_import_longattn():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", "import longattn; print(longattn.utils.cu_seqlens_of.__name__)"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "cu_seqlens_of" in done.stdout, done.stderr


def test_a_second_derivative_is_refused_where_the_kernels_cannot_give_it_and_exact_where_they_can():
    """The Triton kernels' gradients carry no autograd graph: create_graph=True raises (it silently gave a zero
    second derivative); the PyTorch backend differentiates twice, as the reference."""
    from longattn import reference
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 7, 2, 16, generator=g, dtype=torch.float32).requires_grad_() for _ in range(3))
    out = longattn.flash_attention(q, k, v, causal=True, backend="triton")
    with pytest.raises(RuntimeError, match=r"backend 'triton'.*second derivatives.*backend='torch'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    for fn in (lambda *a: longattn.flash_attention(*a, causal=True, backend="torch"),
               lambda *a: reference.flash_attention(*a, causal=True)):
        dq, = torch.autograd.grad((fn(q64, k64, v64) ** 2).sum(), q64, create_graph=True)
        assert dq.requires_grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kvcache_out_whose_elements_share_memory_is_a_value_error(backend):
    """An ``out`` expanded over the batch (stride 0) would have one sequence's output written over another's (the
    Triton kernel did so silently); refused by name on every backend."""
    B, M, Hk, Hq, D = 2, 12, 2, 4, 16
    kc, vc = torch.randn(B, M, Hk, D).half(), torch.randn(B, M, Hk, D).half()
    q = torch.randn(B, 1, Hq, D).half()
    lens = torch.tensor([3, 7], dtype=torch.int32)
    expanded = torch.zeros(1, 1, Hq, D, dtype=torch.float16).expand(B, -1, -1, -1)
    # rows of 64 elements 32 apart: PyTorch's own check cannot tell this one (it says "too hard")
    strided = torch.zeros(256, dtype=torch.float16).as_strided((B, 1, Hq, D), (32, 64, 16, 1))
    for out in (expanded, strided):
        with pytest.raises(ValueError, match=r"flash_attention_with_kvcache: out has elements that share memory"):
            longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, out=out, backend=backend)
    strided_ok = torch.zeros(B, 2, Hq, D, dtype=torch.float16)[:, ::2]  # a strided view of its own memory
    assert longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, out=strided_ok,
                                                 backend=backend) is strided_ok
    fresh = torch.empty(B, 1, Hq, D, dtype=torch.float16)  # its own memory: accepted, written in place
    assert longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, out=fresh, backend=backend) is fresh


def test_block_sparse_layer_checks_its_pattern_heads_when_built():
    pattern = longattn.patterns.Random(0.5).build(40, block_size=16, heads=4)
    with pytest.raises(ValueError, match=r"^MultiheadBlockSparseAttention: pattern has a mask for 4 heads; it must "
                                         r"have 1 \(shared\) or num_heads=2$"):
        MultiheadBlockSparseAttention(32, 2, pattern)
    assert MultiheadBlockSparseAttention(32, 4, pattern)(torch.randn(1, 40, 32)).shape == (1, 40, 32)
    # The function's own message says "1" where the inputs have one batch row or head, not "1 or 1".
    q = torch.randn(1, 40, 2, 8)
    with pytest.raises(ValueError, match=r"block_mask must have shape \(1, 2 or 1, 3, 3\)"):
        longattn.block_sparse_attention(q, q, q, block_mask=pattern.mask, block_size=16)


def test_a_mask_of_another_block_size_says_which_one_it_fits():
    """A mask built with 16-token blocks, passed without its block_size: the message said only the shape wanted for
    the default 128."""
    q = torch.randn(1, 64, 2, 8)
    mask = longattn.patterns.local(1, n=64, block_size=16)
    with pytest.raises(ValueError, match=r"got \(1, 1, 4, 4\) \(a 4 x 4 grid is that of block_size=16; pass the "
                                         r"block_size the mask was built with, the default being 128\)$"):
        longattn.block_sparse_attention(q, q, q, block_mask=mask)
    with pytest.raises(ValueError, match=r"block_size=\(16, 24\)"):  # (a grid of two block sizes)
        longattn.block_sparse_attention(q, q[:, :48], q[:, :48], block_mask=torch.ones(1, 1, 4, 2, dtype=torch.bool),
                                        block_size=32)
    torch.testing.assert_close(longattn.block_sparse_attention(q, q, q, block_mask=mask, block_size=16),
                               longattn.reference.block_sparse_attention(q, q, q, block_mask=mask, block_size=16),
                               atol=1e-5, rtol=1e-5)


def test_a_long_sequence_in_sdpas_layout_warns():
    """Self-attention in SDPA's (B, H, N, D) layout passes every check as (B, N, H, D) and attends across heads; with
    a long sequence it has the shape of hundreds of heads over a few positions, which gets a warning. Calls with
    as many heads as usual, or more positions than heads, get none."""
    q = torch.randn(1, 8, 512, 16)  # (B=1, H=8, N=512) in SDPA's layout
    with pytest.warns(UserWarning, match=r"has 512 heads over 8 positions.*pass q\.transpose\(1, 2\)"):
        longattn.flash_attention(q, q, q, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        longattn.flash_attention(*(torch.randn(1, 600, 512, 16) for _ in range(3)))  # (more positions than heads)
        longattn.flash_attention(torch.randn(1, 1, 128, 16), *(torch.randn(1, 64, 8, 16) for _ in range(2)))


def test_quantize_fp8_names_itself_in_argument_errors():
    with pytest.raises(TypeError, match=r"^quantize_fp8\(\) got an unexpected keyword argument 'layout'"):
        longattn.quantize_fp8(torch.randn(1, 4, 2, 8), layout="bshd")


def test_nested_tensors_are_refused_up_front_pointing_to_varlen():
    """SDPA takes nested tensors; the attention functions take packed ones with cu_seqlens, and say so (they
    failed inside SDPA or PyTorch's nested-tensor code)."""
    parts = [torch.randn(5, 2, 8), torch.randn(7, 2, 8)]
    for layout in (torch.jagged, torch.strided):
        nt = torch.nested.nested_tensor(parts, layout=layout)
        with pytest.raises(TypeError, match=r"^flash_attention: q is a nested tensor.*flash_attention_varlen"):
            longattn.flash_attention(nt, nt, nt)
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^flash_attention_varlen: q is a nested tensor.*offsets"):
        longattn.flash_attention_varlen(nt, nt, nt, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_block_sparse_layer_checks_its_head_dim_when_built():
    with pytest.raises(ValueError, match=r"^MultiheadBlockSparseAttention: head_dim = embed_dim // num_heads = 512 "
                                         r"exceeds 256"):
        MultiheadBlockSparseAttention(2048, 4, longattn.patterns.Random(0.5))


@pytest.mark.parametrize("argv, words", [(["--seq", "0"], "--seq must be a positive"),
                                         (["--device", "foo"], "--device must be cpu, cuda or cuda:N")])
def test_the_demo_refuses_bad_arguments_as_argparse_does(argv, words, capsys):
    from longattn import demo

    with pytest.raises(SystemExit) as done:
        demo.main(argv)
    assert done.value.code == 2 and words in capsys.readouterr().err


def test_fp8_and_scale_corners_a_review_found():
    """A float32 tensor whose largest magnitude's factor underflows quantises to zeros with factor 1 (was factor 0 and
    NaN values); finite float64 values beyond float32 are named as such (was "non-finite"); a scale beyond float32
    (NaN outputs) and rotate_qk's seeds and head dim are refused by name; a factor per query head of a grouped call
    says how to make one per key/value head."""
    import numpy as np
    x8, d = longattn.quantize_fp8(torch.tensor([1e-44, 0, -3e-45, 0]).reshape(1, 1, 1, 4))
    assert d.tolist() == [1.0] and torch.equal(x8.float().abs(), torch.zeros(1, 1, 1, 4))
    with pytest.raises(ValueError, match="quantize_fp8: x has values beyond float32's range"):
        longattn.quantize_fp8(torch.full((1, 2, 1, 4), 1e300, dtype=torch.float64))
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="flash_attention: scale must be at most float32's largest value"):
        longattn.flash_attention(q, q, q, scale=1e300)
    assert torch.equal(longattn.rotate_qk(q, q, seed=np.int64(2))[0], longattn.rotate_qk(q, q, seed=2)[0])
    with pytest.raises(ValueError, match=r"rotate_qk: seed must be an int in \[-2\*\*63, 2\*\*64\)"):
        longattn.rotate_qk(q, q, seed=2 ** 64)
    with pytest.raises(ValueError, match="rotate_qk: head_dim must be at least 1"):
        longattn.rotate_qk(q[..., :0], q[..., :0])
    qq, kk = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16)
    (q8, qd), (k8, kd) = longattn.quantize_fp8(qq, per_head=True), longattn.quantize_fp8(kk, per_head=True)
    with pytest.raises(ValueError, match=r"quantize_fp8\(q, per_head=True, kv_heads=2\)"):
        longattn.flash_attention(q8, k8, k8, q_descale=qd, k_descale=kd, v_descale=kd)


def test_generate_names_an_empty_prompt():
    model = _longnet()
    with pytest.raises(ValueError, match=r"LongNet.generate: tokens must hold at least one prompt token per row to "
                                         r"generate from, got shape \(2, 0\)"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 3)
    assert model.generate(torch.zeros(2, 0, dtype=torch.long), 0).shape == (2, 0)  # (nothing to generate)


def test_block_sparse_module_checks_its_flags():
    for name in ("bias", "causal", "deterministic"):
        with pytest.raises(TypeError, match=f"MultiheadBlockSparseAttention: {name} must be a bool"):
            MultiheadBlockSparseAttention(32, 4, Local(1).builder(block_size=8), **{name: "no"})


def test_kv_cache_out_error_says_what_was_passed():
    q = torch.randn(2, 1, 2, 16)
    cache = torch.zeros(2, 8, 2, 16)
    with pytest.raises(ValueError, match=r"out must be a tensor like q \(2, 1, 2, 16\) torch.float32 on cpu, got "
                                         r"\(2, 1, 2, 16\) torch.float64 on cpu"):
        flash_attention_with_kvcache(q, cache, cache, cache_seqlens=3, out=q.double())
    with pytest.raises(ValueError, match=r"on cpu, got list"):
        flash_attention_with_kvcache(q, cache, cache, cache_seqlens=3, out=[])


@pytest.mark.parametrize("table, error, match", [
    ([[-1], [0]], ValueError, r"block_table entries must index the 3 pages of k_cache, got values in \[-1, 0\]"),
    ([[5], [0]], ValueError, r"block_table entries must index the 3 pages of k_cache, got values in \[0, 5\]"),
    ([[0.0], [1.0]], TypeError, r"block_table must have dtype int32"),
])
def test_prefill_checks_its_block_table_before_writing(table, error, match):
    """A negative entry would have written another sequence's page (PyTorch indexing wraps it), a float table was
    taken, and an entry past the pool gave PyTorch's IndexError naming nothing."""
    m = MultiheadDilatedAttention(32, 4, [4], [1], causal=True)
    pages = torch.zeros(3, 4, 4, 8)
    bt = torch.tensor(table, dtype=torch.float32 if isinstance(table[0][0], float) else torch.int32)
    with torch.no_grad(), pytest.raises(error, match=r"^MultiheadDilatedAttention.prefill: " + match):
        m.prefill(torch.randn(2, 4, 32), pages, pages.clone(), block_table=bt)
    assert pages.abs().sum() == 0


def test_prefill_reads_only_the_pages_its_prompt_fills():
    """Pages past the prompt's are not written, so a table padded with -1 there (unallocated pages) is taken."""
    m = MultiheadDilatedAttention(32, 4, [4], [1], causal=True)
    pages = torch.zeros(3, 4, 4, 8)
    with torch.no_grad():
        m.prefill(torch.randn(2, 4, 32), pages, pages.clone(),
                  block_table=torch.tensor([[2, -1], [0, -1]], dtype=torch.int32))
    assert pages[1].abs().sum() == 0 and pages[0].abs().sum() > 0 and pages[2].abs().sum() > 0


def test_prefill_names_a_cache_of_another_dtype():
    m = MultiheadDilatedAttention(48, 6, [4, 8], [1, 2], num_kv_heads=2, causal=True)  # float32 parameters
    cache = torch.zeros(2, 8, 2, 8, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(TypeError, match=r"^MultiheadDilatedAttention.prefill: k_cache must have the "
                                                         r"dtype of the module's keys and values, torch.float32"):
        m.prefill(torch.randn(2, 6, 48), cache, cache.clone())


def test_ring_module_refuses_cached_generation_and_packed_batches():
    """Inherited unchanged, the ring module's prefill and decode ran the ring over the prompt with rotary positions
    from 0 and the cache filled as a shard's: wrong outputs on every rank but the first. They now refuse, as does
    a packed forward (its attention takes no cu_seqlens)."""
    from longattn.distributed import RingMultiheadDilatedAttention

    m = RingMultiheadDilatedAttention(32, 4, [4], [1], causal=True, rotary=True)
    x, cache = torch.randn(2, 4, 32), torch.zeros(2, 8, 4, 8)
    with pytest.raises(NotImplementedError, match=r"^RingMultiheadDilatedAttention.prefill: cached generation does "
                                                  r"not run across ranks"):
        m.prefill(x, cache, cache.clone())
    with pytest.raises(NotImplementedError, match=r"^RingMultiheadDilatedAttention.decode: .*MultiheadDilatedAttent"):
        m.decode(x[:, :1], cache, cache.clone(), cache_seqlens=4)
    with pytest.raises(ValueError, match=r"^RingMultiheadDilatedAttention: packed batches \(cu_seqlens\) are not"):
        m(x[0], cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.parametrize("args, kwargs, match", [
    (([4.7], [1]), {}, r"segment_lengths must hold ints, got 4.7"),
    ((4, 1), {}, r"segment_lengths must be a sequence of ints, got 4"),
    (([4], [1]), {"backend": "cuda"}, r"backend must be one of"),
    (([4], [1]), {"scale": -1.0}, r"scale must be positive and finite"),
    (([4, 8], [1]), {}, r"segment_lengths and dilation_rates must have the same length"),
])
def test_ring_dilated_module_checks_its_arguments_as_dilated_attention_does(args, kwargs, match):
    from longattn.distributed import RingDilatedAttention

    with pytest.raises((TypeError, ValueError), match=r"^RingDilatedAttention: " + match):
        RingDilatedAttention(*args, **kwargs)


def test_kvcache_refuses_slopes_that_need_a_gradient_after_a_warm_call():
    """The checks run once per call signature: the slopes' requires_grad was not in it, so a warm signature took
    what a cold one refused."""
    q, kc, vc = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    flash_attention_with_kvcache(q, kc, vc, cache_seqlens=2, alibi_slopes=torch.rand(2))
    with pytest.raises(ValueError, match="alibi_slopes must not require a gradient"):
        flash_attention_with_kvcache(q, kc, vc, cache_seqlens=2, alibi_slopes=torch.rand(2, requires_grad=True))


def test_varlen_shape_error_shows_the_shapes_given():
    q = k = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^flash_attention_varlen: k and v must have the same shape, got "
                                         r"\(8, 2, 16\) and \(7, 2, 16\)$"):
        longattn.flash_attention_varlen(q, k, torch.randn(7, 2, 16), cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("args, kwargs, error, match", [
    (([0], [1]), {}, ValueError, "segment_lengths must hold ints >= 1"),
    (([8], [1]), {"causal": "no"}, TypeError, "causal must be a bool"),
    (([8], [1]), {"head_split": 1}, TypeError, "head_split must be a bool"),
    (([8], [1]), {"backend": "fa4"}, ValueError, "backend must be 'auto', 'triton' or 'torch', got 'fa4'"),
])
def test_multihead_dilated_module_names_itself_in_its_attention_arguments_errors(args, kwargs, error, match):
    # the layer builds a DilatedAttention inside; its argument errors name the class the user constructed
    with pytest.raises(error, match=r"^MultiheadDilatedAttention: " + match):
        MultiheadDilatedAttention(32, 4, *args, **kwargs)


def test_multihead_block_sparse_module_names_itself_in_a_backend_error():
    with pytest.raises(ValueError, match=r"^MultiheadBlockSparseAttention: backend must be 'auto', 'triton' or "
                                         r"'torch', got 'fa4'"):
        MultiheadBlockSparseAttention(32, 4, Local(1).builder(block_size=8), backend="fa4")
