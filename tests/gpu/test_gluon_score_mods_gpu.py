"""GPU tests of soft-capping and ALiBi in the Gluon Hopper forward: the kernel takes the launch (a spy on its
entry), and its output and log-sum-exp match the Triton forward on the same inputs and the float32 reference, dense
(causal with N != M, windows, grouped-query heads, slopes per head or per batch row), packed (a row of slopes per
sequence) and with the ring's ALiBi offset. Skipped unless the GPU is a Hopper with Triton's Gluon."""
import contextlib
import dataclasses
import functools

import pytest
import torch

import _rows as rows

import longattn
from longattn import reference as ref
from longattn.backends.gluon import launch
from longattn.backends.triton import launch as triton_launch
from longattn.backends.triton.launch import BandArgs, SeqView
from longattn.call import Band
from longattn.utils import cu_seqlens_of

@pytest.fixture
def routed():
    """``routed(**settings)``: routing settings (``longattn.routing``) in force for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(longattn.routing(**settings))


pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
         and launch.kernel_module() is not None), reason="needs a Hopper GPU and Triton's Gluon")


@pytest.fixture
def gluon_launches(monkeypatch, routed):
    """The Gluon kernel's launches (a list) while the test runs; LONGATTN_GLUON on."""
    monkeypatch.setenv("LONGATTN_GLUON", "1")
    routed(packed_min_mean_rows=0)
    kernel = launch.kernel_module().flash_fwd
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def go(*args, **kwargs):
                seen.append(kwargs)
                return kernel[grid](*args, **kwargs)
            return go
    monkeypatch.setattr(launch.kernel_module(), "flash_fwd", Spy())
    return seen


def _rel(a, b):
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    return rows.rel(a, b)


CASES = [  # B, N, M, Hq, Hk, causal, window, softcap, slopes per batch row
    (2, 700, 700, 8, 2, False, (-1, -1), 5.0, False),
    (1, 1000, 1000, 4, 4, True, (-1, -1), 0.0, True),
    (2, 333, 1000, 8, 8, True, (-1, -1), 20.0, None),
    (1, 1000, 333, 4, 1, True, (-1, -1), 2.0, None),  # the first query blocks see no key
    (1, 1500, 1500, 4, 2, False, (100, 50), 30.0, None),
    (3, 2100, 2100, 12, 4, False, (300, 0), 0.0, False),
]


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("case", CASES)
def test_dense_softcap_and_alibi_in_the_gluon_forward(case, d, gluon_launches, monkeypatch):
    B, N, M, Hq, Hk, causal, window, softcap, per_row = case  # per_row None: no ALiBi (the kernel takes one of two)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, N, Hq, d, device="cuda", generator=g) * 2
    k, v = (torch.randn(B, M, Hk, d, device="cuda", generator=g) for _ in range(2))
    slopes = None if per_row is None else torch.rand(*((B, Hq) if per_row else (Hq,)), device="cuda",
                                                     generator=g) * 0.1
    kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, return_lse=True)
    xs = [x.bfloat16() for x in (q, k, v)]
    with torch.no_grad():
        out, lse = longattn.flash_attention(*xs, backend="triton", **kw)
        if softcap and slopes is not None:  # both: the Triton forward (measured faster)
            assert gluon_launches == []
        else:
            assert len(gluon_launches) == 1 and bool(gluon_launches[0]["ALIBI"]) == (slopes is not None)
            if slopes is not None:  # causal: the distances split into a row and a column term (ALIBI 2)
                assert gluon_launches[0]["ALIBI"] == (2 if causal or window[1] == 0 else 1)
            # soft-capping by tanh.approx (SOFTCAP 2) with the default tiles, by exp and a division (1) without
            assert gluon_launches[0]["SOFTCAP"] == ((2 if launch.TILES[d].fast_tanh else 1) if softcap else 0)
        monkeypatch.setenv("LONGATTN_GLUON", "0")
        t_out, t_lse = longattn.flash_attention(*xs, backend="triton", **kw)
        want, want_lse = ref.flash_attention(q, k, v, **kw)
    assert _rel(out, want) < 1e-2 and _rel(lse, want_lse) < 1e-3
    assert _rel(out, t_out) < 1e-2 and _rel(lse, t_lse) < 1e-4



@pytest.mark.parametrize("fast_tanh", [True, False])
@pytest.mark.parametrize("d, short_band", [(64, False), (64, True), (128, False), (256, False)])
def test_both_forms_of_soft_capping_in_the_gluon_forward(d, short_band, fast_tanh):
    """The launch with ``tanh.approx`` (the tiles' default) and with the exact form (``fast_tanh=False``, the option
    kept) against float64: awkward lengths, GQA, causal N != M, caps large and small; on the routed tiles and on
    those of short bands (``launch.SHORT_BAND_TILES``)."""
    tiles = dataclasses.replace(launch.band_tiles(d, 1 if short_band else 0), fast_tanh=fast_tanh)
    for B, N, M, Hq, Hk, causal, cap in [(2, 700, 900, 4, 2, True, 50.0), (1, 1100, 600, 2, 2, False, 2.0)]:
        g = torch.Generator(device="cuda").manual_seed(N + d)
        q = torch.randn(B, N, Hq, d, device="cuda", generator=g) * 3
        k, v = (torch.randn(B, M, Hk, d, device="cuda", generator=g) for _ in range(2))
        xs = [x.bfloat16() for x in (q, k, v)]
        o = torch.empty_like(xs[0])
        lse = torch.empty(B, Hq, N, device="cuda", dtype=torch.float32)
        launch.forward(*xs, o, lse, None, BandArgs.of(Band.of(causal, (-1, -1))), d ** -0.5, softcap=cap, tiles=tiles)
        want, want_lse = ref.flash_attention(*(x.double() for x in xs), causal=causal, softcap=cap, return_lse=True)
        assert _rel(o, want) < 1e-2 and _rel(lse, want_lse) < 1e-4


def test_packed_batch_with_a_row_of_slopes_per_sequence(gluon_launches):
    lens = [700, 0, 1300, 17, 900]
    cu = cu_seqlens_of(lens, "cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(sum(lens), 8, 128, device="cuda", generator=g) * 2
    k, v = (torch.randn(sum(lens), 2, 128, device="cuda", generator=g) for _ in range(2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
              alibi_slopes=torch.rand(len(lens), 8, device="cuda", generator=g) * 0.1)
    with torch.no_grad():
        out = longattn.flash_attention_varlen(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="triton", **kw)
    assert len(gluon_launches) == 1
    assert _rel(out, ref.flash_attention_varlen(q, k, v, **kw)) < 1e-2


@pytest.mark.parametrize("offset", [-300, 0, 450])
@pytest.mark.parametrize("causal, d, steep", [(False, 128, False), (True, 128, False), (True, 128, True)])
def test_alibi_offset_of_a_ring_block(offset, causal, d, steep, gluon_launches):
    """The ring's per-block offset (distances between global positions) reaches the kernel: against the Triton
    forward given the same offset (which the ring tests check against the reference). Causal blocks whose keys
    all lie at or left of ALiBi's diagonal (offset >= 0) take the kernel's split form (ALIBI 2), with slopes up
    to 4 where ``steep`` (large row terms far from the diagonal)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    B, N, H = 1, 1024, 4
    q, k, v = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    slopes = (torch.rand(B, H, device="cuda", generator=g) * (4.0 if steep else 0.1)).contiguous()
    view = SeqView(seg_q=N, seg_k=N, n_seg=1, n_heads=H)
    outs = []
    for fwd in (functools.partial(launch.forward, tiles=launch.TILES[d]), triton_launch.forward):
        o = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda")
        fwd(q, k, v, o, lse, view, BandArgs(0, 0, False, causal), d ** -0.5, slopes=slopes, alibi_offset=offset)
        outs.append((o, lse))
    assert len(gluon_launches) == 1 and gluon_launches[0]["ALIBI"] == (2 if causal and offset >= 0 else 1)
    assert _rel(outs[0][0], outs[1][0]) < 1e-2 and _rel(outs[0][1], outs[1][1]) < 1e-4
