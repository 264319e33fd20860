"""Edge inputs: strict flags, zero-size inputs, meta/fake tensors, non-finite scores, module dtypes, and what
``backend="auto"`` runs."""
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import longattn
from longattn import ops
from longattn.backends import dispatch as _dispatch
from longattn import reference as R
from longattn.backends import auto_table
from longattn.utils import auto_backend
from longattn.nn import MultiheadBlockSparseAttention, MultiheadDilatedAttention
from longattn.patterns import Local

ROOT = Path(__file__).resolve().parents[1]


def _qkv(b=1, n=33, m=None, hq=4, hk=2, d=16, dtype=torch.float32, grad=False):
    m = n if m is None else m
    q = torch.randn(b, n, hq, d, dtype=dtype)
    k, v = torch.randn(b, m, hk, d, dtype=dtype), torch.randn(b, m, hk, d, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _calls(q, k, v, **flags):
    """Each public function with the given flags (block-sparse with a one-block-per-row mask of 16-blocks)."""
    n, m = q.shape[1], k.shape[1]
    mask = torch.ones(1, 1, -(-n // 16), -(-m // 16), dtype=torch.bool)
    dil = {key: val for key, val in flags.items()}
    return {
        "flash_attention": lambda: longattn.flash_attention(q, k, v, **flags),
        "block_sparse_attention": lambda: longattn.block_sparse_attention(q, k, v, block_mask=mask, block_size=16,
                                                                          **flags),
        "dilated_attention": lambda: longattn.dilated_attention(q, k, v, segment_lengths=[16], dilation_rates=[2],
                                                                **dil),
    }


# ------------------------------------------------------------------------------------------------------- flags
NOT_BOOLS = st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5),
                      st.lists(st.booleans(), max_size=2), st.just(torch.tensor([True])), st.just(torch.tensor(1)))


@settings(max_examples=60, deadline=None)
@given(value=NOT_BOOLS, flag=st.sampled_from(["causal", "return_lse"]))
def test_random_non_bool_flags_raise(value, flag):
    q, k, v = _qkv()
    for name, call in _calls(q, k, v, **{flag: value}).items():
        with pytest.raises(TypeError, match=flag):
            call()


@settings(max_examples=30, deadline=None)
@given(value=NOT_BOOLS)
def test_random_non_bool_head_split_and_ops_flags_raise(value):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="head_split"):
        longattn.dilated_attention(q, k, v, segment_lengths=[16], dilation_rates=[2], head_split=value)
    with pytest.raises(TypeError, match="causal"):
        ops.attention_forward(q, k, v, causal=value)
    with pytest.raises(TypeError, match="causal"):
        longattn.nn.DilatedAttention([16], [2], causal=value)


@pytest.mark.parametrize("value", ["False", "", 0, 1, None, 1.0])
def test_truthy_strings_and_none_are_not_flags(value):
    q, k, v = _qkv()
    for call in _calls(q, k, v, causal=value).values():
        with pytest.raises(TypeError, match="causal must be a bool"):
            call()


def test_zero_dim_bool_tensor_flags_are_accepted():
    q, k, v = _qkv()
    got = longattn.flash_attention(q, k, v, causal=torch.tensor(True), return_lse=torch.tensor(False))
    assert torch.allclose(got, R.flash_attention(q, k, v, causal=True), atol=1e-5)


# ------------------------------------------------------------------------------------------------ zero sizes
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("b,n,m,hq,hk", [(0, 33, 33, 4, 2), (2, 0, 0, 4, 2), (2, 33, 33, 0, 0), (2, 33, 33, 0, 2)])
def test_zero_size_inputs_keep_autograd(backend, b, n, m, hq, hk):
    q, k, v = _qkv(b, n, m, hq, hk, grad=True)
    for name, call in _calls(q, k, v, return_lse=True, backend=backend).items():
        out, lse = call()
        assert out.shape == q.shape and lse.shape == (b, hq, n) and out.requires_grad, name
        ref_out = getattr(R, name)(*(x.detach() for x in (q, k, v)), **(
            {"segment_lengths": [16], "dilation_rates": [2]} if name == "dilated_attention" else
            {"block_mask": torch.ones(1, 1, -(-n // 16), -(-m // 16), dtype=torch.bool), "block_size": 16}
            if name == "block_sparse_attention" else {}))
        assert ref_out.shape == out.shape
        out.sum().backward()
        for x in (q, k, v):
            assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
            x.grad = None


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("b,n,m,hq,hk", [(0, 9, 9, 4, 2), (2, 0, 5, 4, 2), (2, 9, 0, 4, 2), (2, 9, 9, 0, 0),
                                         (2, 9, 9, 0, 2)])
def test_zero_size_explicit_passes(backend, b, n, m, hq, hk):
    """ops.attention_forward/backward on zero-size inputs: zeros, -inf and zero gradients (no query heads was a
    ZeroDivisionError or a reshape error in the backends)."""
    q, k, v = _qkv(b, n, m, hq, hk)
    out, lse = ops.attention_forward(q, k, v, causal=True, backend=backend)
    assert out.shape == q.shape and not out.any() and lse.shape == (b, hq, n) and torch.isneginf(lse).all()
    for grad_dtype in (None, torch.float64):
        grads = ops.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True, backend=backend,
                                       grad_dtype=grad_dtype)
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == (grad_dtype or x.dtype) and not g.any()


def test_no_keys_gives_zero_output_and_neg_inf_lse():
    q, k, v = _qkv(2, 9, 0, 4, 2, grad=True)
    out, lse = longattn.flash_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and not out.any() and torch.isneginf(lse).all()
    out.sum().backward()
    assert q.grad.shape == q.shape and not q.grad.any()


# --------------------------------------------------------------------------------------------- meta and fake
def test_meta_tensors_give_shapes():
    q, k, v = (torch.empty(2, 64, 4, 16, device="meta", requires_grad=True) for _ in range(3))
    for name, call in _calls(q, k, v, return_lse=True).items():
        out, lse = call()
        assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (2, 4, 64), name
        out.sum().backward()
    assert q.grad.shape == q.shape


def test_meta_kv_cache_lengths_give_shapes_and_meta_cu_seqlens_are_named():
    """A KV-cache call's lengths as a meta tensor (contiguous or paged) give the output's shape, as an int does; a
    packed batch's cu_seqlens decide how it is computed and are refused by name on meta."""
    q = torch.empty(2, 1, 4, 8, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    cache = torch.empty(2, 16, 2, 8, device="meta")
    paged = torch.empty(8, 4, 2, 8, device="meta")
    table = torch.empty(2, 4, dtype=torch.int32, device="meta")
    assert longattn.flash_attention_with_kvcache(q, cache, cache, cache_seqlens=lens).shape == q.shape
    out = longattn.flash_attention_with_kvcache(q, paged, paged, cache_seqlens=lens, block_table=table)
    assert out.shape == q.shape
    qp = torch.empty(10, 4, 8, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="flash_attention_varlen: cu_seqlens_q is a meta tensor, without values"):
        longattn.flash_attention_varlen(qp, qp, qp, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_fake_tensors_of_a_fake_tensor_mode_give_shapes_without_reading_memory():
    """Under a ``FakeTensorMode`` of the user's own (shape inference, memory estimates: no ``torch.compile``), every
    public call gives shapes, as on meta tensors: the SDPA route's check for non-finite values read them (a
    ``DataDependentOutputException`` from deep inside SDPA's wrapper, on the plainest dense call and every
    KV-cache call on a CPU), and the call signatures and the caches' memory checks read the fake tensors' data
    pointers (PyTorch's warning that this "is almost definitely a bug"; made to warn every time here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    always = torch._C._get_warnAlways()
    torch._C._set_warnAlways(True)  # (PyTorch warns once a process otherwise: an earlier test may have used it up)
    try:
        with warnings.catch_warnings(record=True) as seen, FakeTensorMode():
            warnings.simplefilter("always")
            q, k, v = _qkv(2, 9, 9, 4, 2)
            calls = _calls(q, k, v, return_lse=True)
            calls["causal"] = lambda: longattn.flash_attention(q, k, v, causal=True, return_lse=True)
            for name, call in calls.items():
                out, lse = call()
                assert out.shape == q.shape and lse.shape == (2, 4, 9), name
            cache, lens = torch.empty(2, 16, 2, 16), torch.tensor([3, 5], dtype=torch.int32)
            for new in ((), (k[:, :1], v[:, :1])):
                for lengths in (lens, 3):
                    out = longattn.flash_attention_with_kvcache(q[:, :1], cache, cache.clone(), *new,
                                                               cache_seqlens=lengths)
                    assert out.shape == (2, 1, 4, 16)
    finally:
        torch._C._set_warnAlways(always)
    assert not [w for w in seen if "data pointer" in str(w.message)]


def test_modules_build_and_run_on_meta():
    with torch.device("meta"):
        dil = MultiheadDilatedAttention(64, 4, [16], [2])
        bs = MultiheadBlockSparseAttention(64, 4, Local(1).builder(block_size=16))
    x = torch.empty(2, 48, 64, device="meta")
    assert dil(x).shape == x.shape and bs(x).shape == x.shape


@pytest.mark.parametrize("causal", [False, True])
def test_compile_traces_with_fake_tensors(causal):
    q, k, v = _qkv(1, 40, 40, 4, 2)
    fn = torch.compile(lambda a, b, c: longattn.flash_attention(a, b, c, causal=causal), backend="aot_eager",
                       fullgraph=True)
    assert torch.allclose(fn(q, k, v), R.flash_attention(q, k, v, causal=causal), atol=1e-5)


def test_a_first_compiled_dense_call_before_any_eager_one_compiles_once(monkeypatch):
    """A process whose first attention call is compiled: the backend's module, imported while tracing, is neither
    looked up in nor added to the cache of modules, on whose contents Dynamo guarded (the second call compiled
    again)."""
    from torch._dynamo.testing import CompileCounter

    from longattn import backends

    monkeypatch.setattr(backends, "_MODULES", {})
    counter = CompileCounter()
    fn = torch.compile(lambda a, b, c: longattn.flash_attention(a, b, c, causal=True), backend=counter)
    for _ in range(3):
        fn(*_qkv(1, 40, 40, 4, 2))  # (new values each call)
    assert counter.frame_count == 1


def test_pytorch_backend_runs_eagerly_under_compile(monkeypatch):
    """Calls the PyTorch backend runs (causal N != M, a window, soft-capping with ``dynamic=True``) are not traced
    by ``torch.compile``: the backend's body runs eagerly (a graph break). Traced, a second compiled call of another
    kind made its chunk loop dynamic and Inductor simplified the loop's sizes for over ten minutes. Results and
    gradients still match the reference."""
    from longattn.backends.torch import chunked
    traced, plain = [], chunked.flash_attention

    def recording(*args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return plain(*args, **kwargs)

    monkeypatch.setattr(chunked, "flash_attention", recording)
    q, k, v = (torch.randn(2, n, h, 8, dtype=torch.float64, requires_grad=True) for n, h in ((6, 4), (9, 2), (9, 2)))
    for kw, dynamic in ((dict(causal=True), None), (dict(window=(2, 1)), None), (dict(causal=True, softcap=3.0), True)):
        f = torch.compile(lambda a, b, c: longattn.flash_attention(a, b, c, **kw), backend="aot_eager", dynamic=dynamic)
        got = f(q, k, v)
        want = R.flash_attention(q, k, v, **kw)
        assert torch.allclose(got, want, atol=1e-9), kw
        grads, want_grads = (torch.autograd.grad(x.sum(), (q, k, v)) for x in (got, want))
        assert all(torch.allclose(g, w, atol=1e-9) for g, w in zip(grads, want_grads)), kw
    assert traced and not any(traced), traced


def test_import_leaves_dynamo_unloaded():
    """Importing longattn and an eager call on the PyTorch backend do not import ``torch._dynamo`` (about 2 s)."""
    code = ("import sys, torch, longattn\n"
            "longattn.flash_attention(*(torch.randn(1, 5, 2, 8) for _ in range(3)), window=(2, 1))\n"
            "print('torch._dynamo' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split()[-1] == "False", run.stdout + run.stderr[-2000:]


# ------------------------------------------------------------------------------------------ non-finite scores
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_plus_inf_score_gives_nan_rows_and_masked_keys_never_matter(backend):
    """+inf in a key a query may attend: NaN for that query (IEEE, as in SDPA); the same key masked: no effect."""
    q, k, v = _qkv(1, 23, 23, 2, 2)
    q = q.abs() + 0.1
    k[0, 11, 0, 0] = float("inf")  # score +inf for every query of head 0 that sees key 11
    for fn in (lambda: R.flash_attention(q, k, v, causal=True),
               lambda: longattn.flash_attention(q, k, v, causal=True, backend=backend)):
        out = fn()
        assert torch.isnan(out[0, 11:, 0]).all()  # queries 11.. see key 11
        assert torch.isfinite(out[0, :11]).all() and torch.isfinite(out[0, :, 1]).all()
    finite_k = k.clone()
    finite_k[0, 11, 0, 0] = 0.0
    want = R.flash_attention(q, finite_k, v, causal=True)
    got = longattn.flash_attention(q, k, v, causal=True, backend=backend)
    assert torch.allclose(got[0, :11], want[0, :11], atol=1e-5)


def test_reference_only_row_with_plus_inf_is_nan():
    q, k, v = _qkv(1, 4, 6, 1, 1, d=4)
    q = q.abs()
    k[:, :, :, 0] = float("-inf")
    k[0, 2, 0, :] = 1.0
    k[0, 2, 0, 0] = float("inf")  # the only live score of every row is +inf
    out, lse = R.flash_attention(q, k, v, return_lse=True)
    assert torch.isnan(out).all() and not torch.isneginf(lse).any()


# -------------------------------------------------------------------------------------------------- modules
def test_layers_reject_an_input_of_another_dtype():
    for layer in (MultiheadDilatedAttention(32, 2, [8], [1]), MultiheadBlockSparseAttention(32, 2, Local(1).builder(
            block_size=16))):
        with pytest.raises(TypeError, match="float64.*float32"):
            layer(torch.randn(1, 16, 32, dtype=torch.float64))


def test_layers_accept_another_dtype_under_autocast():
    layer = MultiheadDilatedAttention(32, 2, [8], [1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(1, 16, 32)).shape == (1, 16, 32)


def test_empty_sequence_through_both_layers():
    x = torch.randn(2, 0, 32, requires_grad=True)
    for layer in (MultiheadDilatedAttention(32, 2, [8], [1]),
                  MultiheadBlockSparseAttention(32, 2, Local(1).builder(block_size=16))):
        out = layer(x)
        assert out.shape == x.shape
        out.sum().backward()


# ------------------------------------------------------------------------------------------------ dispatch
def test_auto_on_cpu_runs_sdpa_only_where_sdpa_computes_the_same_thing():
    q, k, v = _qkv(1, 40, 40, 4, 2)
    assert auto_backend(q, k, causal=False, needs_grad=False) == "sdpa"
    assert auto_backend(q, k, causal=True, needs_grad=True) == "sdpa"
    q_short = q[:, :25]
    assert auto_backend(q_short, k, causal=True, needs_grad=False) == "torch"  # N != M causal: bottom-right
    # window, lse and the other operations never run SDPA; all still match the reference
    for kw in ({"causal": True}, {"window": (5, 3)}):
        got, lse = longattn.flash_attention(q_short, k, v, return_lse=True, **kw)
        want, wlse = R.flash_attention(q_short, k, v, return_lse=True, **kw)
        assert torch.allclose(got, want, atol=1e-5) and torch.allclose(lse, wlse, atol=1e-5)
    assert torch.allclose(longattn.flash_attention(q, k, v, causal=True), R.flash_attention(q, k, v, causal=True),
                          atol=1e-5)


def test_dispatch_table_lookup(monkeypatch):
    assert auto_table.choice("sm90", "fwd", False, False, 128) == "sdpa"
    assert auto_table.choice("sm999", "fwd", False, False, 96) == "sdpa"  # unmeasured: PyTorch's own
    monkeypatch.setitem(auto_table.MEASURED, ("sm80", "fwd_bwd", True, True, 128), auto_table.TRITON)
    assert auto_table.choice("sm80", "fwd_bwd", True, True, 80) == "triton"  # 80 falls in the 128 bucket
    assert auto_table.choice("sm80", "fwd", True, True, 80) == "sdpa"
    assert auto_table.head_dim_bucket(256) == 256 and auto_table.head_dim_bucket(33) == 64


def test_backend_triton_still_forces_the_kernels():
    q, k, v = _qkv(1, 40, 40, 4, 2)
    assert _dispatch.choose("triton", q, fn="t", sdpa=_dispatch.SdpaCall(False, True, False)) == "triton"
    assert _dispatch.choose("torch", q, fn="t", sdpa=_dispatch.SdpaCall(False, True, False)) == "torch"


# -------------------------------------------------------------------------------------------- first hour
def test_submodules_reachable_after_import():
    code = ("import longattn; print(longattn.reference.flash_attention, longattn.nn.MultiheadDilatedAttention, "
            "longattn.patterns.Local, longattn.models.LongNet, longattn.ops.attention_forward)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


def test_train_longnet_zero_steps_evaluates():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_longnet
    finally:
        sys.path.pop(0)
    res = train_longnet.main(["--steps", "0", "--seq-len", "32", "--eval-batches", "1", "--device", "cpu",
                              "--segment-lengths", "16", "--dilation-rates", "1"])
    assert res["final_loss"] is None and 0.0 <= res["accuracy"] <= 1.0
