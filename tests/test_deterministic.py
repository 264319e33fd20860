"""``deterministic=True``: accepted and checked by every differentiable entry point, on as well under
PyTorch's deterministic mode, routed away from the backwards that sum in no fixed order (the fused Gluon backward on
Hopper, SDPA's under ``backend="auto"``), and giving the reference's gradients. The routing is tested here with the
decision functions and stand-ins for the Hopper kernel; tests/gpu/test_deterministic_gpu.py runs it on a GPU."""
import pytest
import torch

import longattn
from longattn import _validation as V
from longattn import nn as lnn
from longattn import ops
from longattn import reference as ref
from longattn.backends import dispatch
from longattn.backends.device import Device
from longattn.backends import sdpa as sdpa_backend
from longattn.backends.gluon import launch as gluon_launch
from longattn.backends.triton import entry, planner
from longattn.call import AttentionCall, flash_call
from longattn.patterns import BlockSparsePattern

TOL = 2e-4  # float32 kernels against the float64 reference


def _inputs(b, n, m, hq, hk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=dtype) for s, h in ((n, hq), (m, hk), (m, hk), (n, hq))]


def _grads(fn, q, k, v, do, **kw):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(qs, ks, vs, **kw)
    return torch.autograd.grad((out.double() * do.double()).sum(), (qs, ks, vs))


@pytest.fixture
def pytorch_deterministic_mode():
    """Turns PyTorch's deterministic mode on for the test (warn_only, so no operation of PyTorch's refuses to
    run), then restores the mode the session had."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


# --- validation --------------------------------------------------------------------------------------------------

def _full_pattern(n=16, block=8):
    return BlockSparsePattern(torch.ones(1, 1, n // block, n // block, dtype=torch.bool), block)


def _entry_points(bad):
    q, k, v, do = _inputs(1, 16, 16, 2, 2, 8)
    packed = [x[0] for x in (q, k, v)]
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    o, lse = ops.attention_forward(q, k, v, backend="torch")
    return {
        "flash_attention": lambda: longattn.flash_attention(q, k, v, deterministic=bad),
        "flash_attention_varlen": lambda: longattn.flash_attention_varlen(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                          deterministic=bad),
        "dilated_attention": lambda: longattn.dilated_attention(q, k, v, segment_lengths=[8], dilation_rates=[2],
                                                                deterministic=bad),
        "dilated_attention_varlen": lambda: longattn.dilated_attention_varlen(
            *packed, cu_seqlens=cu, segment_lengths=[8], dilation_rates=[2], deterministic=bad),
        "block_sparse_attention": lambda: longattn.block_sparse_attention(q, k, v, block_mask=_full_pattern(),
                                                                          deterministic=bad),
        "attention_backward": lambda: ops.attention_backward(do, q, k, v, o, lse, deterministic=bad),
        "DilatedAttention": lambda: lnn.DilatedAttention([8], [2], deterministic=bad),
        "MultiheadDilatedAttention": lambda: lnn.MultiheadDilatedAttention(16, 2, [8], [2], deterministic=bad),
        "BlockSparseAttention": lambda: lnn.BlockSparseAttention(_full_pattern(), deterministic=bad),
        "MultiheadBlockSparseAttention": lambda: lnn.MultiheadBlockSparseAttention(16, 2, _full_pattern(),
                                                                                   deterministic=bad),
    }


ENTRY_POINTS = list(_entry_points(False))


@pytest.mark.parametrize("bad", ["True", 1, None])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_non_bool_deterministic_is_a_type_error_naming_it(name, bad):
    with pytest.raises(TypeError, match=f"{name}: deterministic must be a bool"):
        _entry_points(bad)[name]()


def test_pytorch_deterministic_mode_turns_the_flag_on(pytorch_deterministic_mode):
    assert V.check_deterministic(False, "f") is True
    with pytest.raises(TypeError, match="f: deterministic must be a bool"):  # still checked
        V.check_deterministic("no", "f")


def test_the_flag_is_off_by_default_outside_pytorch_deterministic_mode():
    if torch.are_deterministic_algorithms_enabled():
        pytest.skip("this session runs in PyTorch's deterministic mode")
    assert V.check_deterministic(False, "f") is False and V.check_deterministic(True, "f") is True


# --- gradients ---------------------------------------------------------------------------------------------------

def _block_mask(n, m, block):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(1, 4, -(-n // block), -(-m // block), generator=g) < 0.6
    mask[..., 0] = True
    return mask


CALLS = {  # name: (longattn function, reference, keyword arguments)
    "flash-causal-gqa": (longattn.flash_attention, ref.flash_attention, dict(causal=True)),
    "flash-window": (longattn.flash_attention, ref.flash_attention, dict(window=(5, 2))),
    "dilated": (longattn.dilated_attention, ref.dilated_attention,
                dict(segment_lengths=[8, 16, 40], dilation_rates=[1, 2, 4], causal=True)),
    "block-sparse": (longattn.block_sparse_attention, ref.block_sparse_attention,
                     dict(block_mask=_block_mask(40, 40, 16), block_size=16)),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(CALLS))
def test_deterministic_gradients_equal_the_reference(name, backend):
    fn, ref_fn, kw = CALLS[name]
    q, k, v, do = _inputs(1, 40, 40, 4, 2, 16)
    want = _grads(ref_fn, q.double(), k.double(), v.double(), do, **kw)
    got = _grads(fn, q, k, v, do, backend=backend, deterministic=True, **kw)
    again = _grads(fn, q, k, v, do, backend=backend, deterministic=True, **kw)
    for name_, g, a, w in zip("qkv", got, again, want):
        assert torch.equal(g, a), name_
        assert (g.double() - w).abs().max() < TOL, name_


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deterministic_varlen_gradients_equal_the_reference(backend):
    q, k, v, do = (x[0] for x in _inputs(1, 45, 45, 4, 2, 16))
    cu = torch.tensor([0, 20, 20, 45], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    want = _grads(ref.flash_attention_varlen, q.double(), k.double(), v.double(), do, **kw)
    got = _grads(longattn.flash_attention_varlen, q, k, v, do, backend=backend, deterministic=True, **kw)
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < TOL


# --- routing -----------------------------------------------------------------------------------------------------

def test_auto_runs_no_sdpa_for_a_deterministic_call_that_needs_gradients():
    """The dispatcher's decision on CPU tensors, where ``auto`` otherwise runs SDPA for the calls it computes."""
    q = torch.zeros(1, 8, 2, 16)
    grad, no_grad = dispatch.SdpaCall(False, False, True), dispatch.SdpaCall(False, False, False)
    assert dispatch.choose("auto", q, fn="t", sdpa=grad) == "sdpa"
    assert dispatch.choose("auto", q, fn="t", sdpa=grad, deterministic=True) == "torch"
    assert dispatch.choose("auto", q, fn="t", sdpa=no_grad, deterministic=True) == "sdpa"  # no backward to fix


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The calls SDPA has run (a list)."""
    calls = []
    real = sdpa_backend.attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(sdpa_backend, "attention", spy)
    return calls


def test_flash_attention_auto_with_deterministic_avoids_sdpa(sdpa_calls):
    q, k, v, do = _inputs(1, 24, 24, 2, 2, 16)
    want = _grads(ref.flash_attention, q.double(), k.double(), v.double(), do, causal=True)
    _grads(longattn.flash_attention, q, k, v, do, causal=True)
    assert len(sdpa_calls) == 1  # the same call without the flag runs SDPA here
    got = _grads(longattn.flash_attention, q, k, v, do, causal=True, deterministic=True)
    assert len(sdpa_calls) == 1
    with torch.no_grad():  # no backward: SDPA is fine
        longattn.flash_attention(q, k, v, causal=True, deterministic=True)
    assert len(sdpa_calls) == 2
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < TOL


def test_pytorch_deterministic_mode_avoids_sdpa(sdpa_calls, pytorch_deterministic_mode):
    q, k, v, do = _inputs(1, 24, 24, 2, 2, 16)
    _grads(longattn.flash_attention, q, k, v, do)
    assert sdpa_calls == []


def _dense_half(d=64):
    return _inputs(1, 40, 40, 4, 2, d, dtype=torch.float16)


@pytest.fixture
def as_if_on_hopper(monkeypatch):
    """Plans CPU tensors as for an sm_90 GPU with Gluon available (made-up device facts through
    ``longattn.routing``), short calls too (the fused backward's ``fused_bwd_min_rows`` off), the D=64 calls on
    the fused backward too (the 128 x 128 one, which declines deterministic calls for the same reason, off)."""
    monkeypatch.delenv("LONGATTN_GLUON", raising=False)
    with longattn.routing(device=Device(capability=(9, 0), interpret=True, gluon=True), fused_bwd_min_rows={},
                          wide_bwd_head_dims=()):
        yield


def _why_not_fused(q, k, v, do, call):
    (bwd, *_) = planner.backward(q, k, v, do, call)
    return None if bwd.chosen.kernel == planner.GLUON_FUSED_BWD else bwd.rejected[0].reason


def test_why_not_fused_backward_declines_deterministic_calls(as_if_on_hopper):
    q, k, v, do = _dense_half()
    for causal in (False, True):
        call = flash_call(0.125, causal)
        assert _why_not_fused(q, k, v, do, call) is None  # the fused backward's call
        reason = _why_not_fused(q, k, v, do, AttentionCall(0.125, causal, deterministic=True))
        assert reason is not None and "deterministic" in reason


@pytest.fixture
def fused_calls(as_if_on_hopper, monkeypatch):
    """Plans the Triton backend's backward on CPU tensors (the interpreter) as at sm_90 (through
    :func:`gluon_launch.fused_backward`), with a stand-in kernel that records the calls it is asked to run
    and declines them (None), so the two Triton passes compute the gradients. Returns the list of calls. (The
    replays kept are dropped first: a signature another test recorded would replay without asking the kernel.)"""
    calls = []
    entry._BACKWARD.clear()

    class Kernel:
        @staticmethod
        def fused_backward(do, q, *args, **kwargs):
            calls.append(q.shape)
            return None
    monkeypatch.setattr(gluon_launch, "_fused_kernel", Kernel)
    return calls


def test_the_triton_backward_asks_no_fused_kernel_for_deterministic_calls(fused_calls):
    q, k, v, do = _dense_half()
    want = _grads(ref.flash_attention, q.double(), k.double(), v.double(), do, causal=True)
    _grads(longattn.flash_attention, q, k, v, do, causal=True, backend="triton")
    assert len(fused_calls) == 1  # the same call without the flag goes to the fused backward
    got = _grads(longattn.flash_attention, q, k, v, do, causal=True, backend="triton", deterministic=True)
    assert len(fused_calls) == 1
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 2e-2  # float16 gradients

    o, lse = ops.attention_forward(q, k, v, backend="triton")
    ops.attention_backward(do, q, k, v, o, lse, backend="triton", deterministic=True)
    assert len(fused_calls) == 1
    ops.attention_backward(do, q, k, v, o, lse, backend="triton")
    assert len(fused_calls) == 2


def test_a_full_block_sparse_pattern_keeps_the_flag_on_the_dense_path(fused_calls):
    """A pattern that allows every block pair runs on the dense kernels: the flag must come along."""
    q, k, v, do = _dense_half()
    pattern = BlockSparsePattern(torch.ones(1, 1, 3, 3, dtype=torch.bool), 16)
    _grads(longattn.block_sparse_attention, q, k, v, do, block_mask=pattern, backend="triton")
    assert len(fused_calls) == 1
    _grads(longattn.block_sparse_attention, q, k, v, do, block_mask=pattern, backend="triton", deterministic=True)
    _grads(lnn.BlockSparseAttention(pattern, backend="triton", deterministic=True), q, k, v, do)
    assert len(fused_calls) == 1


def test_the_custom_ops_carry_the_flag():
    """Under torch.compile the backward runs from the ops' named parameters: ``deterministic`` is one of them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for call in (flash_call(0.5, True), AttentionCall(scale=0.5, causal=True, deterministic=True)):
        tensors, kwargs = entry._op_args(call)
        assert entry._call_of(*tensors, **kwargs).deterministic is call.deterministic
    with FakeTensorMode():
        q = torch.empty(2, 8, 4, 32)
        k = torch.empty(2, 12, 2, 32)
        o, lse = torch.ops.longattn.attention_fwd(q, k, k, scale=0.1, deterministic=True)
        dq, _, _ = torch.ops.longattn.attention_bwd(o, q, k, k, o, lse, scale=0.1, deterministic=True)
    assert dq.shape == q.shape


def test_the_fused_backward_takes_dense_deterministic_calls_at_the_routed_head_dims(as_if_on_hopper, monkeypatch):
    """With ``deterministic_bwd_head_dims`` naming a head dim, a dense deterministic call goes to the fused backward
    with ``deterministic=True`` (its dQ in a fixed order); the 128 x 128 backward never takes one; a packed batch
    still runs the two Triton passes, and other head dims too."""
    calls = []

    class Kernel:
        @staticmethod
        def fused_backward(do, q, *args, **kwargs):
            calls.append(kwargs["deterministic"])
            return None  # declined: the two Triton passes compute the gradients
    monkeypatch.setattr(gluon_launch, "_fused_kernel", Kernel)
    entry._BACKWARD.clear()  # (a signature another test recorded would replay without asking the kernel)
    for d in (64, 128):
        q, k, v, do = _dense_half(d)
        call = AttentionCall(0.125, True, deterministic=True)
        # (min_keys: the Triton forward, which runs here under the interpreter, for both head dims)
        with longattn.routing(deterministic_bwd_head_dims=(d,), wide_bwd_head_dims=(64,),
                              min_keys={64: 1 << 30, 128: 1 << 30}):
            assert _why_not_fused(q, k, v, do, call) is None
            (bwd, *_) = planner.backward(q, k, v, do, call)
            assert any(r.kernel == planner.GLUON_WIDE_BWD and "deterministic" in r.reason for r in bwd.rejected) \
                or d != 64
            _grads(longattn.flash_attention, q, k, v, do, causal=True, backend="triton", deterministic=True)
        with longattn.routing(deterministic_bwd_head_dims=(32 if d == 64 else 64,)):
            assert "deterministic" in _why_not_fused(q, k, v, do, call)
    assert calls == [True, True]
    cu = torch.tensor([0, 16, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, 4, 64, dtype=torch.float16) for _ in range(3))
    with longattn.routing(deterministic_bwd_head_dims=(64, 128)):
        plan = longattn.explain(longattn.flash_attention_varlen, q.requires_grad_(), k, v, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, causal=True, backend="triton", deterministic=True)
    assert "packed batch or block lists" in str(plan)
