"""GPU tests of the Triton kernels in bf16/fp16 at larger sizes, against the float32 reference on the GPU.

Skipped without CUDA. Run on a GPU with ``python -m pytest -q tests/gpu``.
"""
import pytest
import torch

import _rows as rows

import longattn
from longattn import reference as ref
from longattn.utils import cu_seqlens_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = (torch.bfloat16, torch.float16)


def _inputs(b, n, m, hq, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, n, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, m, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, m, hk, d, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(b, n, hq, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


def _rel(a, b):
    assert torch.isfinite(a).all(), "non-finite values"
    return rows.rel(a, b)


def _compare(fn_kernel, fn_ref, q, k, v, do, tol=2e-2):
    """Output, lse and the three gradients of the kernel (half precision) against the reference in float32."""
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn_kernel(qs, ks, vs)
    out.backward(do)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    rout, rlse = fn_ref(q32, k32, v32)
    rout.backward(do.float())
    assert _rel(out, rout) < tol
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - rlse[fin].float()).abs().max().item() < 5e-2
    for got, want in ((qs.grad, q32.grad), (ks.grad, k32.grad), (vs.grad, v32.grad)):
        assert _rel(got, want) < tol


def _assert_compiled_matches_eager(f, q, k, v, do):
    """``f(q, k, v)`` under ``torch.compile(fullgraph=True)`` gives the eager output and gradients."""
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = fn(qs, ks, vs)
        out.backward(do)
        grads.append((out, qs.grad, ks.grad, vs.grad))
    for eager, compiled in zip(*grads):
        assert _rel(compiled, eager) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal,window,n,m,hq,hk", [
    (False, (-1, -1), 1000, 1000, 4, 4),
    (True, (-1, -1), 777, 1283, 8, 2),
    (True, (-1, -1), 1283, 777, 4, 1),   # many fully masked rows
    (False, (200, 65), 1537, 1537, 6, 3),
    (False, (-1, -1), 1537, 1900, 4, 2),  # 1025-2048 rows: the segment-length tile entries
])
def test_flash(dtype, d, causal, window, n, m, hq, hk):
    q, k, v, do = _inputs(2, n, m, hq, hk, d, dtype)
    kw = dict(causal=causal, window=window)
    _compare(lambda a, b, c: longattn.flash_attention(a, b, c, return_lse=True, backend="triton", **kw),
             lambda a, b, c: ref.flash_attention(a, b, c, return_lse=True, **kw), q, k, v, do)


@pytest.mark.parametrize("offset", [0, 1])
def test_flash_tma_and_unaligned_views(offset):
    """Long views (TMA loads on Hopper) into one flat buffer: offset 0 keeps 16-byte alignment; offset 1 puts every
    base 2 bytes off it, so the kernels must take their plain loads. Both must match the reference."""
    n, h, d = 1500, 4, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    flat = torch.randn(3 * n * h * d + offset, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    q, k, v = flat[offset:].view(3, 1, n, h, d).unbind(0)  # views, not copies: the kernels see these pointers
    assert (q.data_ptr() % 16 == 0) == (offset == 0)
    do = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = longattn.flash_attention(q, k, v, return_lse=True, backend="triton", causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    rout, rlse = ref.flash_attention(q32, k32, v32, return_lse=True, causal=True)
    rout.backward(do.float())
    assert _rel(out, rout) < 2e-2
    assert (lse - rlse).abs().max().item() < 5e-2
    for got, want in zip(grads, (q32.grad, k32.grad, v32.grad)):
        assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [64, 128, (128, 64)])
def test_block_sparse(dtype, causal, block):
    n, m = 1100, 1300
    bq, bk = (block, block) if isinstance(block, int) else block
    q, k, v, do = _inputs(2, n, m, 4, 2, 64, dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    mask = torch.rand(2, 4, -(-n // bq), -(-m // bk), device="cuda", generator=g) < 0.3
    kw = dict(block_mask=mask, block_size=block, causal=causal)
    _compare(lambda a, b, c: longattn.block_sparse_attention(a, b, c, return_lse=True, backend="triton", **kw),
             lambda a, b, c: ref.block_sparse_attention(a, b, c, return_lse=True, **kw), q, k, v, do)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_split", [False, True])
@pytest.mark.parametrize("hq,hk", [(8, 8), (8, 2)])
def test_dilated(dtype, causal, head_split, hq, hk):
    n = 3000  # not a multiple of any segment
    q, k, v, do = _inputs(1, n, n, hq, hk, 64, dtype)
    kw = dict(segment_lengths=(256, 512, 1024, 4096), dilation_rates=(1, 2, 4, 8), causal=causal,
              head_split=head_split)
    _compare(lambda a, b, c: longattn.dilated_attention(a, b, c, return_lse=True, backend="triton", **kw),
             lambda a, b, c: ref.dilated_attention(a, b, c, return_lse=True, **kw), q, k, v, do)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk", [(8, 8), (8, 2)])
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_dilated_segment_views(dtype, hq, hk, d, causal):
    """Branches of 1025-2048 rows (LongNet's usual w / r = 2048): their own tile entries, descriptor loads."""
    n = 5000
    q, k, v, do = _inputs(1, n, n, hq, hk, d, dtype)
    kw = dict(segment_lengths=(2048, 4096), dilation_rates=(1, 2), causal=causal)
    _compare(lambda a, b, c: longattn.dilated_attention(a, b, c, return_lse=True, backend="triton", **kw),
             lambda a, b, c: ref.dilated_attention(a, b, c, return_lse=True, **kw), q, k, v, do)


def test_compile_keeps_graph():
    q, k, v, _ = _inputs(1, 512, 512, 4, 4, 64, torch.bfloat16)

    def f(q, k, v):
        return longattn.flash_attention(q, k, v, causal=True, backend="triton") * 2

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_block_sparse_call_refuses_a_mask_edited_after_compiling(mode):
    """A pattern's mask written in place after the call was compiled is refused on the next call, also under CUDA
    graphs (``reduce-overhead``: the check's operator is tagged unsafe for them, so replays do not skip it), rather
    than the compiled call serving the old mask's block lists."""
    from longattn.patterns import BlockSparsePattern
    q, k, v, _ = _inputs(1, 512, 512, 4, 2, 64, torch.bfloat16)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda").tril()
    pattern = BlockSparsePattern(mask, 128, seq_lens=(512, 512))
    compiled = torch.compile(lambda q, k, v: longattn.block_sparse_attention(q, k, v, block_mask=pattern,
                                                                             backend="triton"), mode=mode)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(q, k, v)
        want = ref.block_sparse_attention(q.float(), k.float(), v.float(), block_mask=mask, block_size=128)
        assert _rel(out, want) < 2e-2
        mask[0, 0, 3, 0] = False
        with pytest.raises(RuntimeError, match="modified in place"):
            compiled(q, k, v)


def test_raw_mask_call_never_syncs_with_the_host():
    """A raw block mask is converted on the device in one launch: the whole call runs without a host sync."""
    q, k, v, _ = _inputs(1, 1000, 900, 4, 2, 64, torch.bfloat16)
    mask = torch.rand(1, 4, 8, 8, device="cuda") < 0.4
    longattn.block_sparse_attention(q, k, v, block_mask=mask, causal=True, backend="triton")  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            out = longattn.block_sparse_attention(q, k, v, block_mask=mask, causal=True, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = ref.block_sparse_attention(q.float(), k.float(), v.float(), block_mask=mask, block_size=128, causal=True)
    assert _rel(out, want) < 2e-2


@pytest.mark.parametrize("kind", ["dilated", "block_sparse"])
def test_compile_fullgraph_forward_and_backward(kind):
    """The custom ops keep dilated and block-sparse calls single nodes under torch.compile, gradients included."""
    q, k, v, do = _inputs(1, 700, 700, 4, 2, 64, torch.bfloat16)
    mask = torch.rand(1, 1, 6, 6, device="cuda") < 0.5

    def f(q, k, v):
        if kind == "dilated":
            return longattn.dilated_attention(q, k, v, segment_lengths=[256, 512], dilation_rates=[1, 2],
                                              causal=True, backend="triton")
        return longattn.block_sparse_attention(q, k, v, block_mask=mask, causal=True, backend="triton")

    _assert_compiled_matches_eager(f, q, k, v, do)


def _cu(lens):
    return cu_seqlens_of(lens, "cuda")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window=(100, 20))])
def test_flash_attention_varlen_on_the_gpu(d, kw):
    """Packed sequences (one launch per pass; TMA loads on Hopper) in bf16 against the float32 reference."""
    lens_q, lens_k = [300, 0, 1000, 17, 513, 1], [300, 64, 900, 17, 0, 2000]
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(sum(lens_q), 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lens_k), 2, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    kw = dict(cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k), **kw)
    _compare(lambda a, b, c: longattn.flash_attention_varlen(a, b, c, return_lse=True, backend="auto", **kw),
             lambda a, b, c: ref.flash_attention_varlen(a, b, c, return_lse=True, **kw), q, k, v, do)


@pytest.mark.parametrize("kw", [dict(segment_lengths=[256, 1024], dilation_rates=[1, 4], causal=True),
                                dict(segment_lengths=[128, 512, 2048], dilation_rates=[1, 2, 4], head_split=True)])
def test_dilated_attention_varlen_on_the_gpu(kw):
    lens = [700, 3, 2100, 0, 129]
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    _compare(lambda a, b, c: longattn.dilated_attention_varlen(a, b, c, cu_seqlens=_cu(lens), return_lse=True,
                                                               **kw),
             lambda a, b, c: ref.dilated_attention_varlen(a, b, c, cu_seqlens=_cu(lens), return_lse=True, **kw),
             q, k, v, do)


def test_varlen_custom_ops_under_compile():
    """The packed call through the custom ops (compiled, inductor) equals the eager one."""
    from longattn.backends.triton import entry as ops
    from longattn.call import AttentionCall, SeqLens

    lens = [300, 5, 700]
    cu = _cu(lens)
    call = AttentionCall(scale=0.125, causal=True, seqlens=SeqLens(cu, cu, 700, 700))
    q, k, v, do = _inputs(1, sum(lens), sum(lens), 4, 2, 64, torch.bfloat16)

    def f(a, b, c):
        return ops.attention(a, b, c, call)[0]

    _assert_compiled_matches_eager(f, q, k, v, do)


@pytest.mark.parametrize("gluon", ["1", "0"])
@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (128, False), (256, True)])
def test_float32_partial_output_is_the_unrounded_result(d, causal, gluon, monkeypatch):
    """``ops.attention_forward(out_dtype=torch.float32)`` (ring attention's partials) on the GPU kernels, Gluon
    forward included at D=128: rounding it gives the default output bit for bit, the log-sum-exp is the same."""
    from longattn import ops

    monkeypatch.setenv("LONGATTN_GLUON", gluon)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 1500, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1300, 2, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    o16, l16 = ops.attention_forward(q, k, v, causal=causal, backend="triton")
    o32, l32 = ops.attention_forward(q, k, v, causal=causal, backend="triton", out_dtype=torch.float32)
    assert o32.dtype == torch.float32
    assert torch.equal(o32.to(torch.bfloat16), o16) and torch.equal(l32, l16)
    want = ref.flash_attention(q.double(), k.double(), v.double(), causal=causal)
    assert (o32.double() - want).abs().max() < (o16.double() - want).abs().max()
