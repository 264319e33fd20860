"""Bad input raises ValueError or TypeError naming the function, the argument and what is allowed."""
import math

import pytest
import torch

import longattn
from longattn import _validation as V
from longattn import ops
from longattn import reference as ref


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


Q, K = t(2, 8, 4, 16), t(2, 10, 2, 16)

FLASH_ERRORS = [
    ((t(8, 4, 16), K, K), {}, ValueError, "q must have 4 dims"),
    ((Q, K, t(2, 10, 2, 16, 1)), {}, ValueError, "v must have 4 dims"),
    ((Q, t(3, 10, 2, 16), t(3, 10, 2, 16)), {}, ValueError, "batch"),
    ((Q, t(2, 10, 2, 32), t(2, 10, 2, 32)), {}, ValueError, "head_dim"),
    ((Q, t(2, 10, 3, 16), t(2, 10, 3, 16)), {}, ValueError, "multiple"),
    ((Q, K, t(2, 11, 2, 16)), {}, ValueError, "same shape"),
    ((Q.int(), K.int(), K.int()), {}, TypeError, "dtype"),
    ((Q, K.double(), K.double()), {}, TypeError, "dtype"),
    ((t(1, 4, 2, 300), t(1, 4, 2, 300), t(1, 4, 2, 300)), {}, ValueError, "head_dim"),
    ((t(1, 4, 2, 0), t(1, 4, 2, 0), t(1, 4, 2, 0)), {}, ValueError, "head_dim"),
    (("q", K, K), {}, TypeError, "q must be a torch.Tensor"),
    ((Q, K, K.to("meta")), {}, ValueError, "one device"),
    ((Q, K, K), {"window": (1,)}, TypeError, "window"),
    ((Q, K, K), {"window": 3}, TypeError, "window"),
    ((Q, K, K), {"window": (True, 0)}, TypeError, "window left"),
    ((Q, K, K), {"window": (0, 1.5)}, TypeError, "window right"),
    ((Q, K, K), {"window": (-2, 0)}, ValueError, "window left"),
    ((Q, K, K), {"scale": -1.0}, ValueError, "scale"),
    ((Q, K, K), {"scale": 0}, ValueError, "scale"),
    ((Q, K, K), {"scale": math.inf}, ValueError, "scale"),
    ((Q, K, K), {"scale": math.nan}, ValueError, "scale"),
    ((Q, K, K), {"scale": "x"}, TypeError, "scale"),
]


@pytest.mark.parametrize("args,kwargs,exc,words", FLASH_ERRORS)
def test_flash_attention_errors(args, kwargs, exc, words):
    with pytest.raises(exc, match=words) as err:
        longattn.flash_attention(*args, **kwargs)
    assert str(err.value).startswith("flash_attention: ")  # the message names the function
    with pytest.raises(exc, match=words) as err:  # the reference checks its arguments the same way
        ref.flash_attention(*args, **kwargs)
    assert str(err.value).startswith("reference.flash_attention: ")


@pytest.mark.parametrize("args,kwargs,exc,words", FLASH_ERRORS[:12] + FLASH_ERRORS[-5:])
def test_ops_errors_name_the_op(args, kwargs, exc, words):
    with pytest.raises(exc, match=words) as err:
        ops.attention_forward(*args, **kwargs)
    assert str(err.value).startswith("attention_forward: ")


QS = t(1, 12, 4, 8)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(segment_lengths=[4, 8], dilation_rates=[1]), ValueError, "same length"),
    (dict(segment_lengths=[], dilation_rates=[]), ValueError, "segment_lengths must not be empty"),
    (dict(segment_lengths=[0], dilation_rates=[1]), ValueError, "segment_lengths must hold ints >= 1"),
    (dict(segment_lengths=[4], dilation_rates=[0]), ValueError, "dilation_rates must hold ints >= 1"),
    (dict(segment_lengths=[4], dilation_rates=[-2]), ValueError, "dilation_rates must hold ints >= 1"),
    (dict(segment_lengths=[4.0], dilation_rates=[1]), TypeError, "ints"),
    (dict(segment_lengths=[True], dilation_rates=[1]), TypeError, "ints"),
    (dict(segment_lengths=[4], dilation_rates=[False]), TypeError, "ints"),
    (dict(segment_lengths=4, dilation_rates=[1]), TypeError, "sequence"),
    (dict(segment_lengths="4", dilation_rates=[1]), TypeError, "sequence"),
])
def test_dilated_argument_errors(kwargs, exc, words):
    with pytest.raises(exc, match=words) as err:
        longattn.dilated_attention(QS, QS, QS, **kwargs)
    assert str(err.value).startswith("dilated_attention: ")
    with pytest.raises(exc, match=words):
        ref.dilated_attention(QS, QS, QS, **kwargs)


def test_dilated_needs_self_attention():
    for fn in (longattn.dilated_attention, ref.dilated_attention):
        with pytest.raises(ValueError, match="N == M"):
            fn(QS, t(1, 13, 4, 8), t(1, 13, 4, 8), segment_lengths=[4], dilation_rates=[1])


def test_dilated_checks_its_tensors():
    with pytest.raises(ValueError, match="dilated_attention: .*multiple"):
        longattn.dilated_attention(QS, t(1, 12, 3, 8), t(1, 12, 3, 8), segment_lengths=[4], dilation_rates=[1])


@pytest.mark.parametrize("mask,block,exc,words", [
    (torch.ones(1, 1, 1, 1, dtype=torch.bool), 4, ValueError, "shape"),          # wrong block counts
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), (4, 5), ValueError, "shape"),     # counts for block_k = 4, not 5
    (torch.ones(2, 1, 2, 3), 4, TypeError, "torch.bool"),                       # wrong dtype
    (torch.ones(2, 1, 2, 3, dtype=torch.int64), 4, TypeError, "torch.bool"),
    (torch.ones(3, 1, 2, 3, dtype=torch.bool), 4, ValueError, "shape"),         # wrong batch dim
    (torch.ones(1, 3, 2, 3, dtype=torch.bool), 4, ValueError, "shape"),         # wrong head dim
    (torch.ones(1, 2, 2, 3, dtype=torch.bool), 4, ValueError, "shape"),         # Hk, not Hq
    (torch.ones(2, 3, dtype=torch.bool), 4, ValueError, "4 dims"),
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), 0, ValueError, "positive"),
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), (4, -1), ValueError, "positive"),
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), (4, 4, 4), TypeError, "block_size"),
    (torch.ones(1, 1, 2, 3, dtype=torch.bool), 4.0, TypeError, "block_size"),
    ([[True]], 4, TypeError, "bool torch.Tensor"),
    (torch.ones(2, 1, 2, 3, dtype=torch.bool, device="meta"), 4, ValueError, "meta device"),
])
def test_block_mask_errors(mask, block, exc, words):
    with pytest.raises(exc, match=words) as err:
        longattn.block_sparse_attention(Q, K, K, block_mask=mask, block_size=block)
    assert str(err.value).startswith("block_sparse_attention: ")
    with pytest.raises(exc, match=words):
        ref.block_sparse_attention(Q, K, K, block_mask=mask, block_size=block)


def test_valid_block_mask_shapes_accepted():
    for shape in [(1, 1, 2, 3), (2, 1, 2, 3), (1, 4, 2, 3), (2, 4, 2, 3)]:
        out = longattn.block_sparse_attention(Q, K, K, block_mask=torch.ones(shape, dtype=torch.bool), block_size=4)
        assert out.shape == Q.shape
    assert V.check_block_mask(torch.ones(1, 1, 3, 2, dtype=torch.bool), Q, K, (3, 5)) == (3, 5)


def test_bad_backend_string_for_every_function():
    mask = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    calls = [
        lambda b: longattn.flash_attention(Q, K, K, backend=b),
        lambda b: longattn.dilated_attention(QS, QS, QS, segment_lengths=[4], dilation_rates=[1], backend=b),
        lambda b: longattn.block_sparse_attention(Q, K, K, block_mask=mask, block_size=4, backend=b),
        lambda b: ops.attention_forward(Q, K, K, backend=b),
    ]
    for call in calls:
        for bad in ("bogus", "Torch", None):
            with pytest.raises(ValueError, match="backend must be one of"):
                call(bad)


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton'"):
        longattn.flash_attention(Q, K, K, backend="triton")


def test_checks_return_normalised_values():
    assert V.check_window([3, -1]) == (3, -1) and isinstance(V.check_window([3, -1]), tuple)
    assert V.check_scale(None, 16) == 0.25 and V.check_scale(2, 16) == 2.0
    assert V.check_dilated_args([4, 8], (1, 2)) == ((4, 8), (1, 2))
    assert V.check_block_size(8) == (8, 8) and V.check_block_size([8, 16]) == (8, 16)
    V.check_attention_inputs(Q, K, K, fn="x")  # valid: no error
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        V.check_attention_inputs(Q.to(dtype), K.to(dtype), K.to(dtype), fn="x")


def test_explicit_fn_name_is_used():
    with pytest.raises(ValueError, match="^MyLayer: scale"):
        V.check_scale(-1.0, 8, fn="MyLayer")
    with pytest.raises(TypeError, match="^MyLayer: window"):
        V.check_window(None, fn="MyLayer")


@pytest.mark.parametrize("side", [2 ** 62, 2 ** 64, 10 ** 30])
def test_a_window_wider_than_any_sequence_is_unbounded(side):
    """A window side of 2**62 or more reaches past any sequence: the attention of an unbounded side (it ended in an
    OverflowError in the torch backend's index arithmetic)."""
    assert V.check_window((side, 3)) == (-1, 3) and V.check_window((0, side)) == (0, -1)
    assert V.check_window((2 ** 62 - 1, 0)) == (2 ** 62 - 1, 0)
    q = torch.randn(1, 9, 2, 8, dtype=torch.float64)
    got = longattn.flash_attention(q, q, q, window=(side, 0), backend="torch")
    torch.testing.assert_close(got, longattn.flash_attention(q, q, q, window=(-1, 0), backend="torch"), rtol=0,
                               atol=0)
