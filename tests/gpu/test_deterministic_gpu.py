"""GPU tests of ``deterministic=True``: two runs of the same call give bitwise-identical gradients
(``torch.equal``) that match a float64 reference, for dense (causal and not, grouped-query heads, D 64 and 128),
packed, dilated and block-sparse attention, under ``backend="triton"`` and ``"auto"``; the fused Gluon backward
(Hopper) and SDPA never run such a call, and PyTorch's deterministic mode has the same effect. The shapes have
several key and query blocks, so that on Hopper the fused backward takes the same calls without the flag (checked).
Skipped without CUDA."""
import contextlib

import pytest
import torch

import longattn
from longattn import ops
from longattn.backends import sdpa as sdpa_backend
from longattn.backends.gluon import launch as gluon_launch
from longattn.backends.triton import entry
from longattn.patterns import BlockSparsePattern

@pytest.fixture
def routed():
    """``routed(**settings)``: routing settings (``longattn.routing``) in force for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(longattn.routing(**settings))


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fused_available() -> bool:
    """Whether the fused Gluon backward runs here (an sm_90 GPU whose Triton has what the kernel needs)."""
    return torch.cuda.get_device_capability()[0] == 9 and gluon_launch.fused_module() is not None


@pytest.fixture
def kernel_calls(monkeypatch, routed):
    """``{"fused": [...], "sdpa": [...]}``: the calls the Gluon backwards (the fused one, and the 128 x 128 one of
    dense D=64 calls: neither sums dQ in a fixed order) and SDPA have taken."""
    calls = {"fused": [], "sdpa": [], "ordered": []}
    routed(fused_bwd_min_rows={})  # the fused kernel would take short calls too
    if torch.cuda.get_device_capability()[0] == 9 and gluon_launch.fused_module() is not None:
        from longattn.backends.gluon import bwd_wide_tile
        bwd_fused = gluon_launch.fused_module()
        real_fused, real_wide = bwd_fused.fused_backward, bwd_wide_tile.backward

        def fused_spy(*args, **kwargs):
            calls["ordered" if kwargs.get("deterministic") else "fused"].append(args[1].shape)
            return real_fused(*args, **kwargs)

        def wide_spy(*args, **kwargs):
            calls["fused"].append(args[0].shape)
            return real_wide(*args, **kwargs)
        real_replay = entry._GluonReplay.run

        def replay_spy(self, slots, q, k, v, grad_dtype, call):  # (a signature's later calls: its launches replayed)
            calls["ordered" if call.deterministic else "fused"].append(q.shape)
            return real_replay(self, slots, q, k, v, grad_dtype, call)
        monkeypatch.setattr(bwd_fused, "fused_backward", fused_spy)
        monkeypatch.setattr(bwd_wide_tile, "backward", wide_spy)
        monkeypatch.setattr(entry._GluonReplay, "run", replay_spy)
    real_sdpa = sdpa_backend.attention

    def sdpa_spy(*args, **kwargs):
        calls["sdpa"].append(args[0].shape)
        return real_sdpa(*args, **kwargs)
    monkeypatch.setattr(sdpa_backend, "attention", sdpa_spy)
    return calls


def _inputs(shapes, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*s, device="cuda", dtype=dtype, generator=g) for s in shapes]


def _grads(fn, q, k, v, do, **kw):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(qs, ks, vs, **kw)
    return torch.autograd.grad((out.double() * do.double()).sum(), (qs, ks, vs))


def _err(x, want):
    assert torch.isfinite(x).all(), "non-finite gradient"
    return ((x.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(fn, q, k, v, do, calls, backend, **kw):
    """Two deterministic runs: bitwise equal, close to the float64 reference, neither fused nor SDPA."""
    want = _grads(fn, q.double(), k.double(), v.double(), do, backend="torch", **kw)
    first = _grads(fn, q, k, v, do, backend=backend, deterministic=True, **kw)
    second = _grads(fn, q, k, v, do, backend=backend, deterministic=True, **kw)
    assert calls["fused"] == [] and calls["sdpa"] == []
    for name, a, b, w in zip("qkv", first, second, want):
        assert torch.equal(a, b), f"d{name} differs between two runs"
        assert _err(a, w) < 2e-2, name


DENSE = [  # B, N, M, Hq, Hk, D, causal
    (2, 1500, 1500, 4, 4, 128, False),
    (2, 1500, 1500, 4, 4, 128, True),
    (1, 2048, 2048, 8, 2, 64, True),
    (2, 1200, 1700, 8, 2, 128, False),
    (1, 1100, 1100, 4, 1, 64, False),
]


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: "-".join(map(str, c)))
def test_dense(case, backend, kernel_calls):
    B, N, M, Hq, Hk, D, causal = case
    q, k, v, do = _inputs([(B, N, Hq, D), (B, M, Hk, D), (B, M, Hk, D), (B, N, Hq, D)])
    if _fused_available():  # the shape is one the fused backward takes without the flag
        _grads(longattn.flash_attention, q, k, v, do, backend="triton", causal=causal)
        assert len(kernel_calls["fused"]) == 1
        kernel_calls["fused"].clear()
    _check(longattn.flash_attention, q, k, v, do, kernel_calls, backend, causal=causal)


ORDERED = DENSE + [  # the fused backward with dQ in a fixed order: also windows, N > M causal, odd lengths
    (1, 3000, 3000, 8, 8, 128, "window"),
    (2, 2500, 1900, 8, 4, 128, True),
    (1, 4100, 4100, 4, 4, 64, False),
    (1, 3000, 2200, 8, 2, 64, True),
]


@pytest.mark.parametrize("case", ORDERED, ids=lambda c: "-".join(map(str, c)))
def test_dense_on_the_fused_backward_in_a_fixed_order(case, kernel_calls, routed):
    """``deterministic_bwd_head_dims``: the fused backward takes the call (its dQ added in turn, query block by
    query block); three runs bitwise equal, close to the float64 reference."""
    if not _fused_available():
        pytest.skip("the fused backward runs on sm_90 only")
    B, N, M, Hq, Hk, D, causal = case
    kw = dict(window=(1500, 300)) if causal == "window" else dict(causal=causal)  # (wider than fused_bwd_min_band)
    routed(deterministic_bwd_head_dims=(64, 128))
    q, k, v, do = _inputs([(B, N, Hq, D), (B, M, Hk, D), (B, M, Hk, D), (B, N, Hq, D)], seed=3)
    want = _grads(longattn.flash_attention, q.double(), k.double(), v.double(), do, backend="torch", **kw)
    runs = [_grads(longattn.flash_attention, q, k, v, do, backend="triton", deterministic=True, **kw)
            for _ in range(3)]
    assert len(kernel_calls["ordered"]) == 3 and kernel_calls["fused"] == []
    for name, i in zip("qkv", range(3)):
        assert torch.equal(runs[0][i], runs[1][i]) and torch.equal(runs[0][i], runs[2][i]), f"d{name} differs"
        assert _err(runs[0][i], want[i]) < 2e-2, name


def test_pytorch_deterministic_mode(kernel_calls):
    """``torch.use_deterministic_algorithms(True)`` (warn_only here) makes every call deterministic."""
    q, k, v, do = _inputs([(2, 1500, 4, 128), (2, 1500, 2, 128), (2, 1500, 2, 128), (2, 1500, 4, 128)])
    want = _grads(longattn.flash_attention, q.double(), k.double(), v.double(), do, backend="torch", causal=True)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first = _grads(longattn.flash_attention, q, k, v, do, causal=True)
        second = _grads(longattn.flash_attention, q, k, v, do, causal=True)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    assert kernel_calls["fused"] == [] and kernel_calls["sdpa"] == []
    for a, b, w in zip(first, second, want):
        assert torch.equal(a, b) and _err(a, w) < 2e-2


def test_attention_backward_float32_gradients(kernel_calls):
    """The explicit backward (the ring code's, float32 partial gradients)."""
    q, k, v, do = _inputs([(1, 1500, 8, 128), (1, 1500, 2, 128), (1, 1500, 2, 128), (1, 1500, 8, 128)])
    o, lse = ops.attention_forward(q, k, v, causal=True, backend="triton")
    runs = [ops.attention_backward(do, q, k, v, o, lse, causal=True, backend="triton", grad_dtype=torch.float32,
                                   deterministic=True) for _ in range(2)]
    assert kernel_calls["fused"] == []
    want = _grads(longattn.flash_attention, q.double(), k.double(), v.double(), do, backend="torch", causal=True)
    for a, b, w in zip(*runs, want):
        assert a.dtype == torch.float32 and torch.equal(a, b) and _err(a, w) < 2e-2


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_varlen(backend, kernel_calls):
    cu = torch.tensor([0, 700, 1800, 2100, 3000], dtype=torch.int32, device="cuda")
    q, k, v, do = _inputs([(3000, 8, 128), (3000, 2, 128), (3000, 2, 128), (3000, 8, 128)])
    _check(longattn.flash_attention_varlen, q, k, v, do, kernel_calls, backend, cu_seqlens_q=cu, cu_seqlens_k=cu,
           causal=True)


@pytest.mark.parametrize("head_split", [False, True])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_dilated(backend, head_split, kernel_calls):
    q, k, v, do = _inputs([(1, 2048, 8, 64), (1, 2048, 2, 64), (1, 2048, 2, 64), (1, 2048, 8, 64)])
    _check(longattn.dilated_attention, q, k, v, do, kernel_calls, backend, segment_lengths=[512, 1024, 2048],
           dilation_rates=[1, 2, 4], causal=True, head_split=head_split)


@pytest.mark.parametrize("full", [False, True], ids=["random", "full"])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_block_sparse(backend, full, kernel_calls):
    """A random mask (block lists), and one that allows every block pair (a given pattern: the dense kernels, whose
    backward the fused kernel takes without the flag)."""
    n, block = 1536, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    mask = torch.rand(1, 8, n // block, n // block, device="cuda", generator=g) < 0.4
    mask[..., 0] = True
    pattern = BlockSparsePattern(torch.ones_like(mask) if full else mask, block, seq_lens=(n, n))
    q, k, v, do = _inputs([(1, n, 8, 128), (1, n, 2, 128), (1, n, 2, 128), (1, n, 8, 128)])
    if full and _fused_available():
        _grads(longattn.block_sparse_attention, q, k, v, do, backend="triton", block_mask=pattern)
        assert len(kernel_calls["fused"]) == 1
        kernel_calls["fused"].clear()
    _check(longattn.block_sparse_attention, q, k, v, do, kernel_calls, backend, block_mask=pattern)


def _repeated_and_by_pointer(step, names, **pointer_routing):
    """``step()`` (a tuple of tensors) five times, each run bitwise equal to the first (else the name in ``names``
    of what differs, by how much); returns ``(the first run, step() under routing(tma=False, **pointer_routing))``:
    the same call with its tiles loaded by pointer instead of tensor descriptors."""
    first = step()
    for _ in range(4):
        for name, a, b in zip(names, first, step()):
            assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()), float(a.abs().max()))
    with longattn.routing(tma=False, **pointer_routing):
        return first, step()


def _max_rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _long_dense(d, hq, hk, seed):
    """bf16 ``q`` (scaled by 2: peaked rows), ``k``, ``v``, ``do`` ``(1, rows, heads, d)``, long enough for TMA."""
    rows = 2048 if d == 256 else 4096
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, rows, hq, d, generator=g, device="cuda").mul(2).bfloat16()
    k, v = (torch.randn(1, rows, hk, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, torch.randn(1, rows, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("hq, hk", [(16, 16), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("grad_dtype", [None, torch.float32], ids=["input-dtype", "float32"])
@pytest.mark.parametrize("band", ["full", "causal", "window"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_two_pass_backward_repeats_bitwise_and_matches_pointer_loads(d, band, grad_dtype, hq, hk, kernel_calls):
    """The two Triton backward passes (deterministic calls, and what the fused backward does not take: dilated
    views, the ring's float32 partial gradients, ...) at lengths where their Q/dO and K/V tiles load through tensor
    descriptors (TMA, sm_90): five runs bitwise equal, and equal to the same kernels loading by pointer. On an H200
    with Triton 3.6 the dK/dV pass at D=64, causal, float32 gradients gave a dK differing from run to run by up to a
    fifth of its largest value (dQ and dV right; the ring's diagonal blocks, session of 2026-11-29, seventh)."""
    q, k, v, do = _long_dense(d, hq, hk, seed=d + hq)
    kw = dict(causal=band == "causal", window=(700, 300) if band == "window" else (-1, -1))
    o, lse = ops.attention_forward(q, k, v, backend="triton", **kw)

    def grads():
        return ops.attention_backward(do, q, k, v, o, lse, backend="triton", grad_dtype=grad_dtype,
                                      deterministic=True, **kw)

    first, pointer = _repeated_and_by_pointer(grads, ("dq", "dk", "dv"))
    assert kernel_calls["fused"] == []
    for name, a, b in zip(("dq", "dk", "dv"), first, pointer):
        assert _max_rel(a, b) <= 1e-3, (name, _max_rel(a, b))


@pytest.mark.parametrize("hq, hk", [(16, 16), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["input-dtype", "float32"])
@pytest.mark.parametrize("band", ["full", "causal", "window"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_repeats_bitwise_and_matches_pointer_loads(d, band, out_dtype, hq, hk):
    """The forward as the ring's blocks call it (float32 partial outputs) and as a plain call, Gluon where it runs,
    at lengths where tiles load through tensor descriptors: five runs bitwise equal, and within rounding of the same
    call with descriptors off (the dK/dV pass raced with float32 gradients and TMA: the forward is checked alike)."""
    q, k, v, _ = _long_dense(d, hq, hk, seed=d + hq + 1)
    kw = dict(causal=band == "causal", window=(700, 300) if band == "window" else (-1, -1), out_dtype=out_dtype)
    (out, lse), pointer = _repeated_and_by_pointer(lambda: ops.attention_forward(q, k, v, backend="triton", **kw),
                                                   ("out", "lse"), gluon=False)
    err = _max_rel(out, pointer[0])
    assert err <= 2e-2, ("out", err)  # (two kernels: a few bf16 ulps of the largest value apart at most)
    assert float((lse - pointer[1]).abs().max()) <= 1e-3


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["packed", "dilated", "softcap-alibi", "block-sparse"])
def test_two_pass_backward_of_other_calls_repeats_bitwise_and_matches_pointer_loads(kind, d):
    """The dK/dV race showed on one configuration of dense calls (float32 gradients): the other calls that run the
    two Triton passes with descriptor loads (packed batches, dilated views, score modifications, block lists), long
    enough for TMA, one query head a program (where it showed): five deterministic runs bitwise equal, and equal
    within rounding to the same calls loading by pointer."""
    g = torch.Generator(device="cuda").manual_seed(11 + d)
    total, h = 6144, 16

    def leaves():
        x = [torch.randn(total, h, d, generator=g, device="cuda").bfloat16() for _ in range(3)]
        return [t if kind == "packed" else t[None] for t in x]

    q, k, v = leaves()
    do = torch.randn_like(q)
    if kind == "packed":
        cu = torch.tensor([0, 1500, 1501, 4800, total], dtype=torch.int32, device="cuda")

        def fn(q, k, v):
            return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                                   backend="triton", deterministic=True)
    elif kind == "dilated":
        def fn(q, k, v):
            return longattn.dilated_attention(q, k, v, segment_lengths=[2048, 6144], dilation_rates=[1, 2],
                                              causal=True, backend="triton", deterministic=True)
    elif kind == "softcap-alibi":
        slopes = torch.rand(h, device="cuda", generator=g) * 0.1

        def fn(q, k, v):
            return longattn.flash_attention(q, k, v, causal=True, softcap=20.0, alibi_slopes=slopes,
                                            backend="triton", deterministic=True)
    else:
        mask = torch.rand(1, h, total // 128, total // 128, device="cuda", generator=g) < 0.3
        mask[..., 0] = True
        pattern = BlockSparsePattern(mask, 128, seq_lens=(total, total))

        def fn(q, k, v):
            return longattn.block_sparse_attention(q, k, v, block_mask=pattern, backend="triton",
                                                   deterministic=True)

    def grads():
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        fn(*xs).backward(do)
        return [x.grad for x in xs]

    first, pointer = _repeated_and_by_pointer(grads, ("dq", "dk", "dv"))
    for name, a, b in zip(("dq", "dk", "dv"), first, pointer):
        assert _max_rel(a, b) <= 2e-2, (kind, name, _max_rel(a, b))
