"""The Triton kernels, run by the Triton interpreter on the CPU, against the float64 reference.

Every kernel path: dense, causal with N != M, sliding window, grouped-query heads, head dims 16..256 (including
ones that are padded to a power of two), block lists (block-sparse, with the mask's blocks larger than the tiles),
dilated branches (per-head offsets, head split, causal, N not a multiple of any segment), fully masked rows; output,
log-sum-exp and the three gradients. The interpreter computes in float32 here, so the tolerances are float32's.
Sizes are small and awkward (not multiples of the 16x16 interpreter tiles).
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("set TRITON_INTERPRET=1 (the conftest does) to run the kernels on the CPU", allow_module_level=True)

import longattn  # noqa: E402
from longattn import reference as ref  # noqa: E402
from longattn.backends.triton.tiles import Tiles, override_tiles, override_tma  # noqa: E402

TOL = 2e-5


def _inputs(b, n, m, hq, hk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=dtype) for s, h in ((n, hq), (m, hk), (m, hk)))
    do = torch.randn(b, n, hq, d, generator=g, dtype=dtype)
    return q, k, v, do


def _check(kernel_fn, ref_fn, q, k, v, do, tol=TOL):
    """Outputs, lse and gradients of the kernel against the reference evaluated in float64."""
    qk, kk, vk = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = kernel_fn(qk, kk, vk)
    out.backward(do)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    rout, rlse = ref_fn(q64, k64, v64)
    rout.backward(do.double())

    def close(got, want, what):
        assert torch.isfinite(got).all(), f"{what}: non-finite values"
        err = (got.double() - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), f"{what}: max error {err:.2e}"

    close(out, rout, "out")
    finite = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf pattern differs"
    assert (lse[~finite] == float("-inf")).all()
    close(lse[finite], rlse[finite], "lse")
    for got, want, name in ((qk.grad, q64.grad, "dq"), (kk.grad, k64.grad, "dk"), (vk.grad, v64.grad, "dv")):
        close(got, want, name)


def _flash(**kw):
    return (lambda q, k, v: longattn.flash_attention(q, k, v, return_lse=True, backend="triton", **kw),
            lambda q, k, v: ref.flash_attention(q, k, v, return_lse=True, **kw))


@pytest.mark.parametrize("b,n,m,hq,hk,d,causal,window", [
    (2, 37, 37, 2, 2, 32, False, (-1, -1)),        # dense, ragged end
    (1, 37, 53, 4, 2, 32, True, (-1, -1)),         # causal, N < M, GQA
    (2, 50, 29, 3, 1, 16, True, (-1, -1)),         # causal, N > M: fully masked rows, MQA
    (1, 45, 45, 2, 2, 24, False, (7, 3)),          # window both sides, head dim padded to 32
    (1, 40, 60, 2, 2, 64, True, (5, -1)),          # causal + left window
    (1, 33, 33, 2, 1, 48, False, (-1, 4)),         # right window only, GQA, padded head dim
    (1, 31, 47, 2, 2, 16, False, (0, 0)),          # a band of one key (N != M)
])
def test_flash_paths(b, n, m, hq, hk, d, causal, window):
    q, k, v, do = _inputs(b, n, m, hq, hk, d)
    _check(*_flash(causal=causal, window=window), q, k, v, do)


@pytest.mark.parametrize("d", [96, 128, 256])
def test_flash_large_head_dims(d):
    q, k, v, do = _inputs(1, 21, 19, 2, 1, d, seed=d)
    _check(*_flash(causal=True), q, k, v, do)


@pytest.mark.parametrize("m", [20, 33, 40])
def test_backward_finite_with_a_very_small_lse(m):
    """Every row's log-sum-exp below -88 (queries far from every key) and a ragged key end: the padded keys' exp2(-lse)
    overflowed and inf times their zero K made dQ NaN. Against the reference in float64."""
    g = torch.Generator().manual_seed(m)
    q = torch.ones(1, 20, 1, 16) * 10 + torch.randn(1, 20, 1, 16, generator=g)
    k = -torch.ones(1, m, 1, 16) * 10 + torch.randn(1, m, 1, 16, generator=g)
    v, do = torch.randn(1, m, 1, 16, generator=g), torch.randn(1, 20, 1, 16, generator=g)
    _check(*_flash(), q, k, v, do, tol=2e-4)  # scores near -400: float32 rounds them to about 3e-5


def test_backward_finite_with_a_very_small_lse_on_block_lists_and_dilated_views():
    """The same through the block-list path (a ragged last block among the full ones) and a dilated branch."""
    g = torch.Generator().manual_seed(1)
    n = 40
    q = torch.ones(1, n, 1, 16) * 10 + torch.randn(1, n, 1, 16, generator=g)
    k = -torch.ones(1, n, 1, 16) * 10 + torch.randn(1, n, 1, 16, generator=g)
    v, do = torch.randn(1, n, 1, 16, generator=g), torch.randn(1, n, 1, 16, generator=g)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    kw = dict(block_mask=mask, block_size=16, return_lse=True)
    _check(lambda q, k, v: longattn.block_sparse_attention(q, k, v, backend="triton", **kw),
           lambda q, k, v: ref.block_sparse_attention(q, k, v, **kw), q, k, v, do, tol=2e-4)
    kw = dict(segment_lengths=(n,), dilation_rates=(1,), return_lse=True)
    _check(lambda q, k, v: longattn.dilated_attention(q, k, v, backend="triton", **kw),
           lambda q, k, v: ref.dilated_attention(q, k, v, **kw), q, k, v, do, tol=2e-4)


@pytest.mark.parametrize("dtype,slope,m", [(torch.float32, -4.0, 20), (torch.float32, -2.0, 40),
                                           (torch.float16, -0.3, 30)])
def test_backward_finite_with_negative_alibi_slopes(dtype, slope, m):
    """A negative ALiBi slope (a bonus growing with distance) gave the zero-padded query rows huge scores: their
    probabilities overflowed and inf times their zero dO made dK/dV NaN."""
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 20, 1, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    k, v = (torch.randn(1, m, 1, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    slopes = torch.tensor([slope])
    out = longattn.flash_attention(q, k, v, alibi_slopes=slopes, backend="triton")
    out.backward(do.detach())
    full = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = ref.flash_attention(*full, alibi_slopes=slopes)
    ref_out.backward(do.detach().double())
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    for got, want in zip((out, q.grad, k.grad, v.grad), (ref_out, *(t.grad for t in full))):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max().item())


def test_flash_float16():
    q, k, v, do = _inputs(1, 35, 35, 2, 2, 32, dtype=torch.float16)
    _check(*_flash(causal=True), q, k, v, do, tol=3e-3)


def test_flash_strided_inputs():
    """q, k, v as views into one packed projection (non-contiguous), as a fused qkv layer gives them."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 39, 3, 2, 32, generator=g)
    q, k, v = qkv.unbind(2)
    do = torch.randn(2, 39, 2, 32, generator=g)
    _check(*_flash(causal=True), q, k, v, do)


def test_flash_larger_tiles():
    """Hopper-sized tiles (in the interpreter) on a sequence a few tiles long."""
    q, k, v, do = _inputs(1, 150, 170, 2, 1, 64)
    with override_tiles(fwd=Tiles(64, 32, 4, 1), dkdv=Tiles(32, 64, 4, 1), dq=Tiles(64, 32, 4, 1)):
        _check(*_flash(causal=True), q, k, v, do)


def _mask(b, h, nq, nk, density, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, h, nq, nk, generator=g) < density
    mask[..., 0, :] = False  # an empty row of blocks
    return mask


@pytest.mark.parametrize("block,causal,bh,d", [
    (16, False, (2, 4), 16),
    ((32, 16), True, (1, 1), 16),     # broadcast mask, blocks taller than the tiles
    ((16, 64), False, (2, 1), 16),    # key blocks four tiles wide
    (32, True, (1, 4), 16),
    ((32, 64), False, (1, 4), 80),    # head dim over 64: a listed block's tiles are walked one at a time
    ((32, 512), False, (1, 4), 64),   # key blocks 32 tiles wide: unrolled 16 at a time (UNROLL_ELEMS)
])
def test_block_sparse_paths(block, causal, bh, d):
    n, m = 70, 90
    if block == (32, 512):
        n, m = 64, 1024  # whole (full) key blocks: the unrolled loop runs
    bq, bk = (block, block) if isinstance(block, int) else block
    q, k, v, do = _inputs(2, n, m, 4, 2, d, seed=3)
    mask = _mask(*bh, -(-n // bq), -(-m // bk), 0.5, seed=4)
    kw = dict(block_mask=mask, block_size=block, causal=causal)
    _check(lambda a, b_, c: longattn.block_sparse_attention(a, b_, c, return_lse=True, backend="triton", **kw),
           lambda a, b_, c: ref.block_sparse_attention(a, b_, c, return_lse=True, **kw), q, k, v, do)


@pytest.mark.parametrize("n,hq,hk,segs,rates,causal,head_split", [
    (45, 4, 2, (8, 16), (1, 2), False, False),
    (70, 4, 4, (16, 32, 100), (1, 2, 4), True, False),     # a segment longer than N
    (50, 6, 2, (16, 32), (1, 3), False, True),              # head split, GQA
    (40, 3, 1, (8, 64), (2, 8), True, False),               # no r = 1 branch: some rows of some heads unselected
    (33, 5, 5, (4, 10, 40), (5, 2, 4), True, True),         # dilation larger than the segment
    (29, 2, 1, (7,), (3,), False, False),                   # one branch, N not a multiple of the segment
])
def test_dilated_paths(n, hq, hk, segs, rates, causal, head_split):
    q, k, v, do = _inputs(1, n, n, hq, hk, 16, seed=n)
    kw = dict(segment_lengths=segs, dilation_rates=rates, causal=causal, head_split=head_split)
    _check(lambda a, b, c: longattn.dilated_attention(a, b, c, return_lse=True, backend="triton", **kw),
           lambda a, b, c: ref.dilated_attention(a, b, c, return_lse=True, **kw), q, k, v, do)


@pytest.mark.parametrize("case", [
    lambda: test_flash_paths(1, 37, 53, 4, 2, 32, True, (-1, -1)),
    lambda: test_flash_paths(1, 45, 45, 2, 2, 24, False, (7, 3)),
    lambda: test_flash_paths(2, 50, 29, 3, 1, 16, True, (-1, -1)),
    test_flash_strided_inputs,
    lambda: test_block_sparse_paths((32, 16), True, (1, 1), 16),
    lambda: test_block_sparse_paths((16, 64), False, (2, 1), 16),
    lambda: test_dilated_paths(70, 4, 4, (16, 32, 100), (1, 2, 4), True, False),
    lambda: test_dilated_paths(50, 6, 2, (16, 32), (1, 3), False, True),
], ids=["causal_gqa", "window_padded_d", "masked_rows", "strided", "sparse_causal", "sparse_wide", "dilated",
        "dilated_split"])
def test_tma_loads(case):
    """The same paths with K/V tiles loaded through tensor descriptors (Hopper's TMA; emulated by the interpreter):
    the view's end and the padded head dim come back as zeros instead of being masked."""
    with override_tma(True):
        case()


def test_ops_backward_with_merged_lse():
    """attention_backward on two key halves, fed the merged output and lse, sums to the full gradients."""
    from longattn import ops

    q, k, v, do = _inputs(1, 23, 41, 2, 1, 16, seed=9)
    o, lse = ops.attention_forward(q, k, v, backend="triton")
    halves = [(k[:, :20], v[:, :20]), (k[:, 20:], v[:, 20:])]
    parts = [ops.attention_forward(q, kk, vv, backend="triton") for kk, vv in halves]
    lse_m = torch.logaddexp(parts[0][1], parts[1][1])
    o_m = sum(p[0] * torch.exp(p[1] - lse_m).transpose(1, 2)[..., None] for p in parts)
    torch.testing.assert_close(o_m, o, atol=1e-5, rtol=1e-5)
    grads = [ops.attention_backward(do, q, kk, vv, o, lse, backend="triton") for kk, vv in halves]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref.flash_attention(q64, k64, v64).backward(do.double())
    torch.testing.assert_close(grads[0][0] + grads[1][0], q64.grad.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 1), k64.grad.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 1), v64.grad.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_ops_backward_grad_dtype_float32(backend):
    """``grad_dtype=float32`` returns unrounded float32 gradients of half-precision inputs (ring attention's partial
    gradients), equal to the default's up to its rounding."""
    from longattn import ops

    q, k, v, do = (x.half() for x in _inputs(1, 21, 37, 2, 1, 16, seed=5))
    o, lse = ops.attention_forward(q, k, v, causal=True, backend=backend)
    lo = ops.attention_backward(do, q, k, v, o, lse, causal=True, backend=backend)
    hi = ops.attention_backward(do, q, k, v, o, lse, causal=True, backend=backend, grad_dtype=torch.float32)
    for a, b in zip(lo, hi):
        assert a.dtype == torch.float16 and b.dtype == torch.float32
        torch.testing.assert_close(b.half(), a, atol=2e-3, rtol=2e-3)
    with pytest.raises(TypeError, match="grad_dtype"):
        ops.attention_backward(do, q, k, v, o, lse, backend=backend, grad_dtype=torch.bfloat16)


def test_lse_gradient():
    """A loss on the returned log-sum-exp back-propagates (folded into the backward's delta)."""
    q, k, v, _ = _inputs(1, 19, 27, 2, 2, 16, seed=11)

    def loss(fn, a, b, c):
        out, lse = fn(a, b, c)
        return (out.square().sum() + lse.double().sin().sum())

    qk, kk, vk = (x.clone().requires_grad_() for x in (q, k, v))
    loss(lambda a, b, c: longattn.flash_attention(a, b, c, causal=True, return_lse=True, backend="triton"),
         qk, kk, vk).backward()
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    loss(lambda a, b, c: ref.flash_attention(a, b, c, causal=True, return_lse=True), q64, k64, v64).backward()
    for got, want in ((qk.grad, q64.grad), (kk.grad, k64.grad), (vk.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_forward_float32_output_is_the_unrounded_result(backend):
    """``ops.attention_forward(out_dtype=torch.float32)`` (what ring attention merges): the same result as the
    default call before its final rounding, and closer to float64."""
    from longattn import ops

    q = torch.randn(2, 37, 4, 32, dtype=torch.float16)
    k, v = (torch.randn(2, 45, 2, 32, dtype=torch.float16) for _ in range(2))
    o16, l16 = ops.attention_forward(q, k, v, causal=True, backend=backend)
    o32, l32 = ops.attention_forward(q, k, v, causal=True, backend=backend, out_dtype=torch.float32)
    assert o32.dtype == torch.float32 and o16.dtype == torch.float16
    assert torch.equal(o32.to(torch.float16), o16) and torch.equal(l32, l16)
    want = ref.flash_attention(q.double(), k.double(), v.double(), causal=True)
    assert (o32.double() - want).abs().max() < 0.5 * (o16.double() - want).abs().max()
    with pytest.raises(TypeError, match="out_dtype"):
        ops.attention_forward(q, k, v, out_dtype=torch.float64, backend=backend)


def test_custom_op_registered_and_traceable():
    """The ops exist in torch.library with named parameters and fake implementations (so torch.compile keeps one
    graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import longattn.backends.triton.entry  # noqa: F401 - registers the ops

    assert hasattr(torch.ops.longattn, "attention_fwd") and hasattr(torch.ops.longattn, "attention_bwd")
    with FakeTensorMode():
        q = torch.empty(2, 8, 4, 32)
        k = torch.empty(2, 12, 2, 32)
        o, lse = torch.ops.longattn.attention_fwd(q, k, k, scale=0.1, causal=True)
        dq, dk, dv = torch.ops.longattn.attention_bwd(o, q, k, k, o, lse, scale=0.1, segments=[4], dilations=[2],
                                                      head_starts=[0], head_counts=[4], offsets=[-1])
    assert o.shape == q.shape and lse.shape == (2, 4, 8) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape


def test_op_parameters_round_trip_the_call():
    """The ops' named parameters describe every kind of call exactly (what torch.compile's graph carries)."""
    from longattn.backends.triton import entry as ops
    from longattn.backends.triton.lists import BlockLists
    from longattn.call import AttentionCall, BlockSparse, Descale, dilated_branches, flash_call

    lists = BlockLists(*(torch.zeros(1, 1, 2, 2, dtype=torch.int32) for _ in range(4)))
    calls = [flash_call(0.5, True, (3, -1)),
             AttentionCall(scale=0.5, window=(4, 1), descale=Descale(torch.rand(3, 2, 1)), out_dtype=torch.float16),
             AttentionCall(scale=0.5, causal=True, out_dtype=torch.float32),
             AttentionCall(scale=0.3, causal=True, branches=dilated_branches(40, 5, [8, 16], [1, 4], False)),
             AttentionCall(scale=0.3, branches=dilated_branches(40, 5, [8, 16, 32], [1, 2, 4], True)),
             AttentionCall(scale=0.2, causal=True, blocks=BlockSparse(None, (16, 32), lists))]
    for call in calls:
        tensors, kwargs = ops._op_args(call)
        back = ops._call_of(*tensors, **kwargs)
        assert (back.scale, back.causal, back.window, back.branches) == (call.scale, call.causal, call.window,
                                                                         call.branches)
        assert (back.blocks is None) == (call.blocks is None)
        if call.blocks is not None:
            assert back.blocks.block_size == call.blocks.block_size and back.blocks.lists == call.blocks.lists
        assert (back.descale is None) == (call.descale is None) and back.out_dtype == call.out_dtype
        if call.descale is not None:
            assert back.descale.scales is call.descale.scales


def test_planner_runs_newer_architectures_kernels_only_where_the_device_has_them():
    """A kernel for a newer architecture (the Gluon sm_90 forward) is planned only for devices that have it; older
    ones, newer ones it was not written for, and CPU tensors keep the portable kernel, each with the reason."""
    from longattn.backends.device import Device
    from longattn.backends.triton import planner
    from longattn.call import flash_call

    q = torch.randn(1, 64, 2, 64, dtype=torch.float16)
    call = flash_call(0.125)
    assert planner.forward(q, q, q, call)[0].chosen.kernel == planner.TRITON_FWD
    with longattn.routing(min_keys={}):
        for cap, want in (((8, 0), planner.TRITON_FWD), ((9, 0), planner.GLUON_FWD), ((10, 0), planner.TRITON_FWD)):
            with longattn.routing(device=Device(capability=cap, interpret=True, gluon=True)):
                (fwd,) = planner.forward(q, q, q, call)
            assert fwd.chosen.kernel == want
            assert (fwd.rejected == ()) == (want == planner.GLUON_FWD)
            if want == planner.TRITON_FWD:
                assert fwd.rejected[0].reason == "not a Hopper (sm_90) GPU"
    from longattn.backends.triton import decode_launch, entry

    assert entry.decode.__module__ == entry.__name__ and decode_launch.PLANS is not None


def test_backend_triton_rejects_unsupported():
    q = torch.randn(1, 8, 2, 300)
    with pytest.raises((ValueError, TypeError)):
        longattn.flash_attention(q, q, q, backend="triton")


def test_tile_table_selection(monkeypatch):
    """The GPU tile table: every entry is what its key selects; a key without an entry falls back to the head-dim
    bound's general entry; block-list calls ignore the view's rows; every pick fits a block mask after
    ``fit_tiles`` (the choice itself is tuned on the GPU, not here)."""
    from longattn.backends.triton import tiles as T

    from longattn.backends.device import Device
    gpu = torch.device("cuda", 0)
    rows_for = {"short": T.SHORT_ROWS, "segment": T.SEGMENT_ROWS, "long": T.SEGMENT_ROWS + 1, "*": None}
    flags = {"dense": (False, False), "banded": (True, False), "list": (False, True), "list+band": (True, True)}
    for major, arch in ((9, "sm90"), (8, "sm80")):
        routed = longattn.routing(device=Device(capability=(major, 0)))
        routed.__enter__()
        for pass_name in ("fwd", "dkdv", "dq"):
            for bound in T.HEAD_DIM_BOUNDS:
                general = T.TABLE[(arch, pass_name, bound, "*", "*")]
                for path, (banded, listed) in flags.items():
                    for rows_key, rows in rows_for.items():
                        got = T.tiles_for(pass_name, bound, gpu, banded=banded, listed=listed, rows=rows)
                        lookup_rows = "*" if listed else rows_key
                        want = T.TABLE.get((arch, pass_name, bound, path, lookup_rows),
                                           T.TABLE.get((arch, pass_name, bound, path, "*"), general))
                        assert got == want, (arch, pass_name, bound, path, rows_key)
                        assert T.tiles_for(pass_name, bound - 1, gpu, banded=banded, listed=listed, rows=rows) == got
                        fitted = T.fit_tiles(got, 64, 32)
                        assert 64 % fitted.block_m == 0 and 32 % fitted.block_n == 0
        with pytest.raises(ValueError, match="256"):
            T.tiles_for("fwd", 512, gpu)
        # the float8 forward: its own entries where it has them, the forward's elsewhere
        for bound in T.HEAD_DIM_BOUNDS:
            for path, (banded, listed) in flags.items():
                own = T.TABLE.get((arch, "fwd_fp8", bound, path, "*"), T.TABLE.get((arch, "fwd_fp8", bound, "*", "*")))
                got = T.tiles_for("fwd_fp8", bound, gpu, banded=banded, listed=listed, rows=T.SEGMENT_ROWS + 1)
                assert got == (own or T.tiles_for("fwd", bound, gpu, banded=banded, listed=listed,
                                                  rows=T.SEGMENT_ROWS + 1))
        routed.__exit__(None, None, None)
    with longattn.routing(device=Device(capability=(9, 0))):
        assert T.tiles_for("fwd_fp8", 256, gpu) != T.tiles_for("fwd", 256, gpu)  # sm90 has a float8 entry at D=256
    assert all(key[0] in ("sm90", "sm80") and key[3] in (*flags, "*") and key[4] in rows_for for key in T.TABLE)


def test_tma_alignment_check():
    """Descriptor loads only where TMA's alignment holds; anything else takes the plain loads (same results)."""
    from longattn.backends.triton import launch

    view = launch.SeqView(seg_q=64, seg_k=64, n_seg=1, n_heads=2)
    x = torch.randn(1, 64, 2, 40, dtype=torch.float16)
    with override_tma(True):
        assert launch._tma_ok(view, x[..., :32].contiguous())
        assert launch._tma_ok(view, x[..., :36])              # a narrower view of 80-byte rows is fine...
        assert not launch._tma_ok(view, x[..., 1:33])         # ...a base 2 bytes off 16-byte alignment is not
        assert not launch._tma_ok(view, x[..., :32].transpose(-1, -2).contiguous().transpose(-1, -2))
        assert not launch._tma_ok(view, x[:, :1, :, :32].contiguous().expand(1, 64, 2, 32))  # sequence stride 0
        y = torch.randn(1, 64, 2, 36, dtype=torch.float16)
        assert not launch._tma_ok(view, y[..., :32])          # 72-byte rows
    with override_tma(False):
        assert not launch._tma_ok(view, x[..., :32].contiguous())


@pytest.mark.parametrize("kind", ["flash", "dilated", "block_sparse", "sinks"])
def test_compile_fullgraph_through_the_ops(kind):
    """Under torch.compile (aot_eager, fake tensors) the one autograd Function calls the custom ops: forward and
    backward match eager, for each kind of call."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g) for _ in range(3))
    mask = torch.rand(1, 2, 3, 3, generator=g) < 0.6
    sinks = torch.randn(2, generator=g)

    def f(q, k, v):
        if kind == "sinks":  # the sinks and their gradient through ops of their own
            return longattn.flash_attention(q, k, v, causal=True, sinks=sinks_arg, backend="triton")
        if kind == "flash":
            return longattn.flash_attention(q, k, v, window=(7, 2), backend="triton")
        if kind == "dilated":
            return longattn.dilated_attention(q, k, v, segment_lengths=[16, 32], dilation_rates=[1, 2], causal=True,
                                              backend="triton")
        return longattn.block_sparse_attention(q, k, v, block_mask=mask, block_size=16, causal=True,
                                               backend="triton")

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        sinks_arg = sinks.clone().requires_grad_()
        out = fn(qs, ks, vs)
        (out.sum() if kind == "sinks" else out.square().sum()).backward()  # out.sum(): an expanded dO
        results.append((out, qs.grad, ks.grad, vs.grad) + ((sinks_arg.grad,) if kind == "sinks" else ()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paired", [False, True])
def test_row_statistics_in_both_layouts(paired):
    """The backward's row statistics: the log-sum-exp in base 2 (+inf where it is -inf, so a query that saw no
    key weighs 0) and rowsum(dO * O), as two planes or as interleaved pairs, read back through RowStats.delta."""
    import math

    from longattn.backends.triton import launch

    g = torch.Generator().manual_seed(1)
    o, do = (torch.randn(2, 37, 3, 24, generator=g) for _ in range(2))
    lse = torch.randn(2, 3, 37, generator=g)
    lse[1, 2, 5] = float("-inf")
    stats = launch.row_stats(o, do, lse, paired=paired)
    assert stats.paired is paired and stats.values.shape == ((2, 3, 37, 2) if paired else (2, 2, 3, 37))
    lse2 = stats.values[..., 0] if paired else stats.values[0]
    want = torch.where(lse == float("-inf"), float("inf"), lse) / math.log(2)
    torch.testing.assert_close(lse2, want)
    torch.testing.assert_close(stats.delta, (o * do).sum(-1).transpose(1, 2))


@pytest.mark.parametrize("window", [(2 ** 31 - 1, 0), (2 ** 31 - 50, -1), (-1, 2 ** 31 - 1), (2 ** 30, 2 ** 30)])
def test_windows_wider_than_any_sequence(window):
    """A window side of 2**30 keys or more covers any sequence: the kernels treat it as unbounded instead of
    overflowing their 32-bit position arithmetic (``i + shift + right`` near 2**31 wrapped to a negative bound)."""
    q, k, v, do = _inputs(1, 100, 100, 2, 1, 16, seed=5)
    _check(lambda a, b_, c: longattn.flash_attention(a, b_, c, window=window, return_lse=True, backend="triton"),
           lambda a, b_, c: ref.flash_attention(a, b_, c, window=window, return_lse=True), q, k, v, do)


def test_bfloat16_is_refused_in_the_interpreter():
    """The Triton interpreter multiplies bfloat16 operands of ``tl.dot`` as integers (results of 1e8): an explicit
    ``backend="triton"`` on the CPU says so; ``"auto"`` runs the PyTorch backend."""
    q = torch.randn(1, 40, 2, 16).bfloat16()
    with pytest.raises(ValueError, match="bfloat16"):
        longattn.flash_attention(q, q, q, causal=True, backend="triton")
    want = longattn.flash_attention(q.float(), q.float(), q.float(), causal=True, backend="torch")
    torch.testing.assert_close(longattn.flash_attention(q, q, q, causal=True).float(), want, atol=2e-2, rtol=2e-2)
