"""Arguments far past the inputs (a dilation rate, segment, block size or pattern size of 10**12), ranks that do
not exist, NumPy flags and packed FP8 input: each is either computed in time and memory independent of the size
(with the answer of an equivalent small argument) or refused with a named TypeError/ValueError. PyTorch backend on
the CPU."""
from __future__ import annotations

import contextlib
import signal

import numpy as np
import pytest
import torch

import longattn
from longattn import reference
from longattn.call import Branch, dilated_branches
from longattn.distributed import local_cu_seqlens, local_positions
from longattn.distributed.shards import take_shard
from longattn.patterns import Dilated, GlobalTokens, Hierarchical, Local, Random
from longattn.utils import cu_seqlens_of, pad_input

HUGE = 10 ** 12


@contextlib.contextmanager
def within(seconds: float):
    """Fails the test (TimeoutError) if the block runs longer than ``seconds``: a hang or an allocation growing
    with a huge argument is cut short instead of filling the memory."""
    def expired(*_):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _qkv(b=2, n=19, hq=4, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for h in (hq, hk, hk)]


# ------------------------------------------------------------------------------------------- huge dilation rates


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_attention_with_a_rate_past_the_sequence_matches_the_reference(causal):
    """Head ``h`` selects offset ``h % r``; with ``r`` past the sequence only its offset row of each segment."""
    q, k, v = _qkv()
    kw = dict(segment_lengths=(8, HUGE, 4), dilation_rates=(HUGE, HUGE, 2), causal=causal)
    with within(5):
        out, lse = longattn.dilated_attention(q, k, v, backend="torch", return_lse=True, **kw)
    want, want_lse = reference.dilated_attention(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_dilated_attention_varlen_with_a_rate_past_the_sequences_matches_the_reference():
    q, k, v = (x[0, :19] for x in _qkv(b=1))
    cu = cu_seqlens_of([7, 0, 12])
    kw = dict(segment_lengths=(8, 5), dilation_rates=(HUGE, 3), causal=True)
    with within(5):
        out = longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu, backend="torch", **kw)
    torch.testing.assert_close(out, reference.dilated_attention_varlen(q, k, v, cu_seqlens=cu, **kw))


def test_a_rate_past_segment_heads_and_branches_is_cut_to_them():
    """The branches of a call never carry the astronomical rate (the kernels get a small int): it is cut to the
    largest of the segment, the heads and the branches, which keeps every head's offset and one row per segment."""
    (branch,) = dilated_branches(100, 6, (HUGE,), (HUGE,), head_split=False)
    assert (branch.segment, branch.dilation, branch.offset) == (100, 100, None)
    (branch,) = dilated_branches(3, 6, (8,), (HUGE,), head_split=False)
    assert (branch.segment, branch.dilation) == (3, 6)
    assert [b.dilation for b in dilated_branches(4, 2, (2, 2, 2), (5, 7, 1), head_split=False)] == [3, 3, 1]


def test_the_torch_backend_offsets_of_a_branch_cost_its_heads_not_its_rate():
    from longattn.backends.torch.chunked import _branch_offsets

    with within(2):
        offsets = _branch_offsets(Branch(8, HUGE, 2, 3))
    assert offsets == {2: slice(2, 5, HUGE), 3: slice(3, 5, HUGE), 4: slice(4, 5, HUGE)}
    assert _branch_offsets(Branch(8, 3, 1, 6)) == {1: slice(1, 7, 3), 2: slice(2, 7, 3), 0: slice(3, 7, 3)}


def test_dilated_kvcache_with_a_huge_rate_and_segment_equals_the_small_equivalent():
    """A segment past the cache's capacity (16 rows) is the whole cache, a rate past it and the 4 heads leaves each
    head its own offset: (16, 16) is the equivalent small branch, and the branches the call hands to the backends
    (whose Triton decode reads them as int32) hold no value past the cache."""
    from longattn import kvcache

    q, k, v = _qkv(b=2, n=1, hq=4, hk=2)
    cache_k, cache_v = (torch.randn(2, 16, 2, 8, dtype=torch.float64) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor([9, 15], dtype=torch.int32), backend="torch")
    kvcache._CHECKED.clear()  # (the checks of earlier calls)
    with within(5):
        got = longattn.dilated_attention_with_kvcache(q, cache_k, cache_v, segment_lengths=(HUGE, 4),
                                                      dilation_rates=(HUGE, 2), **kw)
    want = longattn.dilated_attention_with_kvcache(q, cache_k, cache_v, segment_lengths=(16, 4),
                                                   dilation_rates=(16, 2), **kw)
    torch.testing.assert_close(got, want)
    checked = [c for c in kvcache._CHECKED.values() if len(c.branches) == 2]
    assert checked and all(b.segment <= 32 and b.dilation <= 32 for c in checked for b in c.branches)


# ------------------------------------------------------------------------------------------- huge sizes elsewhere


@pytest.mark.parametrize("block_size", [HUGE, (HUGE, 8), 2 ** 40])
def test_block_sparse_block_larger_than_the_sequence_is_that_sequence(block_size):
    q, k, v = _qkv(n=19)
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    mask = torch.ones(1, 1, 1, -(-19 // bk), dtype=torch.bool)
    mask[..., -1] = bk > 19  # a block of keys left out when there are several
    with within(5):
        out = longattn.block_sparse_attention(q, k, v, block_mask=mask, block_size=block_size, causal=True,
                                              backend="torch")
    want = reference.block_sparse_attention(q, k, v, block_mask=mask, block_size=(19, min(bk, 19)), causal=True)
    torch.testing.assert_close(out, want)


def test_the_torch_backend_block_sparse_path_never_sizes_a_temporary_by_the_block():
    from longattn.backends.torch.chunked import block_sparse_attention

    q, k, v = _qkv(n=5)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    with within(5):
        out, _ = block_sparse_attention(q, k, v, block_mask=mask, block_size=(HUGE, HUGE), causal=False, scale=0.3)
    torch.testing.assert_close(out, reference.flash_attention(q, k, v, scale=0.3))


def test_fit_block_size_keeps_a_kernel_block_size_a_power_of_two():
    from longattn._validation import fit_block_size

    assert fit_block_size((2 ** 40, 10 ** 12), 19, 100) == (32, 128)
    assert fit_block_size((16, 64), 19, 100) == (16, 64)
    assert fit_block_size((2 ** 40, 2 ** 40), 3, 0) == (16, 16)


@pytest.mark.parametrize("pattern", [Local(10 ** 30), GlobalTokens(10 ** 30), Dilated([2 ** 70], [2 ** 70]),
                                     Hierarchical(HUGE, base=10 ** 30)], ids=repr)
def test_pattern_sizes_past_the_grid_draw_the_same_mask_as_the_grid_bound(pattern):
    small = {"Local": Local(100), "GlobalTokens": GlobalTokens(100), "Dilated": Dilated([100], [100]),
             "Hierarchical": Hierarchical(8, base=100)}[type(pattern).__name__]
    with within(5):
        got = pattern.mask(80, 200, block_size=16, heads=3)
    assert torch.equal(got, small.mask(80, 200, block_size=16, heads=3))


def test_random_pattern_seed_past_a_generator_seed_is_a_value_error():
    with pytest.raises(ValueError, match=r"Random: seed must be an int in \[0, 2\*\*64\)"):
        Random(0.5, seed=2 ** 70)


def test_cu_seqlens_of_a_total_past_int32_is_a_value_error():
    with pytest.raises(ValueError, match=r"cu_seqlens_of: the lengths add up to 1099511627776 or more.*2\*\*31"):
        cu_seqlens_of([2 ** 40])
    with pytest.raises(ValueError, match=r"cu_seqlens_of: the lengths add up to 2147483648"):
        cu_seqlens_of([2 ** 30, 2 ** 30])
    assert cu_seqlens_of([2 ** 31 - 1]).tolist() == [0, 2 ** 31 - 1]
    with pytest.raises(TypeError,
                       match=r"cu_seqlens_of: lengths must be a sequence of ints in the batch.s order .*got int"):
        cu_seqlens_of(5)


@pytest.mark.parametrize("indices, batch, seqlen, message", [
    (torch.arange(10) + 100, 2, 12, r"indices must lie in \[0, batch \* seqlen\) = \[0, 24\), got values in "
                                    r"\[100, 109\]"),
    (torch.arange(10) - 1, 2, 12, r"got values in \[-1, 8\]"),
    (torch.arange(10), 1, 5, r"x has 10 rows, more than batch \* seqlen = 5"),
    (torch.arange(9), 2, 12, r"indices must hold one row per row of x \(10\), got 9"),
    (torch.arange(10), -1, 12, r"batch must be an int >= 0, got -1"),
    (torch.tensor([0, 0, 1, 2, 3, 3, 3, 7, 8, 9]), 2, 12, r"indices must be distinct rows .* got 3 row\(s\) repeating an earlier index"),
])
def test_pad_input_indices_outside_the_padded_batch_or_repeated_are_a_value_error(indices, batch, seqlen, message):
    with pytest.raises(ValueError, match=rf"^pad_input: .*{message}"):
        pad_input(torch.randn(10, 3), indices, batch, seqlen)


def test_pad_input_refuses_float_indices_and_takes_int32_ones():
    x = torch.randn(3, 2)
    with pytest.raises(TypeError, match=r"pad_input: indices must be a 1-D int64 \(or int32\) tensor"):
        pad_input(x, torch.arange(3.0), 1, 4)
    out = pad_input(x, torch.tensor([0, 2, 3], dtype=torch.int32), 1, 4)
    assert torch.equal(out[0, [0, 2, 3]], x) and not out[0, 1].any()


# ------------------------------------------------------------------------------------- ranks that do not exist


@pytest.mark.parametrize("rank, world", [(5, 2), (-1, 2), (2, 2), (0, 0)])
def test_local_positions_of_a_rank_outside_the_world_is_a_value_error(rank, world):
    with pytest.raises(ValueError, match=rf"local_positions: world must be >= 1 and rank in \[0, world\), got "
                                         rf"rank={rank}, world={world}"):
        local_positions(8, "zigzag", rank, world)


def test_rank_arguments_must_be_ints():
    with pytest.raises(TypeError, match=r"local_positions: rank must be an int, got bool True"):
        local_positions(8, "zigzag", True, 2)
    with pytest.raises(TypeError, match=r"local_cu_seqlens: world must be an int, got float 2.0"):
        local_cu_seqlens(cu_seqlens_of([4, 4]), "contiguous", 0, 2.0)
    with pytest.raises(ValueError, match=r"take_shard: world must be >= 1 and rank in \[0, world\), got rank=3"):
        take_shard(torch.zeros(1, 8), "contiguous", 3, 2)
    with pytest.raises(ValueError, match=r"local_positions: n_local must be an int >= 0"):
        local_positions(-4, "contiguous", 0, 2)
    assert local_positions(8, "zigzag", np.int64(1), 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


# --------------------------------------------------------------------------------- head_split with too few heads


def test_head_split_with_more_branches_than_heads_is_a_value_error():
    q, k, v = _qkv(hq=2, hk=2)
    kw = dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), head_split=True, backend="torch")
    words = r"head_split=True runs branch i on head group i.*got 3 branches \(segment_lengths\) for 2 heads"
    with pytest.raises(ValueError, match=rf"^dilated_attention: {words}"):
        longattn.dilated_attention(q, k, v, **kw)
    cu = cu_seqlens_of([19])
    with pytest.raises(ValueError, match=rf"^dilated_attention_varlen: {words}"):
        longattn.dilated_attention_varlen(q[0], k[0], v[0], cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match=rf"^dilated_attention_with_kvcache: {words}"):
        longattn.dilated_attention_with_kvcache(q[:, :1], k, v, cache_seqlens=3, **kw)
    with pytest.raises(ValueError, match=rf"^MultiheadDilatedAttention: {words}"):
        longattn.nn.MultiheadDilatedAttention(16, 2, (4, 8, 16), (1, 2, 4), head_split=True)
    longattn.dilated_attention(q, k, v, **{**kw, "head_split": False})  # per-head offsets: any number of branches


# ------------------------------------------------------------------------------------------------ NumPy flags


def test_numpy_bools_are_flags_and_numpy_ints_and_strings_are_not():
    q, k, v = _qkv()
    seg = dict(segment_lengths=(8,), dilation_rates=(2,), backend="torch")
    got = longattn.dilated_attention(q, k, v, causal=np.bool_(True), head_split=np.False_, **seg)
    torch.testing.assert_close(got, longattn.dilated_attention(q, k, v, causal=True, **seg))
    out, _ = longattn.block_sparse_attention(q, k, v, block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool),
                                             block_size=16, causal=np.True_, return_lse=np.True_, backend="torch")
    torch.testing.assert_close(out, reference.flash_attention(q, k, v, causal=True))
    _, descale = longattn.quantize_fp8(q.float(), per_head=np.True_)
    assert descale.shape == (2, 4)
    for bad in (np.int64(1), "True", 1):
        with pytest.raises(TypeError, match=r"dilated_attention: causal must be a bool"):
            longattn.dilated_attention(q, k, v, causal=bad, **seg)


# --------------------------------------------------------------------------------------------- packed FP8 input


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_quantize_fp8_of_a_packed_batch_gives_per_sequence_descales_flash_attention_varlen_takes(kv_heads):
    g = torch.Generator().manual_seed(1)
    lengths = [5, 0, 11, 3]
    cu = cu_seqlens_of(lengths)
    scale = torch.tensor([1.0, 1.0, 30.0, 0.01]).repeat_interleave(torch.tensor(lengths))[:, None, None]
    q = torch.randn(19, 4, 16, generator=g) * scale
    k, v = (torch.randn(19, 2, 16, generator=g) * scale for _ in range(2))
    q8, dq = longattn.quantize_fp8(q, per_head=True, kv_heads=2, cu_seqlens=cu)
    k8, dk = longattn.quantize_fp8(k, per_head=True, kv_heads=kv_heads, cu_seqlens=cu)
    v8, dv = longattn.quantize_fp8(v, per_head=True, cu_seqlens=cu)
    assert dq.shape == dk.shape == dv.shape == (4, 2)
    assert torch.equal(dq[1], torch.ones(2))  # the empty sequence: factor 1
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))

    def dequantised(x8, d):
        return x8.float() * d.repeat_interleave(x8.shape[1] // d.shape[1], 1)[seq][..., None]

    for x, x8, d in ((q, q8, dq), (k, k8, dk), (v, v8, dv)):  # within FP8's rounding, per sequence's range
        torch.testing.assert_close(dequantised(x8, d), x, atol=0.07 * scale.max().item(), rtol=0.07)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend="torch")
    out = longattn.flash_attention_varlen(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv,
                                          out_dtype=torch.float32, **kw)
    want = longattn.flash_attention_varlen(dequantised(q8, dq), dequantised(k8, dk), dequantised(v8, dv), **kw)
    torch.testing.assert_close(out, want)


def test_quantize_fp8_of_a_packed_batch_per_tensor_needs_no_cu_seqlens():
    x = torch.randn(7, 2, 8)
    x8, d = longattn.quantize_fp8(x)
    assert x8.shape == x.shape and d.shape == (1,)
    with pytest.raises(ValueError, match=r"quantize_fp8: a packed x \(total, heads, head_dim\) with per_head=True "
                                         r"needs its cu_seqlens"):
        longattn.quantize_fp8(x, per_head=True)
    with pytest.raises(ValueError, match=r"quantize_fp8: cu_seqlens goes with a packed x"):
        longattn.quantize_fp8(x[None], per_head=True, cu_seqlens=cu_seqlens_of([7]))
    with pytest.raises(ValueError, match=r"quantize_fp8: cu_seqlens must end at the packed length 7, got 6"):
        longattn.quantize_fp8(x, per_head=True, cu_seqlens=cu_seqlens_of([6]))


def test_ring_dilated_module_refuses_a_string_flag():
    """``RingDilatedAttention(causal="False")`` was read as True (``bool("False")``)."""
    from longattn.distributed.modules import RingDilatedAttention
    with pytest.raises(TypeError, match="RingDilatedAttention: causal must be a bool"):
        RingDilatedAttention([8], [1], causal="False")
    with pytest.raises(TypeError, match="head_split must be a bool"):
        RingDilatedAttention([8], [1], head_split=1)
    assert RingDilatedAttention([8], [1], causal=np.bool_(True)).causal is True
