"""GPU tests of the Gluon Hopper forward: the launches it takes against the float64 reference and against the
Triton forward on the same inputs, with gradients (the backward runs the Triton kernels on its output and
log-sum-exp). Skipped unless the GPU is a Hopper (sm_90) and this Triton has the Gluon API the kernel needs."""
import contextlib

import pytest
import torch

import longattn
from longattn.backends.gluon import launch
from longattn.utils import cu_seqlens_of

@pytest.fixture
def routed():
    """``routed(**settings)``: routing settings (``longattn.routing``) in force for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(longattn.routing(**settings))



def _hopper_with_gluon() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
            and launch.kernel_module() is not None)


pytestmark = pytest.mark.skipif(not _hopper_with_gluon(), reason="needs a Hopper GPU and Triton's Gluon")

CASES = [  # (batch, queries, keys, query heads, kv heads, causal, window)
    (1, 1, 1, 2, 2, False, (-1, -1)),
    (3, 1, 5, 1, 1, True, (-1, -1)),
    (2, 100, 100, 3, 3, False, (-1, -1)),
    (1, 129, 257, 16, 1, False, (-1, -1)),
    (1, 300, 1000, 4, 4, True, (-1, -1)),
    (1, 1000, 300, 2, 1, True, (-1, -1)),  # the first query blocks see no key
    (2, 4097, 4097, 2, 2, True, (-1, -1)),
    (1, 1500, 1500, 4, 2, False, (100, 50)),
    (1, 2000, 2000, 2, 2, False, (256, 0)),
    (2, 777, 1234, 8, 2, False, (-1, -1)),
    # More tiles than SMs, so programs run tiles one after another (Q buffers reused, ring phases carried across
    # tiles): tiles without keys between tiles with keys, a long non-causal run, a band.
    (4, 3000, 1000, 8, 2, True, (-1, -1)),
    (2, 2500, 2600, 16, 4, False, (-1, -1)),
    (3, 2100, 2100, 12, 4, False, (300, 0)),
]


def _inputs(b, n, m, hq, hk, dtype, seed=0, d=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, n, hq, d, device="cuda", dtype=dtype, generator=g),
            torch.randn(b, m, hk, d, device="cuda", dtype=dtype, generator=g),
            torch.randn(b, m, hk, d, device="cuda", dtype=dtype, generator=g))


def _takes(q, k, v):
    from longattn.backends.triton import planner
    from longattn.call import flash_call
    return planner.forward(q, k, v, flash_call(q.shape[-1] ** -0.5))[0].chosen.kernel == planner.GLUON_FWD


def _run(q, k, v, causal, window, gluon, monkeypatch):
    monkeypatch.setenv("LONGATTN_GLUON", "1" if gluon else "0")
    with torch.no_grad():
        return longattn.flash_attention(q, k, v, causal=causal, window=window, return_lse=True, backend="triton")


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                      (torch.bfloat16, 256)])
@pytest.mark.parametrize("case", CASES)
def test_forward_against_the_reference_and_the_triton_kernel(case, dtype, d, monkeypatch, routed):
    """D=64 runs three consumers (192-row tiles): taken here for every case, short ones too (``MIN_KEYS``)."""
    routed(min_keys={})
    b, n, m, hq, hk, causal, window = case
    q, k, v = _inputs(b, n, m, hq, hk, dtype, d=d)
    assert _takes(q, k, v)
    out, lse = _run(q, k, v, causal, window, True, monkeypatch)
    t_out, t_lse = _run(q, k, v, causal, window, False, monkeypatch)
    r_out, r_lse = longattn.flash_attention(q.double(), k.double(), v.double(), causal=causal, window=window,
                                            return_lse=True, backend="torch")
    err, t_err = (out.double() - r_out).abs().max().item(), (t_out.double() - r_out).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 1.5 * t_err + 1e-3, (err, t_err)  # as close to the reference as the Triton forward
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))  # rows that see no key: -inf, output 0
    fin = torch.isfinite(r_lse)
    assert (lse[fin].double() - r_lse[fin]).abs().max().item() < 1e-4
    assert (out[~fin.transpose(1, 2)] == 0).all()


def test_strided_inputs_and_gradients(monkeypatch):
    """(batch, heads, seq, dim) tensors seen transposed, as transformers holds them; the backward from the Gluon
    forward's output and log-sum-exp."""
    monkeypatch.setenv("LONGATTN_GLUON", "1")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, h, 1100, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for h in (8, 2, 2))
    assert _takes(q, k, v)
    do = torch.randn(2, 1100, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = longattn.flash_attention(*leaves, causal=True, backend="triton")
    out.backward(do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r_out = longattn.flash_attention(*ref_leaves, causal=True, backend="torch")
    r_out.backward(do.double())
    for got, want in [(out, r_out)] + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]:
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 1e-2, rel


def test_launches_it_does_not_take_run_the_triton_forward(monkeypatch):
    monkeypatch.setenv("LONGATTN_GLUON", "1")
    q, k, v = _inputs(1, 300, 300, 2, 2, torch.bfloat16, d=64)
    assert not _takes(q, k, v)  # head dim 64 with 300 keys (launch.MIN_KEYS): the Triton forward measured faster
    out = longattn.flash_attention(q, k, v, causal=True, backend="triton")
    ref = longattn.flash_attention(q.double(), k.double(), v.double(), causal=True, backend="torch")
    assert (out.double() - ref).abs().max().item() < 2e-2


VARLEN_CASES = [  # (query lengths, key lengths, query heads, kv heads, causal, window)
    ([300, 0, 1000, 17, 513, 1], [300, 64, 900, 17, 0, 2000], 8, 2, True, (-1, -1)),
    ([1, 2, 127, 129, 1000, 128, 256], [1, 2, 127, 129, 1000, 128, 256], 4, 4, False, (-1, -1)),
    ([5000, 3, 700], [5000, 3, 700], 16, 4, False, (100, 20)),
    ([129] * 7 + [4097], [129] * 7 + [4097], 2, 1, True, (-1, -1)),
    ([1000, 70], [300, 1500], 2, 2, True, (-1, -1)),  # the first query blocks of sequence 0 see no key
    ([3, 0, 4], [0, 5, 6], 2, 2, False, (-1, -1)),  # queries without keys, keys without queries
    # Many tiles per program: 40 sequences of 0-690 queries and 0-884 keys, some of whose first blocks see no key.
    ([i * 37 % 700 for i in range(40)], [i * 53 % 900 for i in range(40)], 16, 4, True, (-1, -1)),
    ([i * 37 % 700 for i in range(40)], [i * 53 % 900 for i in range(40)], 16, 4, False, (-1, -1)),
    # Many short documents (64-1024 rows, some without queries), more keys than queries, GQA 16/4, causal.
    ([0 if i % 13 == 5 else i * 97 % 961 + 64 for i in range(60)],
     [i * 97 % 961 + 64 + i * 31 % 200 for i in range(60)], 16, 4, True, (-1, -1)),
]


def _cu(lens):
    return cu_seqlens_of(lens, "cuda")


@pytest.fixture(autouse=True)
def _packed_batches_of_any_length(monkeypatch, routed):
    """The kernel on every packed case here, short sequences included (the rule sends those to Triton)."""
    routed(packed_min_mean_rows=0)


def _takes_packed(q, k, v, lens_q, lens_k, schedule=0):
    """Whether the Gluon forward takes the packed batch, with tiles of ``packed_schedule`` ``schedule``."""
    from longattn.backends.triton import planner
    from longattn.call import AttentionCall, SeqLens
    call = AttentionCall(q.shape[-1] ** -0.5, seqlens=SeqLens(_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k)))
    chosen = planner.forward(q[None], k[None], v[None], call)[0].chosen
    return chosen.kernel == planner.GLUON_FWD and chosen.option("tiles").packed_schedule == schedule


def _varlen(q, k, v, lens_q, lens_k, causal, window, backend="triton"):
    with torch.no_grad():
        return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k),
                                               causal=causal, window=window, return_lse=True, backend=backend)


@pytest.mark.parametrize("schedule", [0, 1, 2])
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 256)])
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_packed_forward_against_the_reference_and_the_triton_kernel(case, dtype, d, schedule, monkeypatch, routed):
    """A packed batch in one launch of the Gluon forward: empty sequences, sequences shorter than a tile and
    ending inside one, causal with different query and key lengths, a window, grouped-query heads; on each of the
    tile schedules (``packed_schedule``: persistent; persistent with V through one ragged descriptor and the next
    tile found ahead; one program per tile)."""
    routed(packed_schedule=schedule)
    lens_q, lens_k, hq, hk, causal, window = case
    g = torch.Generator(device="cuda").manual_seed(len(lens_q))
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    assert _takes_packed(q, k, v, lens_q, lens_k, schedule)
    monkeypatch.setenv("LONGATTN_GLUON", "1")
    out, lse = _varlen(q, k, v, lens_q, lens_k, causal, window)
    monkeypatch.setenv("LONGATTN_GLUON", "0")
    t_out, _ = _varlen(q, k, v, lens_q, lens_k, causal, window)
    r_out, r_lse = _varlen(q.double(), k.double(), v.double(), lens_q, lens_k, causal, window, backend="torch")
    err, t_err = (out.double() - r_out).abs().max().item(), (t_out.double() - r_out).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 1.5 * t_err + 1e-3, (err, t_err)
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    if fin.any():
        assert (lse[fin].double() - r_lse[fin]).abs().max().item() < 1e-4
    assert (out[~fin.transpose(0, 1)] == 0).all()


@pytest.mark.parametrize("schedule", [0, 1, 2])
def test_packed_sequences_do_not_see_their_neighbours_values(monkeypatch, routed, schedule):
    """A sequence's last key tile reaches into the next sequence's rows; infinities and NaNs there (in K, V and
    Q) must not reach its output: the kernel bounds V by the sequence (a descriptor per tile, or with
    ``packed_schedule`` one ragged descriptor), masks K's scores, drops Q's rows."""
    monkeypatch.setenv("LONGATTN_GLUON", "1")
    routed(packed_schedule=schedule)
    lens = [200, 300, 150]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    assert _takes_packed(q, k, v, lens, lens, schedule)
    clean = [x.clone() for x in (q, k, v)]
    q[200:500], k[200:500], v[200:500] = float("nan"), float("inf"), float("nan")
    for causal in (False, True):
        out, lse = _varlen(q, k, v, lens, lens, causal, (-1, -1))
        ref, ref_lse = _varlen(*(x.double() for x in clean), lens, lens, causal, (-1, -1), backend="torch")
        for rows in (slice(0, 200), slice(500, 650)):
            assert torch.isfinite(out[rows]).all(), (causal, rows)
            assert (out[rows].double() - ref[rows]).abs().max().item() < 2e-2
            assert (lse[:, rows].double() - ref_lse[:, rows]).abs().max().item() < 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_packed_schedules_agree_bitwise_on_many_short_documents(monkeypatch, routed, causal):
    """200 documents of 1-1024 tokens (empty ones among them, more keys than queries in some), GQA 16/4, D=128,
    a document in the middle poisoned with NaN and infinities in Q, K and V: each schedule's output and
    log-sum-exp equal schedule 0's bitwise (the same products on the same tiles; V past a document's end zeros
    through either descriptor), the other documents' rows are finite and equal the float64 reference's within the
    usual bounds, and more programs than SMs run several tiles each (schedule 1) or one each (schedule 2)."""
    monkeypatch.setenv("LONGATTN_GLUON", "1")
    g = torch.Generator().manual_seed(5)
    lens_q = [0 if i % 17 == 3 else int(torch.randint(1, 1025, (), generator=g)) for i in range(200)]
    lens_k = [n + (int(torch.randint(0, 100, (), generator=g)) if i % 3 == 0 else 0) for i, n in enumerate(lens_q)]
    gc = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(lens_q), 16, 128, device="cuda", dtype=torch.bfloat16, generator=gc)
    k, v = (torch.randn(sum(lens_k), 4, 128, device="cuda", dtype=torch.bfloat16, generator=gc) for _ in range(2))
    clean = [x.clone() for x in (q, k, v)]
    mid = 100
    q_rows = slice(sum(lens_q[:mid]), sum(lens_q[:mid + 1]))
    k_rows = slice(sum(lens_k[:mid]), sum(lens_k[:mid + 1]))
    q[q_rows], k[k_rows], v[k_rows] = float("nan"), float("inf"), float("nan")
    outs = []
    for schedule in (0, 1, 2):
        with longattn.routing(packed_schedule=schedule):
            assert _takes_packed(q, k, v, lens_q, lens_k, schedule)
            outs.append(_varlen(q, k, v, lens_q, lens_k, causal, (-1, -1)))
    for out, lse in outs[1:]:  # (bitwise, the poisoned document's NaN rows included)
        torch.testing.assert_close(out, outs[0][0], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(lse, outs[0][1], rtol=0, atol=0, equal_nan=True)
    ref, ref_lse = _varlen(*(x.double() for x in clean), lens_q, lens_k, causal, (-1, -1), backend="torch")
    out, lse = outs[0]
    keep = torch.ones(sum(lens_q), dtype=torch.bool, device="cuda")
    keep[q_rows] = False
    assert torch.isfinite(out[keep]).all()
    assert (out[keep].double() - ref[keep]).abs().max().item() < 2e-2
    fin = torch.isfinite(ref_lse[:, keep])
    assert torch.equal(fin, torch.isfinite(lse[:, keep]))
    assert (lse[:, keep][fin].double() - ref_lse[:, keep][fin]).abs().max().item() < 1e-3


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b, n, m, hq, hk", [(2, 4096, 4096, 16, 16), (2, 3000, 1000, 24, 4), (3, 900, 2500, 8, 2)])
def test_folded_mask_of_routed_tiles(b, n, m, hq, hk, d):
    """D=64's and D=128's tiles fold the scale into the masked blocks' FMA (``fold_mask``): as close to float64 as
    the unfolded blocks; rows that see no key (N > M) give -inf and 0; a scale too small for the fold runs the
    unfolded blocks (no NaN)."""
    import dataclasses

    from longattn.backends.triton.launch import BandArgs
    from longattn.call import Band
    q, k, v = _inputs(b, n, m, hq, hk, torch.bfloat16, seed=5, d=d)
    t = launch.TILES[d]
    assert t.fold_mask

    def run(tiles, scale=d ** -0.5):
        o, lse = torch.empty_like(q), torch.empty(b, hq, n, device="cuda", dtype=torch.float32)
        launch.forward(q, k, v, o, lse, None, BandArgs.of(Band.of(True, (-1, -1))), scale, tiles=tiles)
        return o, lse

    out, lse = run(t)
    unfolded, _ = run(dataclasses.replace(t, fold_mask=False))
    if n <= m:  # against float64 on the last query rows (the band is aligned at the last key)
        rows = slice(n - 512, n)
        r_out = longattn.flash_attention(q[:, rows].double(), k.double(), v.double(), causal=True, backend="torch")
        err, u_err = ((x[:, rows].double() - r_out).abs().max().item() for x in (out, unfolded))
        assert err <= 1.25 * u_err + 1e-3, (err, u_err)
    else:  # the first n - m rows see no key; the others as the unfolded blocks give them
        assert torch.isneginf(lse[:, :, :n - m]).all() and (out[:, :n - m] == 0).all()
        assert torch.isfinite(lse[:, :, n - m:]).all()
        torch.testing.assert_close(out[:, n - m:].float(), unfolded[:, n - m:].float(), atol=1e-2, rtol=0)
    assert torch.isfinite(out).all()
    tiny_out, tiny_lse = run(t, scale=1e-39)
    assert torch.isfinite(tiny_out).all() and not torch.isnan(tiny_lse).any()


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                      (torch.bfloat16, 256)])
@pytest.mark.parametrize("case", CASES)
def test_output_stored_by_tma_is_the_plain_stores_output(case, dtype, d):
    """``tma_store`` (the output written into the Q buffer and stored by TMA) gives the plain stores' output and
    log-sum-exp bitwise, and writes nothing past the output's last row (the descriptor drops the rows past the
    sequence: a sentinel after the tensor stays)."""
    import dataclasses

    from longattn.backends.triton.launch import BandArgs
    from longattn.call import Band
    b, n, m, hq, hk, causal, window = case
    q, k, v = _inputs(b, n, m, hq, hk, dtype, seed=7, d=d)
    band = BandArgs.of(Band.of(causal, window))

    def run(tiles):
        buf = torch.full((q.numel() + 4096,), 7.0, device="cuda", dtype=dtype)
        o, lse = buf[:q.numel()].view(q.shape), torch.empty(b, hq, n, device="cuda", dtype=torch.float32)
        launch.forward(q, k, v, o, lse, None, band, d ** -0.5, tiles=tiles)
        assert (buf[q.numel():] == 7.0).all()
        return o, lse

    out, lse = run(dataclasses.replace(launch.TILES[d], tma_store=False))
    tma_out, tma_lse = run(dataclasses.replace(launch.TILES[d], tma_store=True))
    assert torch.equal(tma_out, out) and torch.equal(tma_lse, lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("d", sorted(launch.SHORT_BAND_TILES))
def test_short_band_tiles_give_the_routed_tiles_output(case, dtype, d):
    """The tiles of short bands (``SHORT_BAND_TILES``: fewer consumers, shorter tiles) give the output and
    log-sum-exp of ``TILES`` bitwise (every row walks the same key blocks in the same order), on every case, bands
    or not, and match the float64 reference."""
    from longattn.backends.triton.launch import BandArgs
    from longattn.call import Band
    b, n, m, hq, hk, causal, window = case
    q, k, v = _inputs(b, n, m, hq, hk, dtype, seed=11, d=d)
    band = BandArgs.of(Band.of(causal, window))

    def run(tiles):
        o, lse = torch.empty_like(q), torch.empty(b, hq, n, device="cuda", dtype=torch.float32)
        launch.forward(q, k, v, o, lse, None, band, d ** -0.5, tiles=tiles)
        return o, lse

    out, lse = run(launch.TILES[d])
    short_out, short_lse = run(launch.SHORT_BAND_TILES[d][1])
    assert torch.equal(short_out, out) and torch.equal(short_lse, lse)
    ref = longattn.flash_attention(q.double(), k.double(), v.double(), causal=causal, window=window,
                                   backend="torch")
    torch.testing.assert_close(short_out.double(), ref, atol=2e-2, rtol=0)
