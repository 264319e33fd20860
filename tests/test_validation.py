"""Bad input raises ValueError or TypeError naming the argument and what is allowed."""
import pytest
import torch

import longattn


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


Q, K = t(2, 8, 4, 16), t(2, 10, 2, 16)


@pytest.mark.parametrize("args,kwargs,exc,words", [
    ((t(8, 4, 16), K, K), {}, ValueError, "4 dims"),
    ((Q, t(3, 10, 2, 16), t(3, 10, 2, 16)), {}, ValueError, "batch"),
    ((Q, t(2, 10, 2, 32), t(2, 10, 2, 32)), {}, ValueError, "head_dim"),
    ((Q, t(2, 10, 3, 16), t(2, 10, 3, 16)), {}, ValueError, "multiple"),
    ((Q, K, t(2, 11, 2, 16)), {}, ValueError, "same shape"),
    ((Q.int(), K.int(), K.int()), {}, TypeError, "dtype"),
    ((Q, K.double(), K.double()), {}, TypeError, "dtype"),
    ((Q, K, K), {"window": (1,)}, TypeError, "window"),
    ((Q, K, K), {"window": (-2, 0)}, ValueError, "window"),
    ((Q, K, K), {"scale": -1.0}, ValueError, "scale"),
    ((Q, K, K), {"scale": "x"}, TypeError, "scale"),
    ((Q, K, K), {"backend": "bogus"}, ValueError, "backend"),
    ((t(1, 4, 2, 300), t(1, 4, 2, 300), t(1, 4, 2, 300)), {}, ValueError, "head_dim"),
    (("q", K, K), {}, TypeError, "q must be a torch.Tensor"),
])
def test_flash_attention_errors(args, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        longattn.flash_attention(*args, **kwargs)


QS = t(1, 12, 4, 8)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(segment_lengths=[4, 8], dilation_rates=[1]), ValueError, "same length"),
    (dict(segment_lengths=[], dilation_rates=[]), ValueError, "empty"),
    (dict(segment_lengths=[0], dilation_rates=[1]), ValueError, ">= 1"),
    (dict(segment_lengths=[4], dilation_rates=[0]), ValueError, ">= 1"),
    (dict(segment_lengths=[4.0], dilation_rates=[1]), TypeError, "ints"),
    (dict(segment_lengths=[True], dilation_rates=[1]), TypeError, "ints"),
    (dict(segment_lengths=4, dilation_rates=[1]), TypeError, "sequence"),
])
def test_dilated_argument_errors(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        longattn.dilated_attention(QS, QS, QS, **kwargs)


def test_dilated_needs_self_attention():
    with pytest.raises(ValueError, match="N == M"):
        longattn.dilated_attention(QS, t(1, 13, 4, 8), t(1, 13, 4, 8), segment_lengths=[4], dilation_rates=[1])


@pytest.mark.parametrize("mask,block,exc,words", [
    (torch.ones(1, 1, 1, 1, dtype=torch.bool), 4, ValueError, "shape"),          # wrong block counts
    (torch.ones(2, 1, 2, 3), 4, TypeError, "torch.bool"),                       # wrong dtype
    (torch.ones(3, 1, 2, 3, dtype=torch.bool), 4, ValueError, "shape"),         # wrong batch dim
    (torch.ones(1, 3, 2, 3, dtype=torch.bool), 4, ValueError, "shape"),         # wrong head dim
    (torch.ones(2, 3, dtype=torch.bool), 4, ValueError, "4 dims"),
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), 0, ValueError, "positive"),
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), (4, 4, 4), TypeError, "block_size"),
    ([[True]], 4, TypeError, "bool torch.Tensor"),
])
def test_block_mask_errors(mask, block, exc, words):
    with pytest.raises(exc, match=words):
        longattn.block_sparse_attention(Q, K, K, block_mask=mask, block_size=block)


def test_valid_block_mask_shapes_accepted():
    for shape in [(1, 1, 2, 3), (2, 1, 2, 3), (1, 4, 2, 3), (2, 4, 2, 3)]:
        out = longattn.block_sparse_attention(Q, K, K, block_mask=torch.ones(shape, dtype=torch.bool), block_size=4)
        assert out.shape == Q.shape


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton'"):
        longattn.flash_attention(Q, K, K, backend="triton")
