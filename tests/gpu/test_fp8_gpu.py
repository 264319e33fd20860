"""GPU tests of the FP8 forward on the Triton kernels: against the float64 reference on the dequantised
values, with the error bound FP8 allows. Skipped unless the GPU has float8 tensor cores (sm_89 or newer).

The bound: the probabilities are rounded to float8 (e4m3: 3 mantissa bits, a relative error of at most 2**-4)
for the ``P V`` product while the row sums keep them unrounded, and the scores ``q k^T`` are exact products of float8
values summed by the tensor cores, whose FP8 accumulation keeps about 14 bits on Hopper: a score error of at most
``e_s = 2**-10 * scale * max sum_d |q_d k_d|`` (4x margin), a weight error of ``expm1(2 e_s)``. Hence, per output
element, ``|err| <= (2**-4 + expm1(2 e_s)) * max|v|`` (worst case, every error in one direction) and, the roundings
being independent, an RMS error of a few percent of the output's RMS: the tests check that max and
``rms <= 0.06 * rms(out)`` (a descale factor applied wrongly, even by 2x, fails the second). Inputs with large
outliers have large scores, so ``e_s`` (and the max bound) grows with them; the RMS check does not."""
import math

import contextlib

import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.utils import cu_seqlens_of

@pytest.fixture
def routed():
    """``routed(**settings)``: routing settings (``longattn.routing``) in force for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(longattn.routing(**settings))


F8 = torch.float8_e4m3fn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with float8 tensor cores (sm_89 or newer)")


def _fp8(shape, g, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(F8)


def _score_error(q, k, scale=None):
    """``e_s`` of the module's bound for dequantised ``q (B, N, Hq, D)``, ``k (B, M, Hk, D)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[2] // k.shape[2]
    qa, ka = q.abs().float(), k.abs().float().repeat_interleave(g, dim=2)
    top = torch.einsum("bnhd,bmhd->bhnm", qa, ka).amax()
    return 2 ** -10 * scale * float(top)


def _check(out, want, v_deq, e_s=0.0):
    err = (out.double() - want).abs()
    assert torch.isfinite(out).all()
    bound = (2 ** -4 + math.expm1(2 * e_s)) * v_deq.abs().max() + 1e-3
    assert err.max() <= bound, (float(err.max()), float(bound))
    rms = lambda x: x.square().mean().sqrt()  # noqa: E731
    assert rms(err) <= 0.06 * rms(want) + 1e-4, (float(rms(err)), float(rms(want)))


CASES = [  # (batch, queries, keys, query heads, kv heads, head dim, causal, window)
    (1, 1, 1, 2, 2, 64, False, (-1, -1)),
    (2, 100, 100, 3, 3, 128, False, (-1, -1)),
    (1, 129, 257, 8, 2, 128, True, (-1, -1)),
    (1, 1000, 300, 2, 1, 128, True, (-1, -1)),  # the first query blocks see no key
    (2, 777, 1234, 4, 2, 64, False, (-1, -1)),
    (1, 1500, 1500, 4, 4, 128, False, (100, 50)),
    (1, 513, 700, 2, 2, 256, True, (-1, -1)),
    (2, 300, 301, 2, 1, 80, False, (-1, -1)),  # a head dim that is not a power of two
    (1, 2049, 2049, 2, 2, 32, True, (-1, -1)),
]


@pytest.mark.parametrize("kind", ["tensor", "head"])
@pytest.mark.parametrize("case", CASES)
def test_fp8_forward_against_the_reference(case, kind):
    b, n, m, hq, hk, d, causal, window = case
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = _fp8((b, n, hq, d), g), _fp8((b, m, hk, d), g), _fp8((b, m, hk, d), g)
    shape = (1,) if kind == "tensor" else (b, hk)
    qd, kd, vd = (torch.rand(shape, device="cuda", generator=g) + 0.25 for _ in range(3))
    out, lse = longattn.flash_attention(q, k, v, causal=causal, window=window, q_descale=qd, k_descale=kd,
                                        v_descale=vd, out_dtype=torch.float32, return_lse=True, backend="triton")
    deq = [ref.dequantize_fp8(x, s) for x, s in ((q, qd), (k, kd), (v, vd))]
    want, want_lse = ref.flash_attention(*deq, causal=causal, window=window, return_lse=True)
    _check(out, want, deq[2], _score_error(deq[0], deq[1]))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=2e-3, rtol=1e-4)


def test_fp8_default_output_and_auto_backend():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (_fp8((2, 1000, 4, 128), g) for _ in range(3))
    out = longattn.flash_attention(q, k, v, causal=True)  # auto: the Triton kernels
    assert out.dtype == torch.bfloat16
    want = ref.flash_attention(*(ref.dequantize_fp8(x, None) for x in (q, k, v)), causal=True)
    _check(out, want, v.double(), _score_error(q.double(), k.double()))
    torch.testing.assert_close(out, longattn.flash_attention(q, k, v, causal=True, backend="triton"))


def test_fp8_varlen_per_sequence_descales():
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [1, 0, 300, 129, 1000]
    cu = cu_seqlens_of(lens, "cuda")
    q, k, v = _fp8((sum(lens), 4, 128), g), _fp8((sum(lens), 2, 128), g), _fp8((sum(lens), 2, 128), g)
    qd, kd, vd = (torch.rand(len(lens), 2, device="cuda", generator=g) + 0.25 for _ in range(3))
    out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, q_descale=qd,
                                          k_descale=kd, v_descale=vd, out_dtype=torch.float32, backend="triton")
    c = cu.tolist()
    for s in range(len(lens)):
        if lens[s] == 0:
            continue
        deq = [ref.dequantize_fp8(x[None, c[s]:c[s + 1]], d[s:s + 1]) for x, d in ((q, qd), (k, kd), (v, vd))]
        _check(out[None, c[s]:c[s + 1]], ref.flash_attention(*deq, causal=True), deq[2], _score_error(deq[0], deq[1]))


def test_fp8_dilated():
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (_fp8((2, 3000, 4, 64), g) for _ in range(3))
    qd, kd, vd = (torch.rand(2, 4, device="cuda", generator=g) + 0.25 for _ in range(3))
    kw = dict(segment_lengths=[512, 1024, 2048], dilation_rates=[1, 2, 4], causal=True)
    out = longattn.dilated_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32,
                                     backend="triton", **kw)
    deq = [ref.dequantize_fp8(x, s) for x, s in ((q, qd), (k, kd), (v, vd))]
    _check(out, ref.dilated_attention(*deq, **kw), deq[2], _score_error(deq[0], deq[1]))


def test_fp8_outliers_keep_the_bound():
    """Outlier-heavy inputs (a few channels 30x larger), quantised per head: the kernel is still within FP8's
    bound of the reference on the dequantised values."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = [torch.randn(1, 2000, 4, 128, device="cuda", generator=g) for _ in range(3)]
    for t in x:
        t[..., :4] *= 30
    (q, qd), (k, kd), (v, vd) = (longattn.quantize_fp8(t, per_head=True) for t in x)
    out = longattn.flash_attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                   out_dtype=torch.float32)
    deq = [ref.dequantize_fp8(a, s) for a, s in ((q, qd), (k, kd), (v, vd))]
    _check(out, ref.flash_attention(*deq, causal=True), deq[2], _score_error(deq[0], deq[1]))


def _gluon_on_hopper() -> bool:
    from longattn.backends.gluon import launch
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
            and launch.kernel_module() is not None)


# More tiles than SMs (programs run several tiles in a row), tiles without keys among them.
MANY_TILES = [(4, 3000, 1000, 8, 2, 128, True, (-1, -1)), (2, 2500, 2600, 16, 4, 128, False, (-1, -1)),
              (4, 3000, 1000, 8, 2, 64, True, (-1, -1)), (2, 2500, 2600, 8, 4, 256, False, (-1, -1))]
# The Gluon kernel's float8 head dims (its tiles' rows of 64, 128 and 256 bytes; launch.FP8_KERNEL_HEAD_DIMS, not
# imported here: the module imports on machines without Gluon too).
GLUON_FP8_HEAD_DIMS = (64, 128, 256)
# The routing that sends these tests' float8 calls to the Gluon forward, short ones too.
TO_GLUON = {"fp8_head_dims": GLUON_FP8_HEAD_DIMS, "fp8_min_keys": 0}
# D=64 and D=256 on awkward shapes: grouped-query heads, causal with N > M (query blocks that see no key) and N < M,
# sliding windows, key counts that are not a multiple of 16 (V's permuted groups padded); D=128 with a window; D=64
# and D=128 without a band (launch.FP8_UNMASKED_TILES: 256-key blocks, each P V waited for before the next Q K^T),
# a last key block cut short.
GLUON_FP8_CASES = [(1, 1000, 301, 4, 2, 64, True, (-1, -1)), (2, 700, 900, 6, 2, 64, False, (300, 200)),
                   (1, 300, 1001, 4, 1, 256, True, (-1, -1)), (1, 1500, 1500, 2, 2, 256, False, (100, 50)),
                   (2, 129, 257, 8, 2, 256, True, (-1, -1)), (1, 2000, 2100, 4, 2, 128, False, (700, 300)),
                   (1, 1000, 1301, 4, 2, 128, False, (-1, -1)), (2, 333, 777, 4, 1, 64, False, (-1, -1))]


def _gluon_and_triton_forwards_match(monkeypatch, q, k, v, descales, causal, window):
    """The planner sends this FP8 call to the Gluon forward; it and the Triton FP8 forward (``LONGATTN_GLUON=0``)
    match float64 on the dequantised inputs, outputs and log-sum-exp (``-inf`` where the reference has it)."""
    from longattn.backends.gluon import launch
    from longattn.backends.triton import planner
    from longattn.backends.triton.fp8_layout import seq_major
    from longattn.call import AttentionCall, Descale
    qd, kd, vd = descales
    call = AttentionCall(q.shape[-1] ** -0.5, descale=Descale(torch.stack([qd, kd, vd])))
    with longattn.routing(**TO_GLUON):
        assert planner.forward(q, k, seq_major(v), call)[0].chosen.kernel == planner.GLUON_FWD
    deq = [ref.dequantize_fp8(x, s) for x, s in ((q, qd), (k, kd), (v, vd))]
    want, want_lse = ref.flash_attention(*deq, causal=causal, window=window, return_lse=True)
    for gluon in ("1", "0"):
        monkeypatch.setenv("LONGATTN_GLUON", gluon)
        with longattn.routing(**TO_GLUON):
            out, lse = longattn.flash_attention(q, k, v, causal=causal, window=window, q_descale=qd, k_descale=kd,
                                                v_descale=vd, out_dtype=torch.float32, return_lse=True)
        assert not launch._fp8_failed  # the Gluon kernel ran (a failure would fall back to Triton silently)
        _check(out, want, deq[2], _score_error(deq[0], deq[1]))
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        fin = torch.isfinite(want_lse)
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=2e-3, rtol=1e-4)


@pytest.mark.skipif(not _gluon_on_hopper(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [c for c in CASES if c[5] in GLUON_FP8_HEAD_DIMS] + GLUON_FP8_CASES + MANY_TILES)
def test_fp8_gluon_forward_and_the_triton_one(case, monkeypatch):
    """The Gluon kernel's FP8 forward at each of its head dims (routed to it here, whatever the routing's default
    ``fp8_head_dims``) and the Triton FP8 forward keep FP8's bound of the reference."""
    b, n, m, hq, hk, d, causal, window = case
    g = torch.Generator(device="cuda").manual_seed(7 * n + m)
    q, k, v = _fp8((b, n, hq, d), g), _fp8((b, m, hk, d), g), _fp8((b, m, hk, d), g)
    qd, kd, vd = (torch.rand(b, hk, device="cuda", generator=g) + 0.25 for _ in range(3))
    _gluon_and_triton_forwards_match(monkeypatch, q, k, v, (qd, kd, vd), causal, window)


@pytest.mark.skipif(not _gluon_on_hopper(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("d", GLUON_FP8_HEAD_DIMS)
@pytest.mark.parametrize("layout", ["offset", "sequence-major", "head-dim stride 2", "keys reversed"])
def test_fp8_gluon_forward_takes_values_in_any_layout(layout, d, routed):
    """The Gluon FP8 forward copies V into its own layout from V as given (no sequence-major copy first): V as a
    view with an offset, already sequence-major, with a head-dim stride of 2, or with a negative key stride read as
    a copy by the caller's ``flip``; each against the reference, M = 301 (not a multiple of 16)."""
    from longattn.backends.gluon import launch
    from longattn.backends.triton import planner
    from longattn.call import AttentionCall, Descale

    b, n, m, hq, hk = 2, 200, 301, 4, 2
    routed(**TO_GLUON)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k = _fp8((b, n, hq, d), g), _fp8((b, m, hk, d), g)
    if layout == "offset":
        v = _fp8((b, m + 3, hk, d), g)[:, 3:]
    elif layout == "sequence-major":
        v = _fp8((b, m, hk, d), g).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    elif layout == "head-dim stride 2":
        v = _fp8((b, m, hk, 2 * d), g)[..., ::2]
    else:
        v = _fp8((b, m, hk, d), g).flip(1)
    qd, kd, vd = (torch.rand(b, hk, device="cuda", generator=g) + 0.25 for _ in range(3))
    call = AttentionCall(d ** -0.5, descale=Descale(torch.stack([qd, kd, vd])))
    assert planner.forward(q, k, v, call)[0].chosen.kernel == planner.GLUON_FWD
    deq = [ref.dequantize_fp8(x, s) for x, s in ((q, qd), (k, kd), (v, vd))]
    for causal in (False, True):
        want = ref.flash_attention(*deq, causal=causal)
        out = longattn.flash_attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                       out_dtype=torch.float32)
        assert d not in launch._fp8_failed  # the Gluon kernel ran (a failure would fall back to Triton silently)
        _check(out, want, deq[2], _score_error(deq[0], deq[1]))


@pytest.mark.skipif(not _gluon_on_hopper(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("n, m, causal, window", [(700, 900, False, (-1, -1)), (700, 900, True, (-1, -1)),
                                                  (700, 900, False, (300, 200)), (900, 700, True, (-1, -1))])
@pytest.mark.parametrize("d", GLUON_FP8_HEAD_DIMS)
def test_fp8_gluon_forward_with_descales_of_either_sign(n, m, causal, window, d, monkeypatch):
    """Descale factors of either sign and zero, mixed over the (batch, KV head) pairs of one launch: the Gluon
    kernel's unmasked key blocks take the row maxima of the unscaled scores times the scale where the product
    ``scale * q_descale * k_descale`` is positive, the minima where it is negative (a branch a tile), and a zero
    product gives every visible key the same weight; with N > M (causal) rows without a key meet every sign too.
    Against the reference, and the Triton forward too."""
    b, hq, hk = 2, 4, 2
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = _fp8((b, n, hq, d), g), _fp8((b, m, hk, d), g), _fp8((b, m, hk, d), g)
    qd = torch.tensor([[0.7, -0.5], [-1.1, 0.0]], device="cuda")
    kd = torch.tensor([[-0.9, 0.6], [-0.8, 1.2]], device="cuda")  # products: -0.63, -0.3, 0.88, 0
    vd = torch.rand(b, hk, device="cuda", generator=g) + 0.25
    _gluon_and_triton_forwards_match(monkeypatch, q, k, v, (qd, kd, vd), causal, window)


@pytest.mark.skipif(not _gluon_on_hopper(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("d, masked, long", [(64, False, False), (64, True, False), (64, True, True),
                                             (128, False, False), (128, True, False), (128, True, True)])
def test_fp8_gluon_routed_tiles_of_d64_and_d128(d, masked, long, monkeypatch, routed):
    """The float8 forward's routed tiles at D=64 and 128 (launch.fp8_tiles: three consumers, 256-key blocks, a share
    of the exponentials on the FMA pipes; ``long``: a causal call over enough keys for FP8_LONG_CAUSAL_TILES) keep
    FP8's bound of the reference with descales of either sign, key counts off 16 and off the key block, grouped-query
    heads and rows without keys (causal, N > M), and give NaN exactly where the same tiles with every exponential on
    the special-function unit do, for NaN keys (16 in a row: every register position of a thread's share, the one an
    exponential on the FMA pipes takes among them)."""
    import dataclasses

    from longattn.backends.gluon import launch

    b, n, m, hq, hk = (1, 1300, 1001, 4, 2) if masked else (2, 700, 1301, 4, 2)
    if long and d not in launch.FP8_LONG_CAUSAL_TILES:
        pytest.skip(f"no long-causal float8 tiles at D={d}")
    if long:
        b, n, m = 1, 700, launch.FP8_LONG_CAUSAL_TILES[d][0] + 77
    tiles = launch.fp8_tiles(d, masked, max(n, m) if masked else 0)
    assert not long or tiles == launch.FP8_LONG_CAUSAL_TILES[d][1]
    ran, plain = [], launch.forward

    def forward(*args, **kw):
        ran.append(kw["tiles"])
        return plain(*args, **kw)

    def all_on_the_unit(*args, **kw):
        return plain(*args, **dict(kw, tiles=dataclasses.replace(kw["tiles"], fma_exp2=0)))

    routed(**TO_GLUON)
    g = torch.Generator(device="cuda").manual_seed(d + m)
    q, k, v = _fp8((b, n, hq, d), g), _fp8((b, m, hk, d), g), _fp8((b, m, hk, d), g)
    qd = torch.tensor([[0.7, -0.5], [-1.1, 0.9]], device="cuda")[:b, :hk]
    kd = torch.tensor([[0.9, 0.6], [-0.8, 1.2]], device="cuda")[:b, :hk]
    vd = torch.rand(b, hk, device="cuda", generator=g) + 0.25
    run = lambda k: longattn.flash_attention(q, k, v, causal=masked, q_descale=qd, k_descale=kd,  # noqa: E731
                                             v_descale=vd, out_dtype=torch.float32, return_lse=True)
    monkeypatch.setattr(launch, "forward", forward)
    out, lse = run(k)
    assert ran and ran[0] == tiles and d not in launch._fp8_failed  # the Gluon kernel ran, with the routed tiles
    deq = [ref.dequantize_fp8(x, s) for x, s in ((q, qd), (k, kd), (v, vd))]
    want, want_lse = ref.flash_attention(*deq, causal=masked, return_lse=True)
    _check(out, want, deq[2], _score_error(deq[0], deq[1]))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=2e-3, rtol=1e-4)
    k_nan = k.float()
    k_nan[:, m // 3:m // 3 + 16, 0] = float("nan")
    out, lse = run(k_nan.to(F8))
    monkeypatch.setattr(launch, "forward", all_on_the_unit)
    base_out, base_lse = run(k_nan.to(F8))
    assert base_out.isnan().any() and torch.equal(out.isnan(), base_out.isnan())
    assert torch.equal(lse.isnan(), base_lse.isnan())


@pytest.mark.parametrize("shape", [(2, 1000, 3, 128), (1, 77, 2, 80), (3, 4096, 8, 64)])
def test_seq_major_copy(shape):
    from longattn.backends.triton.fp8_layout import seq_major

    g = torch.Generator(device="cuda").manual_seed(9)
    v = _fp8(shape, g)
    s = seq_major(v)
    assert s.shape == v.shape and s.stride(1) == 1 and s.stride(3) % 16 == 0
    assert torch.equal(s.view(torch.uint8), v.view(torch.uint8))


def test_fp8_forward_under_torch_compile():
    """Under ``torch.compile(fullgraph=True)`` the FP8 forward is one custom-op node (descales and the output dtype
    among its parameters) and gives the eager result."""
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (_fp8((2, 700, 4, 128), g) for _ in range(3))
    qd, kd, vd = (torch.rand(2, 4, device="cuda", generator=g) + 0.25 for _ in range(3))

    def f(q, k, v):
        return longattn.flash_attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                        out_dtype=torch.float16, backend="triton")

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert compiled.dtype == torch.float16
    torch.testing.assert_close(compiled, eager)
