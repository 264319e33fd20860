"""GPU tests of the fused Gluon Hopper backward (longattn/backends/gluon/bwd_fused.py) through the Triton backend's
routing: bf16/fp16 gradients of ``longattn.flash_attention(..., backend="triton")`` against a float64 reference on
awkward sizes (causal and not, N != M, grouped-query heads), as close as the two Triton passes get, and the calls
it must not take. Skipped without an sm_90 GPU."""
import contextlib

import pytest
import torch

import longattn
from longattn import ops
from longattn.backends.gluon import bwd_fused, bwd_wide_tile
from longattn.backends.gluon import launch as gluon_launch
from longattn.backends.triton import entry

@pytest.fixture
def routed():
    """``routed(**settings)``: routing settings (``longattn.routing``) in force for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(longattn.routing(**settings))


pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper (sm_90) GPU")


def _spy(monkeypatch, owner, name: str, q_at: int) -> list:
    """``owner.name`` replaced by a spy that records the shape of its argument ``q_at`` (q) and calls the real one;
    returns the list of shapes."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args[q_at].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.fixture
def fused_calls(monkeypatch, routed):
    """The number of calls the fused kernel's entry has taken (a list, one entry per call); the kernel takes short
    calls too here (``FUSED_BWD_MIN_ROWS`` sends them to the two passes), and the D=64 dense calls the 128 x 128
    backward would take (its own tests below)."""
    routed(fused_bwd_min_rows={}, wide_bwd_head_dims=())
    calls = _spy(monkeypatch, bwd_fused, "fused_backward", q_at=1)
    real = entry._GluonReplay.run

    def replayed(self, slots, q, *args, **kwargs):  # (a signature's later calls replay its recorded launches)
        if not self.wide:
            calls.append(q.shape)
        return real(self, slots, q, *args, **kwargs)
    monkeypatch.setattr(entry._GluonReplay, "run", replayed)
    return calls


def _inputs(b, n, m, hq, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
            for s, h in ((n, hq), (m, hk), (m, hk), (n, hq))]


def _err(x, want, floor=1e-30):
    """The largest error of ``x`` against ``want`` relative to ``want``'s largest entry (at least ``floor``)."""
    assert torch.isfinite(x).all(), "non-finite gradient"
    return ((x.double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def _grads(q, k, v, do, dl=None, **kw):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = longattn.flash_attention(qs, ks, vs, return_lse=True, **kw)
    loss = (out.double() * do.double()).sum()
    if dl is not None:
        loss = loss + (lse.double() * dl.double()).sum()
    return torch.autograd.grad(loss, (qs, ks, vs))


def _as_close_as_two_passes(grads, inputs, fused_calls, monkeypatch, kw, kw64=None, label=()):
    """``grads(q, k, v, do, backend=..., **kw)`` through the fused kernel (which must take the call) is as close to
    the float64 reference (``backend="torch"`` on float64 copies, with ``kw64`` where given) as the two Triton
    passes (``LONGATTN_GLUON=0``) get."""
    want = grads(*(x.double() for x in inputs), backend="torch", **(kw if kw64 is None else kw64))
    got = grads(*inputs, backend="triton", **kw)
    assert len(fused_calls) == 1, "the fused backward did not take the call"
    monkeypatch.setenv("LONGATTN_GLUON", "0")
    two_pass = grads(*inputs, backend="triton", **kw)
    assert len(fused_calls) == 1, "LONGATTN_GLUON=0 did not turn the fused backward off"
    # A gradient that is zero in exact arithmetic (one key: every dS is 0, so dQ and dK are) has no scale of its own:
    # its errors are measured against 1% of the call's largest gradient, where both backwards give rounding noise.
    floor = 1e-2 * max(w.abs().max().item() for w in want)
    for name, g, t, w in zip("qkv", got, two_pass, want):
        err, t_err = _err(g, w, floor), _err(t, w, floor)
        assert err <= 1.5 * t_err + 2e-3, (*label, name, err, t_err)


CASES = [  # B, N, M, Hq, Hk, D, causal, dtype
    (2, 300, 300, 3, 3, 128, False, torch.bfloat16),
    (2, 300, 300, 3, 3, 128, True, torch.bfloat16),
    (1, 1000, 1000, 2, 2, 128, True, torch.float16),
    (2, 200, 333, 4, 2, 128, False, torch.bfloat16),
    (2, 333, 200, 4, 1, 128, True, torch.bfloat16),  # causal, N > M: some queries see no key
    (2, 200, 333, 6, 3, 128, True, torch.bfloat16),  # causal, N < M (bottom-right)
    (2, 517, 517, 3, 3, 64, False, torch.bfloat16),
    (2, 517, 517, 8, 2, 64, True, torch.float16),
    (1, 1, 130, 2, 1, 64, True, torch.bfloat16),  # one query row
    (1, 1100, 1, 4, 4, 128, True, torch.bfloat16),  # one key: every query but the last sees nothing
    (2, 700, 700, 8, 1, 128, True, torch.bfloat16),  # 6 key blocks: 3 pairs; 8 query heads per program
    (1, 900, 900, 4, 2, 64, True, torch.bfloat16),  # 8 key blocks, the last partial
    (1, 640, 900, 2, 2, 128, True, torch.bfloat16),  # N < M: the first key blocks' columns are equal
    (2, 300, 300, 3, 3, 256, False, torch.bfloat16),  # D=256: bwd_fused_wide.py
    (2, 333, 200, 4, 1, 256, True, torch.bfloat16),
    (2, 200, 333, 6, 3, 256, True, torch.float16),
    (1, 700, 700, 4, 2, 256, True, torch.bfloat16),  # 11 key blocks of 64, the last partial
]


@pytest.mark.parametrize("paired", [False, True], ids=["one-key-block", "paired"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_routed_backward_against_the_reference(case, paired, fused_calls, monkeypatch):
    """Both schedules: a program per key block, and (forced here; chosen by ``paired_schedule`` on long causal
    calls) a program per pair of key blocks ``p`` and ``last - p``."""
    B, N, M, Hq, Hk, D, causal, dtype = case
    if paired and not causal:
        pytest.skip("the paired schedule is for causal calls")
    monkeypatch.setattr(bwd_fused, "paired_schedule", lambda *args: paired)
    _as_close_as_two_passes(_grads, _inputs(B, N, M, Hq, Hk, D, dtype), fused_calls, monkeypatch,
                            dict(causal=causal))


def test_lse_gradient_and_float32_gradients(fused_calls):
    """An upstream gradient on the log-sum-exp folds into the fused kernel's row statistics; ``grad_dtype`` float32
    (the ring code's) comes back in float32."""
    q, k, v, do = _inputs(2, 400, 500, 4, 2, 128, torch.bfloat16, seed=1)
    dl = torch.randn(2, 4, 400, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    want = _grads(q.double(), k.double(), v.double(), do.double(), dl, backend="torch", causal=True)
    got = _grads(q, k, v, do, dl, backend="triton", causal=True)
    assert len(fused_calls) == 1
    for g, w in zip(got, want):
        assert _err(g, w) < 2e-2
    scale = 128 ** -0.5
    o, lse = ops.attention_forward(q, k, v, causal=True, scale=scale, backend="triton")
    grads = ops.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale, backend="triton",
                                   grad_dtype=torch.float32)
    assert len(fused_calls) == 2
    want = _grads(q.double(), k.double(), v.double(), do.double(), backend="torch", causal=True)
    for g, w in zip(grads, want):
        assert g.dtype == torch.float32 and _err(g, w) < 2e-2


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False), dict(causal=True, softcap=20.0),
                                dict(window=(1100, 40)), dict(causal=True, deterministic=True)],
                         ids=["causal", "full", "softcap", "window", "deterministic"])
def test_a_signatures_later_calls_replay_the_fused_backward(kw, fused_calls, monkeypatch, routed):
    """The first call of a signature records the fused backward's launches, the next ones (other values) replay them
    into fresh buffers without its entry: each call's gradients as close to the float64 reference, and dK, dV (and
    with ``deterministic=True`` dQ) bitwise those of the same call recorded anew."""
    routed(deterministic_bwd_head_dims=(64, 128))
    replays = _spy(monkeypatch, entry._GluonReplay, "run", q_at=2)
    entry._BACKWARD.clear()
    for seed in range(3):
        q, k, v, do = _inputs(2, 1300, 1500, 8, 2, 128, torch.bfloat16, seed=seed)
        got = _grads(q, k, v, do, backend="triton", **kw)
        want = _grads(*(x.double() for x in (q, k, v, do)), backend="torch", **kw)
        for name, g, w in zip("qkv", got, want):
            assert _err(g, w) < 2e-2, (seed, name)
    assert len(fused_calls) == 3 and len(replays) == 2
    entry._BACKWARD.clear()
    fresh = _grads(q, k, v, do, backend="triton", **kw)
    assert len(replays) == 2
    for i in range(0 if kw.get("deterministic") else 1, 3):
        assert torch.equal(fresh[i], got[i]), "qkv"[i]


def _replayed_three_times(grads, inputs, want_fn, replays, bitwise_from):
    """Three calls of one signature with other values (the first records, the next two replay: ``replays`` counts
    them), each as close to its float64 reference as the routed kernels get; then the last call again with its
    recording dropped: gradients ``bitwise_from`` on (0: dQ too) bitwise equal."""
    entry._FORWARD.clear()
    entry._BACKWARD.clear()
    for seed in range(3):
        args = inputs(seed)
        got = grads(*args)
        for name, g, w in zip("qkv", got, want_fn(*args)):
            assert _err(g, w) < 2e-2, (seed, name)
    assert len(replays) == 2
    entry._FORWARD.clear()
    entry._BACKWARD.clear()
    fresh = grads(*args)
    for i in range(bitwise_from, 3):
        assert torch.equal(fresh[i], got[i]), "qkv"[i]


@pytest.mark.parametrize("causal", [True, False])
def test_packed_batches_replay_the_forward_and_the_fused_backward(causal, fused_calls, monkeypatch, routed):
    """A packed batch's later calls (the same boundaries, other values) replay the Gluon forward and the fused
    backward, their tables made anew from ``cu_seqlens``: gradients against float64, dK and dV bitwise those of a
    call recorded anew."""
    routed(packed_min_mean_rows=0)  # (the Gluon forward takes these short documents too)
    replays = _spy(monkeypatch, entry._GluonReplay, "run", q_at=2)
    lens = [300, 0, 1, 77, 1000, 64, 129]
    cu = _cu(lens)

    def inputs(seed):
        return _inputs(1, sum(lens), sum(lens), 8, 2, 128, torch.bfloat16, seed=seed)

    def grads(q, k, v, do, **kw):
        return _packed_grads(q[0], k[0], v[0], do[0], cu, cu, causal=causal, **kw)
    _replayed_three_times(lambda *a: grads(*a, backend="triton"), inputs,
                          lambda *a: grads(*(x.double() for x in a), backend="torch"), replays, 1)
    assert [r.table_tiles != () for r in entry._FORWARD.values() if r] == [True]  # (the Gluon forward's table)


def test_the_128_x_128_backward_replays(wide_calls, monkeypatch):
    """Dense D=64 calls on the 128 x 128 backward: later calls replay it (its statistics and dQ sum made anew),
    gradients against float64, dK and dV bitwise those of a call recorded anew."""
    replays = _spy(monkeypatch, entry._GluonReplay, "run", q_at=2)
    _replayed_three_times(lambda *a: _grads(*a, backend="triton", causal=True),
                          lambda seed: _inputs(2, 1100, 1100, 8, 2, 64, torch.bfloat16, seed=seed),
                          lambda *a: _grads(*(x.double() for x in a), backend="torch", causal=True), replays, 1)
    assert len(wide_calls) == 4  # (three calls and the one recorded anew, replays counted)


@pytest.mark.parametrize("kw, d", [(dict(causal=True), 96), (dict(), 32), (dict(window=(100, 0)), 128)])
def test_calls_it_does_not_cover_run_the_two_passes(kw, d, fused_calls):
    q, k, v, do = _inputs(1, 300, 300, 2, 2, d, torch.bfloat16)
    want = _grads(q.double(), k.double(), v.double(), do.double(), backend="torch", **kw)
    got = _grads(q, k, v, do, backend="triton", **kw)
    assert fused_calls == []
    for g, w in zip(got, want):
        assert _err(g, w) < 2e-2


def _mods(kind, hq, seed=3):
    """Keyword arguments of a band and score modifications (``kind``: names joined by ``+``)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {}
    for part in kind.split("+"):
        if part == "causal":
            kw["causal"] = True
        elif part == "window":
            kw["window"] = (45, 0) if kw.get("causal") else (45, 70)
        elif part == "softcap":
            kw["softcap"] = 3.0  # small: most scores are capped (random inputs give scores of a few units)
        elif part == "alibi":
            kw["alibi_slopes"] = torch.rand(hq, device="cuda", generator=g) * 0.3
        elif part == "sinks":
            kw["sinks"] = torch.randn(hq, device="cuda", generator=g)
    return kw


MOD_KINDS = ["window", "causal+window", "softcap", "causal+alibi", "alibi", "causal+sinks",
             "causal+window+softcap+alibi+sinks"]
MOD_SHAPES = [(2, 300, 300, 4, 2, 128), (1, 333, 517, 4, 1, 64), (2, 517, 200, 2, 2, 128),
              (1, 300, 400, 4, 2, 256)]  # B, N, M, Hq, Hk, D


@pytest.mark.parametrize("shape", MOD_SHAPES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind", MOD_KINDS)
def test_bands_and_score_modifications_against_the_reference(kind, shape, fused_calls, monkeypatch, routed):
    """Windows, soft-capping, ALiBi and sinks (alone and together) in the fused kernel: gradients as close to the
    float64 reference as the two Triton passes get."""
    B, N, M, Hq, Hk, D = shape
    routed(fused_bwd_min_band=0)  # the kernel on narrow windows too
    kw = _mods(kind, Hq)
    kw64 = {n: (x.double() if n == "sinks" else x) for n, x in kw.items()}
    _as_close_as_two_passes(_grads, _inputs(B, N, M, Hq, Hk, D, torch.bfloat16, seed=4), fused_calls, monkeypatch,
                            kw, kw64, (kind,))


def _packed_grads(q, k, v, do, cu_q, cu_k, **kw):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = longattn.flash_attention_varlen(qs, ks, vs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    return torch.autograd.grad((out.double() * do.double()).sum(), (qs, ks, vs))


def _cu(lens):
    return torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)


PACKED = [  # query lengths, key lengths (None: the same), Hq, Hk, D
    ([300, 0, 1, 77, 1000, 64, 129], None, 4, 2, 128),
    ([200, 5, 0, 640, 33], [333, 0, 7, 700, 33], 4, 1, 64),  # N != M per sequence, an empty key sequence
    ([1500], [900], 2, 2, 128),
    ([300, 0, 1, 77, 640, 129], [200, 3, 0, 77, 700, 129], 4, 2, 256),
]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"{len(c[0])}seqs-{c[2]}x{c[3]}-d{c[4]}")
@pytest.mark.parametrize("kind", ["", "causal", "causal+window+softcap+alibi", "window+sinks"])
def test_packed_batches_against_the_reference(case, kind, fused_calls, monkeypatch, routed):
    """Packed batches (empty sequences, N != M, grouped-query heads) through the fused kernel's work table."""
    lens_q, lens_k, Hq, Hk, D = case
    lens_k = lens_k or lens_q
    routed(fused_bwd_min_band=0)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, do = (torch.randn(sum(lens_q), Hq, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), Hk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = _mods(kind, Hq) if kind else {}
    if "alibi_slopes" in kw:  # one row per sequence
        kw["alibi_slopes"] = torch.rand(len(lens_q), Hq, device="cuda", generator=g) * 0.3
    kw64 = {n: (x.double() if n == "sinks" else x) for n, x in kw.items()}
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    _as_close_as_two_passes(lambda q, k, v, do, **kw: _packed_grads(q, k, v, do, cu_q, cu_k, **kw), (q, k, v, do),
                            fused_calls, monkeypatch, kw, kw64, (kind,))



def _sparse_grads(q, k, v, do, **kw):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = longattn.block_sparse_attention(qs, ks, vs, **kw)
    return torch.autograd.grad((out.double() * do.double()).sum(), (qs, ks, vs))


SPARSE = [  # B, N, M, Hq, Hk, D, mask's (batch, heads), block
    (2, 1100, 1300, 4, 2, 128, (1, 1), 128),  # one mask for every head, grouped-query heads
    (2, 1100, 1300, 4, 4, 64, (2, 4), 128),  # a mask per batch row and head
    (1, 700, 900, 2, 1, 64, (1, 1), (64, 256)),  # narrow query blocks, two kernel key blocks a list block
    (1, 1000, 1000, 2, 2, 64, (1, 2), (256, 128)),  # four kernel query blocks a list block
    (1, 700, 900, 2, 1, 256, (1, 1), 64),  # D=256: key blocks of 64
    (2, 600, 700, 4, 4, 256, (2, 4), 128),  # a mask per batch row and head
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", SPARSE, ids=lambda c: "-".join(str(x) for x in c))
def test_block_sparse_lists_against_the_reference(case, causal, fused_calls, monkeypatch):
    """Block-sparse attention through the fused kernel (the block lists walked per key block): gradients as close
    to the float64 reference as the two Triton passes get."""
    B, N, M, Hq, Hk, D, (bm, hm), block = case
    bq, bk = (block, block) if isinstance(block, int) else block
    q, k, v, do = _inputs(B, N, M, Hq, Hk, D, torch.bfloat16, seed=6)
    g = torch.Generator(device="cuda").manual_seed(7)
    mask = torch.rand(bm, hm, -(-N // bq), -(-M // bk), device="cuda", generator=g) < 0.35
    kw = dict(block_mask=mask, block_size=block, causal=causal)
    _as_close_as_two_passes(_sparse_grads, (q, k, v, do), fused_calls, monkeypatch, kw)


def test_block_lists_it_does_not_take_run_the_two_passes(fused_calls):
    """Key blocks of 64 (narrower than the kernel's 128) and per-head lists with grouped-query heads."""
    for hm, hk, block in ((1, 2, 64), (4, 2, 128)):
        q, k, v, do = _inputs(1, 600, 600, 4, hk, 128, torch.bfloat16)
        mask = torch.rand(1, hm, -(-600 // block), -(-600 // block), device="cuda") < 0.5
        kw = dict(block_mask=mask, block_size=block, causal=True)
        want = _sparse_grads(q.double(), k.double(), v.double(), do.double(), backend="torch", **kw)
        got = _sparse_grads(q, k, v, do, backend="triton", **kw)
        for g_, w in zip(got, want):
            assert _err(g_, w) < 2e-2
    assert fused_calls == []


@pytest.fixture
def wide_calls(monkeypatch, routed):
    """The calls the 128 x 128 backward (bwd_wide_tile.py) has taken, recorded or replayed, short ones included."""
    routed(fused_bwd_min_rows={})
    calls = _spy(monkeypatch, bwd_wide_tile, "backward", q_at=0)
    real = entry._GluonReplay.run

    def replayed(self, slots, q, *args, **kwargs):
        if self.wide:
            calls.append(q.shape)
        return real(self, slots, q, *args, **kwargs)
    monkeypatch.setattr(entry._GluonReplay, "run", replayed)
    return calls


WIDE_CASES = [  # B, N, M, Hq, Hk, causal, dtype (D = 64)
    (2, 517, 517, 3, 3, False, torch.bfloat16),
    (2, 517, 517, 8, 2, True, torch.float16),
    (1, 1, 130, 2, 1, True, torch.bfloat16),  # one query row
    (2, 200, 333, 4, 2, False, torch.bfloat16),
    (2, 333, 200, 4, 1, True, torch.bfloat16),  # causal, N > M: some queries see no key
    (2, 200, 333, 6, 3, True, torch.float16),  # causal, N < M (bottom-right)
    (1, 1100, 1, 4, 4, True, torch.bfloat16),  # one key
    (1, 2100, 2100, 4, 1, True, torch.bfloat16),  # 17 key blocks (paired where the schedule says), GQA 4/1
]


@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_wide_backward_against_the_reference(case, wide_calls, monkeypatch):
    """The 128 x 128 backward the plan names for dense D=64 calls: as close to float64 as the two Triton passes."""
    B, N, M, Hq, Hk, causal, dtype = case
    inputs = _inputs(B, N, M, Hq, Hk, 64, dtype)
    assert longattn.explain(longattn.flash_attention, *(x.requires_grad_() for x in inputs[:3]), causal=causal,
                            backend="triton").kernel("bwd") == "gluon_wide_bwd_sm90"
    _as_close_as_two_passes(_grads, [x.detach() for x in inputs], wide_calls, monkeypatch, dict(causal=causal))


def test_wide_backward_on_strided_inputs_and_the_calls_it_leaves(wide_calls, monkeypatch):
    """Heads-major views (a model's ``(B, H, N, D)`` transposed) run it exactly; a window, a log-sum-exp gradient
    and float32 gradients go to the fused backward."""
    q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in _inputs(2, 700, 700, 4, 2, 64,
                                                                                torch.bfloat16))
    _as_close_as_two_passes(_grads, [q, k, v, do], wide_calls, monkeypatch, dict(causal=True))
    monkeypatch.delenv("LONGATTN_GLUON")
    n = len(wide_calls)
    dl = torch.randn(2, 4, 700, device="cuda")
    _grads(q, k, v, do, dl, causal=True, backend="triton")
    _grads(q, k, v, do, window=(1500, 0), backend="triton")
    assert len(wide_calls) == n


def _schedules_against_the_launchers_default(run, schedules, deterministic=False):
    """Each schedule's gradients (``run(**schedule)``) against the launcher's default ones (``run()``: descriptors
    made on the device, the launcher's persistence rule): dK and dV bitwise equal
    (the same sums in the same order), dQ (float32 adds in another order, then rounded) within 1% of its largest
    entry, or bitwise equal where the adds' order is fixed (``deterministic``)."""
    want = run()
    scale = max(w.abs().max().item() for w in want[:1]) or 1.0
    for schedule in schedules:
        got = run(**schedule)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), schedule
        if deterministic:
            assert torch.equal(got[0], want[0]), schedule
        else:
            assert (got[0].double() - want[0].double()).abs().max().item() <= 1e-2 * scale, schedule


WIDE_SCHEDULES = [dict(persistent=False), dict(persistent=True), dict(persistent=True, longest_first=True),
                  dict(persistent=False, host_descriptors=True), dict(persistent=True, host_descriptors=True)]


@pytest.mark.parametrize("case", [WIDE_CASES[i] for i in (1, 2, 3, 5, 7)],
                         ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_wide_backward_schedules_give_the_same_gradients(case):
    """The 128 x 128 backward's schedules (tools/check_bwd_wide_tile.py --schedules: one program an item or
    persistent, longest first, descriptors made on the host, the routed form among them) compute what its
    launcher's default does."""
    B, N, M, Hq, Hk, causal, dtype = case
    q, k, v, do = _inputs(B, N, M, Hq, Hk, 64, dtype)
    o, lse = longattn.flash_attention(q, k, v, causal=causal, return_lse=True, backend="triton")

    def run(**schedule):
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        return bwd_wide_tile.backward(q, k, v, o, do, lse, dq, dk, dv, 64 ** -0.5, causal, **schedule)
    _schedules_against_the_launchers_default(run, WIDE_SCHEDULES)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", [CASES[i] for i in (1, 3, 4, 7, 10)],
                         ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_fused_backward_host_descriptors_give_the_device_descriptors_gradients(case, deterministic):
    """``fused_backward(..., host_descriptors=True)`` (routed at D=128) computes what the kernel with descriptors
    made on the device does, deterministic mode included."""
    B, N, M, Hq, Hk, D, causal, dtype = case
    q, k, v, do = _inputs(B, N, M, Hq, Hk, D, dtype)
    o, lse = longattn.flash_attention(q, k, v, causal=causal, return_lse=True, backend="triton")

    def run(**schedule):
        return bwd_fused.fused_backward(do, q, k, v, o, lse, D ** -0.5, causal, deterministic=deterministic,
                                        **schedule)
    _schedules_against_the_launchers_default(run, [dict(host_descriptors=True)], deterministic)


@pytest.mark.parametrize("d", [64, 128])
def test_a_replayed_backward_holds_no_tensor_of_its_first_call(d):
    """The Gluon backwards' replays (their TMA descriptors made on the host: the 128 x 128 backward at D=64, the
    fused one at D=128) keep none of the recorded call's tensors: after two steps of one signature, with every
    tensor of the steps dropped, the memory allocated is what it was before (a first version held the first call's
    inputs and buffers through its descriptors: 1.2 GiB after D=128 steps at 4k-16k)."""
    import gc
    entry._BACKWARD.clear()
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):  # (the first step records, the second replays)
        q, k, v = (torch.randn(1, 4096, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        longattn.flash_attention(q, k, v, causal=True, backend="triton").sum().backward()
        del q, k, v
    assert any(entry._BACKWARD.values()), "no replay was kept: the test checks nothing"
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 2 ** 20
