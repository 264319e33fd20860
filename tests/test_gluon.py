"""The Gluon Hopper kernels on a machine without one: the planner's candidates for them, the rules that decide which
launches they take (planned for made-up sm_90 device facts through ``longattn.routing``), and the Triton kernels
planned where they do not (the kernels themselves are tested in tests/gpu/test_gluon_gpu.py)."""
import re
import sys
import warnings

from dataclasses import replace

import pytest
import torch

from longattn.backends.device import Device
from longattn.backends.gluon import launch
from triton.runtime.errors import OutOfResources
from longattn.backends.routing import current, routing
from longattn.backends.triton import planner
from longattn.backends.triton.launch import BandArgs, SeqView
from longattn.call import AttentionCall, BlockSparse, Branch, SeqLens, flash_call


def _inputs(n=300, m=300, hq=4, hk=2, d=128, dtype=torch.bfloat16):
    q = torch.randn(2, n, hq, d, dtype=dtype)
    k = torch.randn(2, m, hk, d, dtype=dtype)
    return q, k, k.clone(), SeqView(seg_q=n, seg_k=m, n_seg=1, n_heads=hq)


HOPPER = Device(capability=(9, 0), interpret=True)  # an sm_90 GPU; the Gluon kernels' import as it goes here
AVAILABLE = Device(capability=(9, 0), interpret=True, gluon=True)  # ... where they import


@pytest.fixture
def gluon_launches(monkeypatch):
    """The Gluon forward's launches, recorded instead of run: ``(grid, args, constants)`` each (the kernel module
    replaced, four SMs on device 0)."""
    launched = []

    class _Launches:  # flash_fwd[grid](*args, **constants)
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, args, kw))

    monkeypatch.setattr(launch, "kernel_module", lambda: type("fwd", (), {"flash_fwd": _Launches()}))
    monkeypatch.setattr(launch, "_sm_count", lambda index: 4)
    monkeypatch.setattr(launch, "device_index", lambda device: 0)
    return launched


@pytest.fixture
def hopper():
    with routing(device=HOPPER):
        yield


@pytest.fixture
def available():
    with routing(device=AVAILABLE):
        yield


class _Launch:
    """The Gluon forward's rule (:func:`planner.why_not_gluon_forward`) called as the tests below ask it."""

    def why_not(self, q, k, v, view, *, merge, lists, packed, band=None, call=None):
        r = current()
        return planner.why_not_gluon_forward(planner.Launch(q, k, v, call or AttentionCall(0.1), view, band, merge,
                                                            packed, self.facts(q, r), r))

    def why_not_fused(self, q, k, v, do, call, grad_dtype=None):
        r = current()
        return planner.why_not_fused_backward(planner.Backward(q, k, v, do, call, grad_dtype, self.facts(q, r), r))

    @staticmethod
    def facts(q, r):
        return r.device or Device(cuda=q.is_cuda, capability=(0, 0), interpret=True)


rule = _Launch()


def test_forward_candidates_for_hopper_only_as_an_addition():
    """The forward's table: the Gluon kernel, then the Triton one, which takes every launch; the backward's: the
    128 x 128 Gluon kernel, the fused Gluon kernel, then the two Triton passes."""
    assert [c.kernel for c in planner.FORWARD] == [planner.GLUON_FWD, planner.TRITON_FWD]
    assert [c.kernel for c in planner.BACKWARD] == [planner.GLUON_WIDE_BWD, planner.GLUON_FUSED_BWD,
                                                    planner.TRITON_TWO_PASS]
    q, k, v, view = _inputs()
    assert planner.forward(q, k, v, flash_call(0.1))[0].chosen.kernel == planner.TRITON_FWD  # CPU tensors
    with routing(device=AVAILABLE):
        assert planner.forward(q, k, v, flash_call(0.1))[0].chosen.kernel == planner.GLUON_FWD
    assert not hasattr(launch, "backward_dkdv")


def test_rule_names_why_a_launch_is_not_taken(monkeypatch):
    q, k, v, view = _inputs()
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None) == "not a Hopper (sm_90) GPU"
    monkeypatch.setenv("LONGATTN_GLUON", "0")
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None) == "LONGATTN_GLUON=0"
    monkeypatch.delenv("LONGATTN_GLUON")
    with routing(gluon=False, device=AVAILABLE):
        assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None) == "routing gluon=False"


@pytest.mark.parametrize("change, reason", [
    (dict(d=32), "head dim 32"),
    (dict(d=64), "fewer than 1024 keys a query at head dim 64"),
    (dict(dtype=torch.float32), "dtype torch.float32"),
])
def test_rule_on_a_pretend_hopper(hopper, change, reason):
    q, k, v, view = _inputs(**change)
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None) == reason


def test_head_dim_64_needs_long_key_spans_on_a_pretend_hopper():
    """D=64 takes the Gluon forward where the middle query sees at least the routing's ``min_keys[64]`` keys: every
    key without a band, half of them under a causal mask (N = M), the window's span; never a packed batch."""
    with routing(device=AVAILABLE, min_keys={64: 40}):
        _check_head_dim_64_spans()


def _check_head_dim_64_spans():
    q, k, v, view = _inputs(n=64, m=64, d=64)
    causal, window = BandArgs(0, 0, False, True), BandArgs(20, 19, True, True)
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None) is None  # 64 keys
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None, band=causal) == (
        "fewer than 40 keys a query at head dim 64")  # 33 keys
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None, band=window) is None  # 40 keys
    q, k, v, view = _inputs(n=16, m=100, d=64)  # a causal query block at the end of 100 keys: 93 keys and more
    assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None, band=causal) is None
    cu = torch.tensor([0, 100, 200], dtype=torch.int32)
    pq, pk, pv = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v))
    whole = SeqView(seg_q=100, seg_k=100, n_seg=1, n_heads=4)
    assert rule.why_not(pk.repeat(1, 1, 2, 1), pk, pv, whole, merge=False, lists=None, packed=(cu, cu)) == (
        "a packed batch at head dim 64")


def test_rule_refuses_other_launches_on_a_pretend_hopper(hopper):
    q, k, v, view = _inputs()
    assert rule.why_not(q, k, v, view, merge=True, lists=None, packed=None) == "merged or block-list launch"
    dilated = SeqView(seg_q=100, seg_k=100, n_seg=3, n_heads=4, dilation=2)
    assert rule.why_not(q, k, v, dilated, merge=False, lists=None, packed=None) == "a segmented or dilated view"
    # Packed batches: one view of whole sequences only, and not of float8 inputs.
    cu = torch.tensor([0, 100, 600], dtype=torch.int32)
    pq, pk, pv = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v))
    whole = SeqView(seg_q=500, seg_k=500, n_seg=1, n_heads=4)
    segmented = SeqView(seg_q=256, seg_k=256, n_seg=2, n_heads=4)
    with routing(device=AVAILABLE):
        # D=128's tiles schedule packed batches without the per-tile set-up (packed_schedule 1): short ones too
        assert rule.why_not(pq, pk, pv, whole, merge=False, lists=None, packed=(cu, cu)) is None
        with routing(packed_schedule=0):  # the persistent schedule with that set-up takes long sequences only
            assert rule.why_not(pq, pk, pv, whole, merge=False, lists=None, packed=(cu, cu)) == (
                "packed sequences of fewer than 512 query rows on average")  # 600 rows in 2 sequences
        with routing(packed_schedule=0, packed_min_mean_rows=300):
            assert rule.why_not(pq, pk, pv, whole, merge=False, lists=None, packed=(cu, cu)) is None
            assert rule.why_not(pq, pk, pv, segmented, merge=False, lists=None, packed=(cu, cu)) == (
                "a segmented or dilated view")
    q_odd = torch.randn(2, 300, 4, 130, dtype=torch.bfloat16)[..., :128]  # rows of 260 bytes: not TMA-aligned
    assert rule.why_not(q_odd, k, v, view, merge=False, lists=None, packed=None) == "inputs not aligned for TMA"


def test_forward_hands_other_launches_to_the_triton_forward(monkeypatch):
    """The backend's forward runs the launcher its plan names: the Triton forward for a launch the Gluon kernel does
    not take (CPU tensors; soft-capping with ALiBi even on an sm_90 GPU), with the call's arguments."""
    from longattn.backends.triton import entry, launch as triton_launch
    calls = []
    monkeypatch.setattr(triton_launch, "forward", lambda *a, **kw: calls.append((a, kw)))
    q, k, v, view = _inputs()
    entry.forward(q, k, v, flash_call(0.1, True))
    assert len(calls) == 1 and calls[0][0][0] is q and calls[0][1]["merge"] is False
    # ALiBi (with the ring's per-block offset) and soft-capping go to the Triton forward with their arguments.
    slopes = torch.ones(2, 4)
    with routing(device=AVAILABLE):
        entry.forward(q, k, v, AttentionCall(0.1, True, softcap=5.0, alibi=slopes, alibi_offset=-64))
    assert len(calls) == 2 and calls[1][1]["slopes"] is slopes and calls[1][1]["alibi_offset"] == -64
    assert calls[1][1]["softcap"] == 5.0


def test_fp8_forward_runs_the_permuted_values_path(monkeypatch, gluon_launches):
    """Float8 calls routed to the Gluon forward (``fp8_head_dims``): the entry hands the launcher V in the kernel's
    layout (``fp8_layout.seq_major(v, permuted=True)``: ``(B, M', Hk, D)``, the keys permuted, ``M'`` = 112 for
    M = 100), copied once from V as given, and the launcher runs the kernel's ``FP8 == 2`` path on it (the kernel's
    launch recorded here)."""
    from longattn.backends.triton import entry
    from longattn.backends.triton.fp8_layout import seq_major
    from longattn.call import Descale

    g = torch.Generator().manual_seed(0)
    B, N, M, Hq, Hk, D = 2, 64, 100, 4, 2, 128
    q, k, v = (torch.randn(B, n, h, D, generator=g).to(torch.float8_e4m3fn) for n, h in ((N, Hq), (M, Hk), (M, Hk)))
    call = AttentionCall(D ** -0.5, descale=Descale(torch.ones(3, B, Hk)), out_dtype=torch.float32)
    copies = []
    monkeypatch.setattr(entry.layout, "seq_major", lambda x, permuted=False: copies.append(permuted) or
                        seq_major(x, permuted))
    with routing(device=AVAILABLE, fp8_head_dims=launch.FP8_KERNEL_HEAD_DIMS, fp8_min_keys=0):
        entry.forward(q, k, v, call)
    assert copies == [True]
    (_, args, kw), = gluon_launches
    want = seq_major(v, permuted=True)
    assert kw["FP8"] == launch.FP8_MODE == 2 and args[2].shape == (B, 112, Hk, D)
    t = launch.fp8_tiles(D, masked=False)  # (a band-free call: the unmasked row's 256-key tiles)
    assert (kw["BLOCK_N"], kw["LOADER_WARPS"], kw["PV_WAIT"]) == (256, 4, True)
    assert (kw["BLOCK_N"], kw["LOADER_WARPS"], kw["PV_WAIT"]) == (t.block_n, t.loader_warps, t.pv_wait_before_qk)
    assert kw["EXP2_FMA"] == t.fma_exp2 == 0
    assert torch.equal(args[2].view(torch.uint8), want.view(torch.uint8))
    assert args[17:21] == (Hk * D * 112, 1, D * 112, 112)  # V's batch, key, head and head-dim strides


def test_fp8_forward_falls_back_to_the_triton_one_with_values_sequence_major(monkeypatch):
    """A Gluon FP8 forward that fails at run time (:class:`launch.Unavailable`, recorded) leaves the call to the
    Triton FP8 forward, which reads V sequence-major: the entry copies V so before it launches (the Triton launch
    recorded here; its FP8 kernel does not run in the interpreter)."""
    from longattn.backends.triton import entry
    from longattn.call import Descale

    state = {"failed": False}
    module = type("fwd", (), {})
    monkeypatch.setattr(launch, "kernel_module", lambda: None if state["failed"] else module)

    def fails(*args, **kw):
        state["failed"] = True
        raise launch.Unavailable("made up")

    monkeypatch.setattr(launch, "forward", fails)
    triton_launches = []
    monkeypatch.setattr(entry.launch, "forward", lambda q, k, v, *a, **kw: triton_launches.append(v))
    g = torch.Generator().manual_seed(0)
    B, N, M, Hq, Hk, D = 1, 64, 100, 2, 1, 128
    q, k, v = (torch.randn(B, n, h, D, generator=g).to(torch.float8_e4m3fn) for n, h in ((N, Hq), (M, Hk), (M, Hk)))
    call = AttentionCall(D ** -0.5, descale=Descale(torch.ones(3, B, Hk)), out_dtype=torch.float32)
    with routing(device=HOPPER, fp8_head_dims=launch.FP8_KERNEL_HEAD_DIMS, fp8_min_keys=0):
        entry.forward(q, k, v, call)
    assert state["failed"]
    (given,) = triton_launches
    assert given.stride(1) == 1 and torch.equal(given.view(torch.uint8), v.view(torch.uint8))


def test_fp8_head_dims_the_kernel_lacks_plan_the_triton_forward():
    """A routing that names a float8 head dim the Gluon kernel has no tiles for plans the Triton forward (no KeyError
    on the kernel's tile table)."""
    from longattn.backends.triton import planner
    from longattn.call import Descale

    assert 96 not in launch.FP8_KERNEL_HEAD_DIMS
    q, k, v = (torch.zeros(1, 64, 2, 96, dtype=torch.float8_e4m3fn) for _ in range(3))
    call = AttentionCall(96 ** -0.5, descale=Descale(torch.ones(3, 1, 2)))
    with routing(device=AVAILABLE, fp8_head_dims=(96, 128)):
        (p,) = planner.forward(q, k, v, call)
    assert p.chosen.kernel != planner.GLUON_FWD and "float8 head dim 96" in str(p)


def test_long_causal_fp8_calls_plan_their_own_tiles():
    """A float8 causal call over one sequence plans :data:`launch.FP8_LONG_CAUSAL_TILES` at D=64 from its
    ``min_rows`` rows (queries or keys, the longer), the banded row below it, and the banded row whatever its length
    where a left edge bounds the band or the batch is packed; other head dims keep the banded row."""
    from longattn.backends.triton import planner
    from longattn.call import Descale

    least, long_tiles = launch.FP8_LONG_CAUSAL_TILES[64]
    assert long_tiles != launch.FP8_TILES[64] and 128 not in launch.FP8_LONG_CAUSAL_TILES

    def tiles(n, m, d=64, **kw):
        q = torch.zeros(1, n, 2, d, dtype=torch.float8_e4m3fn)
        k, v = (torch.zeros(1, m, 2, d, dtype=torch.float8_e4m3fn) for _ in range(2))
        call = AttentionCall(d ** -0.5, descale=Descale(torch.ones(3, 1, 2)), **kw)
        with routing(device=AVAILABLE, fp8_head_dims=launch.FP8_KERNEL_HEAD_DIMS):
            (p,) = planner.forward(q, k, v, call)
        assert p.chosen.kernel == planner.GLUON_FWD, str(p)
        return p.chosen.option("tiles")

    assert tiles(least, least, causal=True) == long_tiles
    assert tiles(64, least, causal=True) == long_tiles  # (few queries over a long cache: the keys are the rows)
    assert tiles(least - 128, least - 128, causal=True) == launch.FP8_TILES[64]
    assert tiles(least, least, window=(256, 0)) == launch.FP8_TILES[64]
    assert tiles(least, least, causal=True, d=128) == launch.FP8_TILES[128]
    assert tiles(least, least) == launch.FP8_UNMASKED_TILES[64]
    assert launch.fp8_tiles(64, masked=True, causal_rows=least) == long_tiles
    assert launch.fp8_tiles(64, masked=True) == launch.FP8_TILES[64]
    assert launch.fp8_tiles(64, masked=False, causal_rows=least) == launch.FP8_UNMASKED_TILES[64]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_head_dims_plan_the_gluon_forward_with_their_tiles(d):
    """Float8 calls at each of the kernel's head dims plan the Gluon forward with its float8 tiles where the routing
    names the head dim, as the default routing does for all three (a band-free call: the unmasked row where the head
    dim has one, a causal call the banded row); ``fp8_head_dims=()`` plans the Triton forward."""
    from longattn.backends.triton import planner
    from longattn.call import Descale

    q, k, v = (torch.zeros(1, 2048, 2, d, dtype=torch.float8_e4m3fn) for _ in range(3))
    call = AttentionCall(d ** -0.5, descale=Descale(torch.ones(3, 1, 2)))
    with routing(device=AVAILABLE, fp8_head_dims=launch.FP8_KERNEL_HEAD_DIMS):
        (p,) = planner.forward(q, k, v, call)
    assert p.chosen.kernel == planner.GLUON_FWD
    assert p.chosen.option("tiles") == launch.FP8_UNMASKED_TILES.get(d, launch.FP8_TILES[d])
    with routing(device=AVAILABLE, fp8_head_dims=launch.FP8_KERNEL_HEAD_DIMS):
        (p,) = planner.forward(q, k, v, replace(call, causal=True))
    assert p.chosen.option("tiles") == launch.FP8_TILES[d]
    with routing(device=AVAILABLE):
        (p,) = planner.forward(q, k, v, call)
    assert p.chosen.kernel == planner.GLUON_FWD, str(p)
    with routing(device=AVAILABLE, fp8_head_dims=()):
        (p,) = planner.forward(q, k, v, call)
    assert p.chosen.kernel != planner.GLUON_FWD, str(p)


@pytest.mark.parametrize("n, m, min_keys, gluon", [(64, 2047, None, False), (64, 2048, None, True),
                                                   (4096, 1024, None, False), (16, 8192, None, True),
                                                   (64, 256, 0, True), (64, 4096, 4097, False)])
def test_fp8_calls_with_few_keys_plan_the_triton_forward(n, m, min_keys, gluon):
    """Float8 calls whose values come sequence-major, with fewer keys than the routing's ``fp8_min_keys`` (2048 by
    default; the length of ``k``, whatever the query count), plan the Triton FP8 forward, and the plan says why; at
    or above it, the Gluon one. Values in the usual layout (both kernels copy them) plan the Gluon one at any
    length."""
    from longattn.backends.triton import planner
    from longattn.call import Descale

    q = torch.zeros(1, n, 2, 128, dtype=torch.float8_e4m3fn)
    k = torch.zeros(1, m, 2, 128, dtype=torch.float8_e4m3fn)
    v_seq = torch.zeros(1, 2, 128, m, dtype=torch.float8_e4m3fn).permute(0, 3, 1, 2)
    call = AttentionCall(128 ** -0.5, descale=Descale(torch.ones(3, 1, 2)))
    settings = {} if min_keys is None else {"fp8_min_keys": min_keys}
    with routing(device=AVAILABLE, **settings):
        (p,) = planner.forward(q, k, v_seq, call)
        (usual,) = planner.forward(q, k, k, call)
    assert (p.chosen.kernel == planner.GLUON_FWD) == gluon, str(p)
    if not gluon:
        assert f"fewer than {min_keys or 2048} keys of sequence-major float8 values" in str(p)
    assert usual.chosen.kernel == planner.GLUON_FWD, str(usual)


def test_fp8_path_that_does_not_compile_leaves_the_kernel_to_other_calls(monkeypatch):
    """The float8 path alone failing to compile is recorded (one warning): float8 calls then plan the Triton
    forward, bfloat16 ones still the Gluon kernel."""
    import ast

    from triton.compiler.errors import CompilationError

    from longattn.backends.triton import entry, planner
    from longattn.call import Descale

    class _Launches:
        def __getitem__(self, grid):
            def run(*args, **kw):
                if kw["FP8"]:
                    raise CompilationError("src", ast.parse("x").body[0], "made up: no such instruction")
            return run

    monkeypatch.setattr(launch, "kernel_module", lambda: type("fwd", (), {"flash_fwd": _Launches()}))
    monkeypatch.setattr(launch, "_sm_count", lambda index: 4)
    monkeypatch.setattr(launch, "device_index", lambda device: 0)
    monkeypatch.setattr(launch, "_fp8_failed", {})
    monkeypatch.setattr(entry.launch, "forward", lambda *a, **kw: None)  # (the Triton FP8 kernel: not here)
    q, k, v = (torch.zeros(1, 64, 2, 128, dtype=torch.float8_e4m3fn) for _ in range(3))
    call = AttentionCall(0.125, descale=Descale(torch.ones(3, 1, 2)), out_dtype=torch.float32)
    with routing(device=HOPPER, fp8_min_keys=0):
        with pytest.warns(UserWarning, match="float8 path of the Gluon forward"):
            entry.forward(q, k, v, call)
        assert list(launch._fp8_failed) == [128] and launch.kernel_module() is not None
        (p,) = planner.forward(q, k, v, call)
        assert p.chosen.kernel != planner.GLUON_FWD and "float8 path" in str(p)
        q64, k64, v64 = (torch.zeros(1, 64, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(3))
        (p,) = planner.forward(q64, k64, v64, replace(call, scale=0.125))  # another head dim keeps the kernel
        assert p.chosen.kernel == planner.GLUON_FWD
        qb, kb, vb = (torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16) for _ in range(3))
        (p,) = planner.forward(qb, kb, vb, AttentionCall(0.125))
        assert p.chosen.kernel == planner.GLUON_FWD


def test_planning_a_float8_call_copies_nothing(monkeypatch):
    """``entry.plan`` (what ``explain`` shows) plans a float8 call whose Triton forward reads V sequence-major on a
    tensor of that layout, not on a copy: no copy kernel runs, and the plan is the one the call would run (float8
    head dims not routed to the Gluon forward here)."""
    from longattn.backends.triton import entry, planner
    from longattn.backends.triton.fp8_layout import seq_major, seq_major_like
    from longattn.call import Descale

    q, k, v = (torch.zeros(1, 64, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(3))
    call = AttentionCall(0.125, descale=Descale(torch.ones(3, 1, 2)))
    like = seq_major_like(v)
    assert like.shape == v.shape and like.stride() == seq_major(v).stride()
    with routing(device=HOPPER, fp8_head_dims=()):
        want = planner.forward(q, k, seq_major(v), call)
        monkeypatch.setattr(entry.layout, "seq_major", lambda *a, **kw: pytest.fail("a copy while planning"))
        (p,) = entry.plan(q, k, v, call, needs_grad=False)
    assert p.chosen.kernel != planner.GLUON_FWD and str(p) == str(want[0])


def test_missing_gluon_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(launch, "_kernel", None)
    monkeypatch.setattr(launch, "_unavailable", None)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # an import of it now fails
    with pytest.warns(UserWarning, match="Gluon Hopper kernels are unavailable"):
        assert launch.kernel_module() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.kernel_module() is None  # said once
    q, k, v, view = _inputs()
    with routing(device=HOPPER):
        assert rule.why_not(q, k, v, view, merge=False, lists=None, packed=None) == "Gluon unavailable"



def test_fused_backward_planned_for_hopper_only():
    """The ``"bwd"`` pass: the fused kernel at sm_90 only; elsewhere the two Triton passes, the reason named."""
    q, k, v, _ = _inputs()
    plan = planner.backward(q, k, v, q, flash_call(0.1))
    assert plan[0].chosen.kernel == planner.TRITON_TWO_PASS
    assert plan[0].rejected == tuple(planner.Rejected(kernel, "not a Hopper (sm_90) GPU")
                                     for kernel in (planner.GLUON_WIDE_BWD, planner.GLUON_FUSED_BWD))
    assert [p.name for p in plan[1:]] == ["dkdv", "dq"]
    with routing(device=AVAILABLE, fused_bwd_min_rows={}):
        assert [p.chosen.kernel for p in planner.backward(q, k, v, q, flash_call(0.1))] == [planner.GLUON_FUSED_BWD]


@pytest.mark.parametrize("change, reason", [
    (dict(), None),
    (dict(causal=True), None),
    (dict(window=(-1, 0)), None),  # the causal band by another name
    (dict(d=64, hk=4), None),
    (dict(dtype=torch.float16, hk=1), None),
    (dict(grad_dtype=torch.float32), None),
    (dict(window=(1000, 23)), None),  # sliding windows of at least FUSED_BWD_MIN_BAND keys
    (dict(window=(-1, 5)), None),
    (dict(window=(100, 0)), "a band narrower than 1024 keys"),  # the two passes are faster there
    (dict(call=AttentionCall(0.1, softcap=30.0, alibi=torch.ones(2, 4))), None),  # score modifications
    (dict(call=AttentionCall(0.1, causal=True, seqlens=SeqLens(torch.tensor([0, 300]), torch.tensor([0, 300]), 300,
                                                                300))), None),  # a packed batch
    (dict(d=96), "head dim 96"),
    (dict(d=256), None),  # bwd_fused_wide.py
    (dict(n=500, m=500, min_keys=True), "fewer than 512 query rows a key at head dim 128"),  # short: two passes
    (dict(n=1000, m=1000, causal=True, min_keys=True), "fewer than 512 query rows a key at head dim 128"),
    (dict(n=1024, m=1024, causal=True, min_keys=True), None),
    (dict(n=1000, m=1000, min_keys=True), None),
    (dict(n=2000, m=2000, causal=True, d=64, min_keys=True), "fewer than 1024 query rows a key at head dim 64"),
    (dict(n=2048, m=2048, causal=True, d=64, min_keys=True), None),
    (dict(n=4096, m=4096, causal=True, d=64, min_keys=True), None),
    (dict(n=300, m=5000, causal=True, d=64, min_keys=True),  # N < M: 300 rows see each key
     "fewer than 1024 query rows a key at head dim 64"),
    (dict(n=8192, m=4096, causal=True, min_keys=True), None),  # N > M: 2048 rows a key (the middle query sees 1)
    (dict(n=1000, m=1000, d=256, min_keys=True), None),
    (dict(n=3000, m=3000, window=(1023, 0), d=64, min_keys=True), None),  # windows: FUSED_BWD_MIN_BAND's rule
    (dict(call=AttentionCall(0.1, causal=True, seqlens=SeqLens(torch.tensor([0, 300]), torch.tensor([0, 300]), 300,
                                                                300)), min_keys=True), None),  # packed: fused
    (dict(window=(1022, 0)), "a band narrower than 1024 keys"),
    (dict(window=(100, 0), d=256), None),  # D=256: the fused kernel on every band
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(grad_dtype=torch.float64), "gradients in torch.float64"),
    (dict(call=AttentionCall(0.1, branches=(Branch(128, 1, 0, 4),))), "not a dense, block-sparse or packed call"),
    (dict(env="0"), "LONGATTN_GLUON=0"),
    (dict(lists=((1, 1), (128, 128))), None),  # block-sparse: shared lists, grouped-query heads
    (dict(lists=((2, 4), (128, 128)), hk=4), None),  # per-head lists, one query head per key/value head
    (dict(lists=((2, 4), (128, 128))), "per-head block lists with grouped-query heads"),
    (dict(lists=((1, 1), (128, 64))), "blocks of 128 x 64 (the kernel needs multiples of 64 queries and 128 keys)"),
])
def test_fused_backward_rule_on_a_pretend_hopper(monkeypatch, change, reason):
    """Which calls the fused backward takes: dense or packed, any band, soft-capping and ALiBi, MHA or grouped-query
    heads, float16/bfloat16, D 64, 128 or 256, where a key is seen by enough queries (``FUSED_BWD_MIN_ROWS``, off unless
    ``min_keys``); every other call keeps the two Triton passes."""
    pytest.importorskip("longattn.backends.gluon.bwd_fused")
    settings = dict(device=AVAILABLE) if change.get("min_keys") else dict(device=AVAILABLE, fused_bwd_min_rows={})
    if "env" in change:
        monkeypatch.setenv("LONGATTN_GLUON", change["env"])
    q, k, v, _ = _inputs(n=change.get("n", 300), m=change.get("m", 300), d=change.get("d", 128),
                         hk=change.get("hk", 2), dtype=change.get("dtype", torch.bfloat16))
    call = change.get("call", flash_call(0.1, change.get("causal", False), change.get("window", (-1, -1))))
    if "lists" in change:
        from longattn.backends.triton.lists import BlockLists
        (bm, hm), block = change["lists"]
        nq, nk = -(-q.shape[1] // block[0]), -(-k.shape[1] // block[1])
        lists = BlockLists(*(torch.zeros(bm, hm, *shape, dtype=torch.int32)
                             for shape in ((nq, 2), (nq, nk), (nk, 2), (nk, nq))))
        call = replace(call, blocks=BlockSparse(torch.ones(bm, hm, nq, nk, dtype=torch.bool), block, lists))
    with routing(**settings):
        assert rule.why_not_fused(q, k, v, q, call, change.get("grad_dtype")) == reason


def test_fused_backward_rule_needs_hopper_and_aligned_inputs(monkeypatch):
    q, k, v, _ = _inputs()
    assert rule.why_not_fused(q, k, v, q, flash_call(0.1)) == "not a Hopper (sm_90) GPU"
    with routing(device=Device(capability=(9, 0), interpret=True, gluon=False), fused_bwd_min_rows={}):
        assert rule.why_not_fused(q, k, v, q, flash_call(0.1)) == "Gluon unavailable"
        odd = torch.randn(2 * 300 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 300, 4, 128)
        assert rule.why_not_fused(odd, k, v, q, flash_call(0.1)) == "inputs not aligned for TMA"


def test_fused_backward_pass_runs_the_kernel_or_declines(monkeypatch):
    """On a covered call the pass returns the kernel's gradients, the band as a window and the score modifications
    and packed lengths passed on; on any other, None."""
    seen = []

    class Kernel:
        @staticmethod
        def fused_backward(do, q, k, v, o, lse, scale, causal, dlse=None, grad_dtype=None, **kw):
            seen.append((scale, causal, grad_dtype, kw))
            return "grads"
    monkeypatch.setattr(launch, "_fused_kernel", Kernel)
    q, k, v, _ = _inputs()
    assert launch.fused_backward(q, q, k, v, q, None, flash_call(0.5, window=(-1, 0)), None, torch.float32) == "grads"
    assert seen[-1][:3] == (0.5, False, torch.float32)
    assert seen[-1][3] == dict(window=(-1, 0), softcap=0.0, slopes=None, alibi_offset=0, cu_seqlens=None, lists=None,
                               list_block=None, deterministic=False, workspace=None, host_descriptors=False)
    slopes = torch.rand(2, 4)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    call = AttentionCall(0.5, window=(1700, 3), softcap=20.0, alibi=slopes, alibi_offset=-5,
                         seqlens=SeqLens(cu, cu, 200, 200))
    assert launch.fused_backward(q[:1], q[:1], k[:1], v[:1], q[:1], None, call) == "grads"
    kw = seen[-1][3]
    assert kw["window"] == (1700, 3) and kw["softcap"] == 20.0 and kw["alibi_offset"] == -5
    assert torch.equal(kw["slopes"], slopes) and kw["cu_seqlens"] == (cu, cu)
    with routing(device=AVAILABLE, fused_bwd_min_rows={}):
        assert planner.backward(q, q, k, q, flash_call(0.5))[0].chosen.kernel == planner.GLUON_FUSED_BWD
        deterministic = planner.backward(q, q, k, q, replace(flash_call(0.5), deterministic=True))
    assert deterministic[0].chosen.kernel == planner.TRITON_TWO_PASS  # declined: the two passes run it
    assert len(seen) == 2


def test_backward_takes_the_bwd_pass_and_falls_back_to_the_two_passes(monkeypatch):
    """ops.backward returns what the fused backward gives where the plan names it; where it gives None, the ``"dkdv"``
    and ``"dq"`` passes run (the same gradients as without it)."""
    from longattn.backends.triton import entry as ops
    q, k, v, do = (torch.randn(1, 40, s, 64, dtype=torch.float16) for s in (2, 1, 1, 2))
    call = flash_call(0.25, causal=True)
    o, lse = ops.forward(q, k, v, call)
    want = ops.backward(do, q, k, v, o, lse, call)
    taken = []
    with routing(device=AVAILABLE, fused_bwd_min_rows={}, wide_bwd_head_dims=()):
        monkeypatch.setattr(launch, "fused_backward", lambda *a, **kw: taken.append(a) or ("g",) * 3)
        assert ops.backward(do, q, k, v, o, lse, call) == ("g",) * 3
        assert len(taken) == 1 and taken[0][6] is call
        monkeypatch.setattr(launch, "fused_backward", lambda *a, **kw: None)
        for got, ref in zip(ops.backward(do, q, k, v, o, lse, call), want):
            assert torch.equal(got, ref)

def test_fused_backward_pairs_key_blocks_only_where_the_causal_grid_is_unbalanced():
    """The fused backward's schedule (pure arithmetic, no GPU): a program takes key blocks ``p`` and ``last - p``
    where one program per key block would leave a long tail: causal grouped-query heads (8 query heads a program,
    few programs), not MHA with many programs, never non-causal calls."""
    bwd_fused = pytest.importorskip("longattn.backends.gluon.bwd_fused")
    pairs = bwd_fused.paired_schedule
    assert pairs(True, 8192, 8192, 2, 2, 8, 64, 128, 132)  # GQA 16/2: 256 programs, work 2..128 blocks x 8
    assert pairs(True, 8192, 8192, 2, 4, 4, 64, 128, 132)  # GQA 16/4
    assert not pairs(True, 16384, 16384, 1, 16, 1, 64, 128, 132)  # MHA: 2048 programs balance by themselves
    assert not pairs(False, 8192, 8192, 2, 2, 8, 64, 128, 132)  # equal columns
    assert not pairs(True, 512, 512, 1, 1, 8, 64, 128, 132)  # 4 programs on 132 SMs: nothing to balance
    # the makespan of list scheduling in launch order
    assert bwd_fused._makespan([4, 1, 1, 1, 1], 2) == 4 and bwd_fused._makespan([1, 1, 1, 1, 4], 2) == 6


@pytest.mark.parametrize("left, right", [(None, 0), (None, None), (100, 0)])
def test_fused_backward_work_table_covers_every_key_block_once(left, right):
    """A packed batch's programs (torch arithmetic, no GPU): every (sequence, key block) exactly once whatever the
    lengths (empty sequences included), the statistics column of its sequence, the programs with the most query
    rows first, and the bound's spare programs marked -1 after them."""
    from longattn.backends.gluon.packed import work_table
    lens_q, lens_k = [0, 130, 1, 900, 128, 0, 257], [5, 130, 1, 900, 0, 0, 300]
    cu_q, cu_k = (torch.tensor([0] + x).cumsum(0).to(torch.int32) for x in (lens_q, lens_k))
    qb = torch.nn.functional.pad(torch.cumsum(-(-torch.diff(cu_q) // 64), 0), (1, 0)).to(torch.int32)
    table = work_table(cu_q, cu_k, qb, sum(lens_k), 64, 128, left, right)
    assert table.dtype == torch.int32 and table.shape == (3, sum(lens_k) // 128 + len(lens_k))
    seq, blk, col = table.tolist()
    real = [(s, p) for s, p in zip(seq, blk) if s >= 0]
    assert sorted(real) == [(s, p) for s, n in enumerate(lens_k) for p in range(-(-n // 128))]
    assert all(c == qb[s].item() * 64 for s, c in zip(seq, col) if s >= 0)
    assert seq.index(-1) == len(real) and set(seq[len(real):]) == {-1}
    assert (seq[0], blk[0]) == (3, 0)  # 900 rows see the first key block of the longest sequence


@pytest.mark.parametrize("packed", [False, True])
def test_fused_backward_row_statistics(packed):
    """The fused backward's statistics kernel (a Triton kernel: it runs in the interpreter): ``lse2`` (base 2,
    ``+inf`` for a row that saw no key and for padding) and ``delta = rowsum(dO * O) - dlse``, per (batch, head) row
    padded to whole query blocks, or for a packed batch per sequence from a whole block on (empty sequences too)."""
    bwd_fused = pytest.importorskip("longattn.backends.gluon.bwd_fused")
    from longattn.backends.gluon.packed import query_blocks_before
    g = torch.Generator().manual_seed(0)
    lens = [70, 0, 1, 130] if packed else None
    B, N, H, D, block = (1, sum(lens), 3, 16, 64) if packed else (2, 100, 3, 16, 64)
    o, do = (torch.randn(B, N, H, D, generator=g) for _ in range(2))
    lse = torch.randn(B, H, N, generator=g)
    lse[0, 1, 5] = float("-inf")  # a row that saw no key
    dlse = torch.randn(B, H, N, generator=g)
    delta = (o * do).sum(-1).transpose(1, 2) - dlse
    if packed:
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        qb = query_blocks_before(cu, block)
        n_pad = (N // block + len(lens)) * block
        block_seq = torch.searchsorted(qb[1:], torch.arange(n_pad // block, dtype=torch.int32), right=True).to(
            torch.int32)
        grid, n_seqs = (n_pad // block * H,), len(lens)
    else:
        cu = qb = block_seq = lse
        n_pad = -(-N // block) * block
        grid, n_seqs = (n_pad // block * B * H,), B
    stats = torch.full((B * H * 2, n_pad), float("nan"))
    bwd_fused._row_stats[grid](o, do, lse, dlse, stats, block_seq, cu, qb, *o.stride()[:3], *do.stride()[:3], N, H,
                               n_pad, n_seqs, HEAD_D=D, BLOCK=block, HAS_DLSE=True, VARLEN=packed)
    want = torch.full((B * H * 2, n_pad), float("nan"))
    for b in range(B):
        for h in range(H):
            spans = [(int(cu[s]), int(qb[s]) * block, n) for s, n in enumerate(lens)] if packed else [(0, 0, N)]
            for row0, col0, n in spans:
                pad = -(-n // block) * block
                l2 = torch.full((pad,), float("inf"))
                l2[:n] = torch.where(torch.isneginf(lse[b, h, row0:row0 + n]), float("inf"),
                                     lse[b, h, row0:row0 + n] * 1.4426950408889634)
                dd = torch.zeros(pad)
                dd[:n] = delta[b, h, row0:row0 + n]
                want[(b * H + h) * 2, col0:col0 + pad] = l2
                want[(b * H + h) * 2 + 1, col0:col0 + pad] = dd
    written = ~torch.isnan(want)
    torch.testing.assert_close(stats[written], want[written], rtol=1e-5, atol=1e-5)


def test_wide_backward_takes_dense_d64_calls_and_names_why_not_elsewhere():
    """The 128 x 128 backward takes the dense D=64 calls the fused backward takes, with no band but causal's, no
    score modification, no log-sum-exp gradient and gradients in the inputs' dtype; every other call goes on to
    the fused backward with the reason named, and the routing's ``wide_bwd_head_dims=()`` turns it off."""
    q, k, v, _ = _inputs(d=64)

    def bwd(call, q=q, k=k, v=v, **kw):
        first = planner.backward(q, k, v, q, call, **kw)[0]
        return first.chosen.kernel, dict((r.kernel, r.reason) for r in first.rejected).get(planner.GLUON_WIDE_BWD)

    with routing(device=AVAILABLE, fused_bwd_min_rows={}):
        assert bwd(flash_call(0.1)) == (planner.GLUON_WIDE_BWD, None)
        assert bwd(flash_call(0.1, causal=True)) == (planner.GLUON_WIDE_BWD, None)
        assert bwd(flash_call(0.1, window=(1500, 0))) == (planner.GLUON_FUSED_BWD, "a band other than causal's")
        assert bwd(replace(flash_call(0.1), softcap=5.0)) == (planner.GLUON_FUSED_BWD, "soft-capping, ALiBi or sinks")
        assert bwd(replace(flash_call(0.1), sinks=torch.zeros(4))) == (planner.GLUON_FUSED_BWD,
                                                                       "soft-capping, ALiBi or sinks")
        assert bwd(flash_call(0.1), has_dlse=True) == (planner.GLUON_FUSED_BWD,
                                                       "an upstream gradient of the log-sum-exp")
        assert bwd(flash_call(0.1), grad_dtype=torch.float32) == (planner.GLUON_FUSED_BWD,
                                                                  "gradients in torch.float32")
        q128, k128, v128, _ = _inputs(d=128)
        assert bwd(flash_call(0.1), q=q128, k=k128, v=v128) == (planner.GLUON_FUSED_BWD,
                                                                "head dim 128 (the kernel takes 64)")
        kernel, why = bwd(replace(flash_call(0.1), deterministic=True))
        assert kernel == planner.TRITON_TWO_PASS and why.startswith("deterministic=True")
        for tiny in (1e-31, 1e-39):  # (its statistics folded into the accumulators would overflow float32)
            kernel, why = bwd(flash_call(tiny))
            assert kernel == planner.TRITON_TWO_PASS and why.startswith("a softmax scale below 1e-30"), why
        assert bwd(flash_call(1e-29)) == (planner.GLUON_WIDE_BWD, None)
    with routing(device=AVAILABLE, fused_bwd_min_rows={}, wide_bwd_head_dims=()):
        assert bwd(flash_call(0.1)) == (planner.GLUON_FUSED_BWD, "head dim 64")
    # Its own threshold of query rows a key (wide_bwd_min_rows, 512), below the fused backward's (1024 at D=64):
    # between the two the calls it declines (float32 gradients here) run the two passes.
    q, k, v, _ = _inputs(n=1024, m=1024, d=64)
    with routing(device=AVAILABLE):
        assert bwd(flash_call(0.1, causal=True), q=q, k=k, v=v) == (planner.GLUON_WIDE_BWD, None)  # 512.5 rows
        kernel, why = bwd(flash_call(0.1, causal=True), q=q, k=k, v=v, grad_dtype=torch.float32)
        assert kernel == planner.TRITON_TWO_PASS and why == "gradients in torch.float32", why
        assert bwd(flash_call(0.1, causal=True), q=q[:, :1000], k=k[:, :1000], v=v[:, :1000]) == (
            planner.TRITON_TWO_PASS, "fewer than 512 query rows a key at head dim 64")
    with routing(device=AVAILABLE, wide_bwd_min_rows=2048):  # (the fused backward's 1024 where lower)
        assert bwd(flash_call(0.1), q=q, k=k, v=v)[0] == planner.GLUON_WIDE_BWD


def test_the_backward_plan_names_host_descriptors_where_the_routing_gives_them():
    """``host_descriptors`` is a plan option of the 128 x 128 backward (``wide_bwd_host_descriptors``) and of the
    fused backward at the routing's head dims (``fused_bwd_host_descriptor_head_dims``) on calls without a packed
    batch or block lists; absent elsewhere."""
    def host(d, call=None, **kw):
        q, k, v, _ = _inputs(d=d, **kw)
        with routing(device=AVAILABLE, fused_bwd_min_rows={}, **ROUTE):
            chosen = planner.backward(q, k, v, q, call or flash_call(0.1, causal=True))[0].chosen
        return chosen.kernel, chosen.option("host_descriptors", False)

    ROUTE = {}
    assert host(64) == (planner.GLUON_WIDE_BWD, True)
    assert host(128) == (planner.GLUON_FUSED_BWD, True)
    assert host(128, replace(flash_call(0.1, window=(1100, 3)), softcap=5.0)) == (planner.GLUON_FUSED_BWD, True)
    assert host(64, flash_call(0.1, window=(1500, 0))) == (planner.GLUON_FUSED_BWD, False)  # (not routed at 64)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    packed = AttentionCall(0.1, window=(-1, 0), seqlens=SeqLens(cu, cu, 200, 200))
    q, k, v, _ = _inputs()
    with routing(device=AVAILABLE, fused_bwd_min_rows={}):
        chosen = planner.backward(q[:1], k[:1], v[:1], q[:1], packed)[0].chosen
    assert chosen.kernel == planner.GLUON_FUSED_BWD and chosen.option("host_descriptors") is None
    ROUTE = dict(wide_bwd_host_descriptors=False, fused_bwd_host_descriptor_head_dims=(64,))
    assert host(64) == (planner.GLUON_WIDE_BWD, False)
    assert host(128) == (planner.GLUON_FUSED_BWD, False)
    assert host(64, flash_call(0.1, window=(1500, 0))) == (planner.GLUON_FUSED_BWD, True)


def test_wide_backward_runs_what_the_plan_names_and_gives_way_when_it_fails(monkeypatch):
    """The backward runs the 128 x 128 kernel the plan names, with the causal flag of the call's band; a kernel that
    fails is recorded, and the same call then runs the fused backward (the new plan's choice)."""
    from longattn.backends.gluon import bwd_wide_tile
    from longattn.backends.triton import entry

    seen = []

    def fake_wide(q, k, v, o, do, lse, dq, dk, dv, scale, causal, **buffers):
        seen.append(("wide", scale, causal, dq.dtype, dq.is_contiguous()))
        return dq.fill_(1), dk.fill_(2), dv.fill_(3)

    class Fused:
        @staticmethod
        def fused_backward(do, q, k, v, o, lse, scale, causal, dlse=None, grad_dtype=None, **kw):
            seen.append(("fused", scale))
            return "fused grads"

    monkeypatch.setattr(bwd_wide_tile, "backward", fake_wide)
    monkeypatch.setattr(launch, "_fused_kernel", Fused)
    monkeypatch.setattr(launch, "_wide_failed", {})
    monkeypatch.setattr(launch, "kernel_module", lambda: object())
    q, k, v, _ = _inputs(d=64)
    lse = torch.zeros(2, 4, 300)
    with routing(device=AVAILABLE, fused_bwd_min_rows={}):
        dq, dk, dv = entry.backward(q, q, k, v, q, lse, flash_call(0.25, causal=True))
        assert seen[-1] == ("wide", 0.25, True, q.dtype, True) and bool((dk == 2).all())
        entry.backward(q, q, k, v, q, lse, flash_call(0.25))
        assert seen[-1][2] is False

        def broken(*args, **kwargs):
            raise OutOfResources(300000, 232448, "shared memory")
        monkeypatch.setattr(bwd_wide_tile, "backward", broken)
        with pytest.warns(UserWarning, match="128 x 128 backward failed"):
            assert entry.backward(q, q, k, v, q, lse, flash_call(0.25)) == "fused grads"
        assert 64 in launch._wide_failed
        assert planner.backward(q, k, v, q, flash_call(0.25))[0].chosen.kernel == planner.GLUON_FUSED_BWD


@pytest.mark.parametrize("error", ["compile", "resources"])
def test_a_host_descriptor_form_that_does_not_compile_gives_way_to_device_descriptors(monkeypatch, error):
    """Where a Gluon backward's form with host-made descriptors fails to compile (or to fit the GPU), that form
    alone is dropped (a warning, ``launch._host_failed``): the same call runs the kernel with descriptors made on
    the device, and the next plans no longer name the option; the Gluon kernels stay on."""
    from triton.compiler.errors import CompilationError

    from longattn.backends.gluon import bwd_wide_tile
    from longattn.backends.triton import entry

    seen = []

    def wide(q, k, v, o, do, lse, dq, dk, dv, scale, causal, host_descriptors=False, **buffers):
        seen.append(host_descriptors)
        if host_descriptors:
            if error == "resources":
                raise OutOfResources(300000, 232448, "shared memory")
            raise CompilationError("kernel source", None, "no host descriptors here")
        return dq.fill_(1), dk.fill_(2), dv.fill_(3)

    monkeypatch.setattr(bwd_wide_tile, "backward", wide)
    for name in ("_wide_failed", "_fused_failed", "_host_failed"):
        monkeypatch.setattr(launch, name, {})
    monkeypatch.setattr(launch, "kernel_module", lambda: object())
    q, k, v, _ = _inputs(d=64)
    lse = torch.zeros(2, 4, 300)
    with routing(device=AVAILABLE, fused_bwd_min_rows={}):
        with pytest.warns(UserWarning, match="host-made descriptors does not " + ("fit this GPU" if error ==
                                                                                   "resources" else "compile")):
            dq, dk, dv = entry.backward(q, q, k, v, q, lse, flash_call(0.25, causal=True))
        assert seen == [True, False] and bool((dk == 2).all())
        assert "wide" in launch._host_failed and not launch._wide_failed and launch._unavailable is None
        chosen = planner.backward(q, k, v, q, flash_call(0.25))[0].chosen
        assert chosen.kernel == planner.GLUON_WIDE_BWD and chosen.option("host_descriptors") is None


@pytest.fixture
def stubbed_backwards(monkeypatch):
    """The Gluon backwards' launchers on the CPU: no failure recorded, the kernels' module "imported", the fused
    backward's module the real one (its ``fused_backward`` for the test to replace)."""
    from longattn.backends.gluon import bwd_fused

    monkeypatch.setattr(launch, "_fused_kernel", bwd_fused)
    for name in ("_wide_failed", "_fused_failed", "_host_failed"):
        monkeypatch.setattr(launch, name, {})
    monkeypatch.setattr(launch, "kernel_module", lambda: object())
    return bwd_fused


def test_failures_one_after_another_reach_the_next_gluon_backward(monkeypatch, stubbed_backwards):
    """The 128 x 128 backward's host form does not compile, then that kernel does not fit: the same call goes on to
    the fused backward (it stopped at the two Triton passes after two failures, on unplanned tiles)."""
    from triton.compiler.errors import CompilationError

    from longattn.backends.gluon import bwd_wide_tile
    from longattn.backends.triton import entry

    seen = []

    def wide(q, k, v, o, do, lse, dq, dk, dv, scale, causal, host_descriptors=False, **buffers):
        seen.append(("wide", host_descriptors))
        if host_descriptors:
            raise CompilationError("kernel source", None, "no host descriptors here")
        raise OutOfResources(300000, 232448, "shared memory")

    def fused(do, q, k, v, o, lse, scale, causal, **kw):
        seen.append(("fused", kw.get("host_descriptors")))
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)

    monkeypatch.setattr(bwd_wide_tile, "backward", wide)
    monkeypatch.setattr(stubbed_backwards, "fused_backward", fused)
    q, k, v, _ = _inputs(d=64)
    lse = torch.zeros(2, 4, 300)
    with routing(device=AVAILABLE, fused_bwd_min_rows={}, replay=False):
        with pytest.warns(UserWarning):
            dq, dk, dv = entry.backward(q, q, k, v, q, lse, flash_call(0.25, causal=True))
    assert seen == [("wide", True), ("wide", False), ("fused", False)]
    assert bool((dk == 2).all()) and "wide" in launch._host_failed and 64 in launch._wide_failed


def test_a_fused_host_form_out_of_resources_leaves_the_fused_kernel_on(monkeypatch, stubbed_backwards):
    """The fused backward's host-descriptor form running out of resources drops that form only: the call runs the
    fused kernel with device-made descriptors, which stays routed at its head dim."""
    from longattn.backends.triton import entry

    seen = []

    def fused(do, q, k, v, o, lse, scale, causal, **kw):
        seen.append(kw.get("host_descriptors"))
        if kw.get("host_descriptors"):
            raise OutOfResources(300000, 232448, "shared memory")
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)

    monkeypatch.setattr(stubbed_backwards, "fused_backward", fused)
    q, k, v, _ = _inputs(d=128)
    lse = torch.zeros(2, 4, 300)
    with routing(device=AVAILABLE, fused_bwd_min_rows={}, replay=False):
        with pytest.warns(UserWarning, match="host-made descriptors does not fit this GPU"):
            dq, dk, dv = entry.backward(q, q, k, v, q, lse, flash_call(0.25, causal=True))
        assert seen == [True, False] and bool((dk == 2).all())
        assert "fused" in launch._host_failed and not launch._fused_failed
        assert planner.backward(q, k, v, q, flash_call(0.25))[0].chosen.kernel == planner.GLUON_FUSED_BWD


def test_gluon_tiles_folded_mask_field():
    """``fold_mask`` is off by default and must be a bool; D=64's and D=128's routed tiles take it (D=256's, with
    one Q buffer and 64-key stages, were not measured with it)."""
    assert launch.GluonTiles(64, 128, 2, 240).fold_mask is False
    with pytest.raises(ValueError, match="fold_mask"):
        launch.GluonTiles(64, 128, 2, 240, fold_mask=1)
    assert launch.TILES[64].fold_mask and launch.TILES[128].fold_mask
    assert not launch.TILES[256].fold_mask


def test_gluon_tiles_pv_wait_field():
    """``pv_wait_before_qk`` is off by default and must be a bool; the band-free float8 tiles at D=128 take it with
    256-key stages (two of them, with Q's two buffers, fit an H100's 227 KB of shared memory), no other routed tile
    does (D=64's band-free float8 tiles are three consumers on 128-key blocks)."""
    assert launch.GluonTiles(64, 128, 2, 240).pv_wait_before_qk is False
    with pytest.raises(ValueError, match="pv_wait_before_qk must be a bool"):
        launch.GluonTiles(64, 256, 2, 240, pv_wait_before_qk=1)
    assert launch.FP8_UNMASKED_TILES[128] == launch.GluonTiles(64, 256, 2, 240, pv_wait_before_qk=True)
    assert launch.FP8_UNMASKED_TILES[64] == launch.GluonTiles(64, 128, 2, 160, 3)
    assert sorted(launch.FP8_UNMASKED_TILES) == [64, 128]
    others = (*launch.FP8_TILES.values(), *launch.TILES.values(), launch.FP8_UNMASKED_TILES[64])
    assert not any(x.pv_wait_before_qk for x in others)
    assert launch.fp8_tiles(128, masked=True) == launch.FP8_TILES[128]
    assert launch.fp8_tiles(256, masked=False) == launch.FP8_TILES[256]


def test_gluon_tiles_fma_exp2_field_and_the_float8_tiles():
    """``fma_exp2`` (a share of the float8 exponentials on the FMA pipes) is off by default, in no bf16 tile, and
    takes 0 or a power of two up to 16; the float8 tiles fit an H100's shared memory and registers, and banded calls
    keep 128-key blocks."""
    assert launch.GluonTiles(64, 128, 2, 240).fma_exp2 == 0
    for bad in (1, 3, 32, 8.0, True):
        with pytest.raises(ValueError, match="fma_exp2 must be 0, 2, 4, 8 or 16"):
            launch.GluonTiles(64, 128, 2, 240, fma_exp2=bad)
    assert not any(t.fma_exp2 for t in launch.TILES.values())
    for d in launch.FP8_KERNEL_HEAD_DIMS:
        for masked in (False, True):
            t = launch.fp8_tiles(d, masked)
            q_bytes = 2 * t.consumers * t.sub_m * d  # two Q buffers of float8 rows of d bytes
            assert q_bytes + t.stages * 2 * t.block_n * d <= 227 * 1024
            loader_regs = 32 if t.consumers == 3 else 24  # (the loader keeps 32 beside three consumers)
            assert t.consumers * t.consumer_regs * 128 + 128 * loader_regs <= 65536
            assert not masked or t.block_n == 128  # (banded calls lost on 256-key blocks)


def _run_ptx(asm: str, inputs):
    """The float32 values of the ``$i`` outputs of the straight-line PTX ``asm`` (the instructions of
    fwd._exp2_asm only) given ``inputs`` (float32 tensors for the ``$`` operands after the outputs), computed on the
    CPU with each instruction's rounding (``.rm``: toward minus infinity; ``.ftz``: results below 2**-126 flushed)."""
    n_out = len(inputs)  # (an elementwise asm: as many outputs as inputs)
    regs = {f"${n_out + i}": x.to(torch.float32) for i, x in enumerate(inputs)}

    def val(tok):
        if tok.startswith("0f"):
            return from_bits(torch.tensor(int(tok[2:], 16)))
        if tok.lstrip("-").isdigit():
            return from_bits(torch.tensor(int(tok)))
        return regs[tok]

    def f32(x64, rm=False):
        r = x64.to(torch.float32)
        if rm:  # round toward minus infinity
            r = torch.where(r.double() > x64, torch.nextafter(r, torch.tensor(float("-inf"))), r)
        return torch.where(r.abs() < 2.0 ** -126, torch.zeros_like(r), r)

    def bits(x):
        return x.view(torch.int32).to(torch.int64)

    def from_bits(b):  # (int64 -> the float32 of its low 32 bits)
        return ((b + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32).view(torch.float32)

    body = asm.strip()[1:-1]
    for stmt in filter(None, (x.strip() for x in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "ex2.approx.ftz.f32":
            r = f32(torch.exp2(src[0].double()))
        elif op == "max.NaN.ftz.f32":
            r = torch.where(src[0].isnan() | src[1].isnan(), float("nan"), torch.maximum(src[0], src[1]))
        elif op in ("add.rm.ftz.f32", "sub.ftz.f32"):
            r = f32(src[0].double() + (1 if op.startswith("add") else -1) * src[1].double(), rm=".rm" in op)
        elif op == "fma.rn.ftz.f32":
            r = f32(src[0].double() * src[1].double() + src[2].double())
        elif op == "mul.ftz.f32":
            r = f32(src[0].double() * src[1].double())
        elif op == "mov.b32":
            r = src[0]
        elif op == "shl.b32":
            r = from_bits(bits(src[0]) << int(args[2]))
        elif op == "add.s32":
            r = from_bits(bits(src[0]) + int(args[2]))
        else:
            raise AssertionError(f"an instruction the test does not know: {stmt}")
        regs[d] = r.expand_as(inputs[0]) if r.dim() == 0 else r
    return [regs[f"${i}"] for i in range(n_out)]


def test_exp2_on_the_fma_pipes_is_two_to_the_x():
    """fwd._exp2_asm's polynomial ``2**x`` (computed here instruction by instruction in float32): within 1e-4 of
    ``2**x`` relative over the float8 softmax's range ([-125, 8]: shifted scores are at most P_SHIFT), at most
    2**-125 below it (0 after float8's rounding), NaN from NaN; its coefficients are fwd.EXP2_CUBIC's."""
    from longattn.backends.gluon import fwd

    asm = fwd._exp2_asm(2)
    assert fwd._exp2_constraints(2) == "=f,=f,f,f" and asm.count("ex2.approx") == 1
    coef = [torch.tensor(int(h, 16), dtype=torch.int32).view(torch.float32).item()
            for h in re.findall(r"0f(3[0-9A-F]{7})", asm)]
    assert coef == pytest.approx(fwd.EXP2_CUBIC, rel=1e-7)
    x = torch.cat([torch.linspace(-125, 8, 200001), torch.tensor([-125.0, -124.5, 0.0, 1.0, 7.999, 8.0])])
    exact, poly = _run_ptx(asm, [x, x])
    want = torch.exp2(x.double())
    assert ((exact.double() - want).abs() <= 1e-6 * want).all()
    assert ((poly.double() - want).abs() <= 1e-4 * want).all(), float(((poly.double() - want) / want).abs().max())
    low = torch.tensor([-125.5, -126.0, -127.0, -150.0, -1e6, -3.4e38])
    assert (_run_ptx(asm, [low, low])[1] <= 2.0 ** -125).all()
    nan = torch.tensor([float("nan")])
    assert _run_ptx(asm, [nan, nan])[1].isnan().all()


@pytest.mark.parametrize("d, causal, window, packed, scale, fold", [
    (64, True, (-1, -1), False, 0.125, True), (64, False, (-1, -1), False, 0.125, True),
    (64, False, (256, 0), False, 0.125, True), (64, True, (-1, -1), True, 0.125, True),
    (64, True, (-1, -1), False, 2.0 ** -126, False), (64, True, (-1, -1), False, 1e-39, False),
    (128, True, (-1, -1), False, 0.125, True), (128, True, (-1, -1), True, 0.125, True),
    (128, True, (-1, -1), False, 1e-39, False), (256, True, (-1, -1), False, 0.125, False)])
def test_forward_folds_the_mask_where_it_applies(gluon_launches, d, causal, window, packed, scale, fold):
    """The launcher passes the kernel ``FOLD_MASK`` with tiles that have ``fold_mask``, unless the scale is so small
    that ``scale * log2 e`` could flush to 0 (below ``2**-125``: a masked score times 0 would give NaN, not -inf)."""
    from longattn.call import Band
    B, N, H = 2, 300, 4
    q = torch.randn(B if not packed else 1, N, H, d, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(q.shape[0], H, N)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    launch.forward(q, q, q, o, lse, None, BandArgs.of(Band.of(causal, window)), scale,
                   packed=(cu, cu) if packed else None, tiles=launch.TILES[d])
    (_, _, kw), = gluon_launches
    assert kw["FOLD_MASK"] is fold


@pytest.mark.parametrize("cap, limit, gluon", [(50.0, None, True), (64.0, None, True), (64.5, None, False),
                                               (1e4, None, False), (1e4, float("inf"), True), (30.0, 20.0, False)])
def test_large_soft_caps_plan_the_triton_kernels(cap, limit, gluon):
    """Soft-capping above the routing's ``gluon_max_softcap`` (64 by default) plans the Triton forward and the two
    Triton backward passes, whose tanh stays within float32's rounding at any cap (the Gluon ones' error grows with
    the cap); at or below it the Gluon kernels, and each plan names the reason."""
    q, k, v, _ = _inputs(n=2048, m=2048)
    call = replace(flash_call(0.1), softcap=cap)
    settings = {} if limit is None else {"gluon_max_softcap": limit}
    with routing(device=AVAILABLE, fused_bwd_min_rows={}, **settings):
        (fwd,) = planner.forward(q, k, v, call)
        bwd = planner.backward(q, k, v, q, call)[0]
    assert (fwd.chosen.kernel == planner.GLUON_FWD) == gluon, str(fwd)
    assert (bwd.chosen.kernel == planner.GLUON_FUSED_BWD) == gluon, str(bwd)
    if not gluon:
        assert "a soft-cap above" in str(fwd) and "a soft-cap above" in str(bwd)


@pytest.mark.parametrize("limit", [-1.0, float("nan"), "64", True])
def test_gluon_max_softcap_must_be_a_number_at_least_zero(limit):
    with pytest.raises(ValueError, match="gluon_max_softcap"):
        with routing(gluon_max_softcap=limit):
            pass


@pytest.mark.parametrize("n, m, band, short", [
    (2048, 2048, "causal", True), (8188, 8188, "causal", True), (8190, 8190, "causal", False),
    (4096, 4096, None, False), (1500, 1500, None, False), (1000, 9000, "causal", False),  # 8500 keys and more
    (9000, 9000, (2000, 0), True), (9000, 9000, (4096, 0), False), (9000, 9000, (1500, 2000), True)])
@pytest.mark.parametrize("d", [64, 128])
def test_short_bands_plan_their_own_tiles(n, m, band, short, d):
    """16-bit calls with a band (causal or a window) whose middle query sees fewer than ``SHORT_BAND_TILES``' keys
    plan those tiles (D=64: two consumers, 128-row tiles); calls without a band, longer spans and the head dims
    without an entry plan ``TILES``. The kernel gives the same output with either (tests/gpu)."""
    q = torch.randn(1, n, 2, d, dtype=torch.bfloat16)
    k = torch.randn(1, m, 2, d, dtype=torch.bfloat16)
    window = band if isinstance(band, tuple) else (-1, -1)
    with routing(device=AVAILABLE):
        p, = planner.forward(q, k, k, flash_call(d ** -0.5, causal=band == "causal", window=window))
    assert p.chosen.kernel == planner.GLUON_FWD
    want = launch.SHORT_BAND_TILES[d][1] if short and d in launch.SHORT_BAND_TILES else launch.TILES[d]
    assert p.chosen.option("tiles") == want
    assert launch.band_tiles(d) == launch.TILES[d]  # (no band)
    if d in launch.SHORT_BAND_TILES:
        least, tiles = launch.SHORT_BAND_TILES[d]
        assert tiles.consumers * tiles.sub_m < launch.TILES[d].consumers * launch.TILES[d].sub_m
        assert launch.band_tiles(d, least - 1) == tiles and launch.band_tiles(d, least) == launch.TILES[d]


@pytest.mark.parametrize("n, causal, mod, gluon", [
    (2048, False, "softcap", True), (2048, True, "softcap", True), (1024, True, "softcap", False),
    (4096, False, "alibi", False), (16384, True, "alibi", False)])
def test_head_dim_64_soft_capping_plans_the_gluon_forward_and_alibi_does_not(n, causal, mod, gluon):
    """At D=64 (the routing's ``min_keys``) soft-capping takes the Gluon forward as plain calls do, from 1024 keys a
    query (short bands on their own tiles); ALiBi keeps the Triton forward (slower there on the Gluon kernel)."""
    q = torch.randn(1, n, 2, 64, dtype=torch.bfloat16)
    call = replace(flash_call(0.125, causal=causal), **({"softcap": 30.0} if mod == "softcap" else
                                                        {"alibi": torch.ones(2)}))
    with routing(device=AVAILABLE):
        p, = planner.forward(q, q, q, call)
    assert (p.chosen.kernel == planner.GLUON_FWD) is gluon, p
    if mod == "alibi":
        assert any(r.reason == "ALiBi at head dim 64" for r in p.rejected), p
    elif gluon:
        assert p.chosen.option("tiles") == launch.band_tiles(64, n // 2 + 1 if causal else 0)


def test_gluon_tiles_tma_store_field():
    """``tma_store`` (the output stored by TMA from the Q buffer) is off by default, on in the routed 16-bit tiles at
    D=64 and 128 (measured there) and in no float8 tile (the kernel keeps the plain stores for float8 inputs), and
    must be a bool."""
    assert launch.GluonTiles(64, 128, 2, 240).tma_store is False
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="tma_store must be a bool"):
            launch.GluonTiles(64, 128, 2, 240, tma_store=bad)
    assert launch.TILES[64].tma_store and launch.TILES[128].tma_store and not launch.TILES[256].tma_store
    assert all(t.tma_store for _, t in launch.SHORT_BAND_TILES.values())
    fp8 = (*launch.FP8_TILES.values(), *launch.FP8_UNMASKED_TILES.values(),
           *(t for _, t in launch.FP8_LONG_CAUSAL_TILES.values()))
    assert not any(t.tma_store for t in fp8)


@pytest.mark.parametrize("kind, o_tma", [("dense", True), ("routed", True), ("plain", False), ("packed", False),
                                         ("fp8", False), ("float32_out", False), ("misaligned_out", False)])
def test_forward_stores_the_output_by_tma_only_where_it_can(gluon_launches, kind, o_tma):
    """With ``tma_store`` the launcher passes the kernel ``O_TMA`` for dense calls whose output has q's 16-bit dtype
    and TMA's alignment; packed batches, float8 inputs, another output dtype and a misaligned output keep the plain
    stores (the kernel takes O_TMA for dense 16-bit calls only), as do tiles without the flag ("plain")."""
    from longattn.call import Band
    d, N, H = 128, 300, 4
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    q = torch.randn(1 if kind == "packed" else 2, N, H, d).to(dtype)
    o_dtype = torch.float32 if kind in ("fp8", "float32_out") else torch.bfloat16
    o = torch.empty(q.numel() + 1, dtype=o_dtype)[1 if kind == "misaligned_out" else 0:][:q.numel()].view(q.shape)
    lse = torch.empty(q.shape[0], H, N)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    tiles = {"routed": launch.TILES[d], "plain": replace(launch.TILES[d], tma_store=False)}.get(
        kind, replace(launch.TILES[d], tma_store=True))
    launch.forward(q, q, q, o, lse, None, BandArgs.of(Band.of(True, (-1, -1))), d ** -0.5,
                   packed=(cu, cu) if kind == "packed" else None,
                   descale=torch.ones(3, 2, H) if kind == "fp8" else None, tiles=tiles)
    (_, _, kw), = gluon_launches
    assert kw["O_TMA"] is o_tma


def test_packed_schedule_is_a_tiles_field_and_a_routing_setting():
    """``GluonTiles.packed_schedule`` is 0 by default and in every routed tile but D=128's 16-bit ones (1, measured),
    and must be 0, 1 or 2, as the routing's ``packed_schedule`` must (or None, the tiles' own); the planner writes
    the routing's into the Gluon forward's tiles of packed launches only (a dense launch keeps the routed tiles)."""
    assert launch.GluonTiles(64, 128, 2, 240).packed_schedule == 0
    routed = (launch.TILES[64], launch.TILES[256], *launch.FP8_TILES.values(), *launch.FP8_UNMASKED_TILES.values(),
              *(t for _, t in launch.FP8_LONG_CAUSAL_TILES.values()))
    assert not any(t.packed_schedule for t in routed) and launch.TILES[128].packed_schedule == 1
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="packed_schedule"):
            launch.GluonTiles(64, 128, 2, 240, packed_schedule=bad)
        with pytest.raises(ValueError, match="packed_schedule"):
            with routing(packed_schedule=bad):
                pass
    d = 128
    cu = torch.tensor([0, 100, 100, 400], dtype=torch.int32)
    q, k = torch.randn(1, 400, 4, d, dtype=torch.bfloat16), torch.randn(1, 400, 2, d, dtype=torch.bfloat16)
    packed = AttentionCall(d ** -0.5, seqlens=SeqLens(cu, cu, 300, 300))
    for schedule in (0, 1, 2):
        with routing(device=AVAILABLE, packed_min_mean_rows=0, packed_schedule=schedule):
            (p,) = planner.forward(q, k, k.clone(), packed)
            (dense,) = planner.forward(q, k, k.clone(), AttentionCall(d ** -0.5))
        assert p.chosen.kernel == dense.chosen.kernel == planner.GLUON_FWD, (str(p), str(dense))
        assert p.chosen.option("tiles") == replace(launch.TILES[d], packed_schedule=schedule)
        assert dense.chosen.option("tiles") == launch.TILES[d]
    with routing(device=AVAILABLE):  # the routing's None: the tiles' own
        (p,) = planner.forward(q, k, k.clone(), packed)
    assert p.chosen.option("tiles") == launch.TILES[d] and p.chosen.option("tiles").packed_schedule == 1


@pytest.mark.parametrize("schedule", [0, 1, 2])
def test_packed_schedule_reaches_the_kernel_and_its_grid(gluon_launches, schedule):
    """The launcher passes the tiles' ``packed_schedule`` as ``PACKED_SCHED`` to packed launches (0 to dense ones) and
    launches one program per SM at most, or with schedule 2 one per tile: the bound on the tiles it has from the
    shapes, ``(tokens // block_m + sequences) * heads`` (those past the last return at once)."""
    from longattn.call import Band
    tiles = replace(launch.TILES[128], packed_schedule=schedule)
    band = BandArgs.of(Band.of(True, (-1, -1)))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    for batch in (1, 2):  # packed, then dense
        q = torch.randn(batch, 300, 4, 128, dtype=torch.bfloat16)
        launch.forward(q, q, q, torch.empty_like(q), torch.empty(batch, 4, 300), None, band, 0.125,
                       packed=(cu, cu) if batch == 1 else None, tiles=tiles)
    (grid, _, kw), (dense_grid, _, dense_kw) = gluon_launches
    assert kw["VARLEN"] and kw["PACKED_SCHED"] == schedule and dense_kw["PACKED_SCHED"] == 0
    assert grid == ((300 // 128 + 2) * 4,) if schedule == 2 else grid == (4,)
    assert dense_grid == (4,)


@pytest.mark.parametrize("schedule", [1, 2])
def test_packed_schedule_keeps_to_what_the_ragged_descriptor_reaches(gluon_launches, schedule):
    """Packed schedules 1 and 2 read V through one ragged descriptor (``fwd._ragged_desc``): it reaches sequences of
    up to 2**30 keys (its row bound ``fwd.RAGGED_ROWS``; rows before a longer sequence's last 2**30 would read as
    zeros) and row strides below 2**34 elements (its outer stride is 2**34 elements less the row stride). Packed K/V
    beyond either run schedule 0, whose descriptor per tile is bounded by the sequence alone (meta tensors here:
    nothing is allocated)."""
    from longattn.call import Band
    tiles = replace(launch.TILES[128], packed_schedule=schedule)
    band = BandArgs.of(Band.of(True, (-1, -1)))
    q = torch.randn(1, 300, 4, 128, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32)
    meta = dict(dtype=torch.bfloat16, device="meta")
    values = {  # V (K alike) -> the schedule launched
        torch.empty(1, 1 << 30, 1, 128, **meta): schedule,  # one sequence of 2**30 keys: reached
        torch.empty(1, (1 << 30) + 1, 1, 128, **meta): 0,
        torch.empty_strided((1, 300, 1, 128), (300 << 33, 1 << 33, 128, 1), **meta): schedule,
        torch.empty_strided((1, 300, 1, 128), (300 << 34, 1 << 34, 128, 1), **meta): 0,
    }
    for v in values:
        cu_k = torch.tensor([0, 100, v.shape[1]], dtype=torch.int64)
        launch.forward(q, v, v, torch.empty_like(q), torch.empty(1, 4, 300), None, band, 0.125, packed=(cu_q, cu_k),
                       tiles=tiles)
    assert [kw["PACKED_SCHED"] for _, _, kw in gluon_launches] == list(values.values())
    # (the launcher's bound is the kernel's)
    assert launch._RAGGED_ROWS == pytest.importorskip("longattn.backends.gluon.fwd").RAGGED_ROWS.value


def test_wide_backward_host_descriptors_read_bnhd_tensors_as_bhnd_boxes():
    """``bwd_wide_tile.host_descriptors_of`` (the ``host_descriptors`` schedule): q, k, v, dO ``(B, N, H, D)`` read
    as ``(B, H, N, D)`` with the tensors' own strides (a strided view too), boxes of one batch row and head, as the
    device-side descriptors the kernel otherwise makes."""
    from longattn.backends.gluon import bwd_wide_tile as W
    B, N, M, H, Hk, D = 2, 300, 257, 4, 2, 64
    q = torch.randn(B, H, N, D, dtype=torch.bfloat16).transpose(1, 2)  # (B, N, H, D), heads outermost in memory
    k = torch.randn(B, M, Hk, D, dtype=torch.bfloat16)
    n_pad = 384
    stats = torch.zeros(B * H * 2, n_pad)
    dq32 = torch.zeros(B, N, H, D)
    qd, kd, vd, dod, sd, dqd = W.host_descriptors_of(q, k, k, q, stats, dq32)
    assert list(qd.shape) == [B, H, N, D] and list(qd.strides) == [H * N * D, N * D, D, 1]
    assert list(qd.block_shape) == [1, 1, W.BLOCK_M, D] and list(dod.block_shape) == [1, 1, W.BLOCK_M, D]
    assert list(kd.shape) == [B, Hk, M, D] and list(kd.strides) == [M * Hk * D, D, Hk * D, 1]
    assert list(kd.block_shape) == [1, 1, W.SUB_N, D] and vd.base is k
    assert list(sd.shape) == [B * H * 2, n_pad] and list(sd.block_shape) == [2, W.BLOCK_M]
    assert list(dqd.shape) == [B, H, N, D] and list(dqd.block_shape) == [1, 1, W.BLOCK_M // 2, D]
    assert dqd.base.dtype == torch.float32


def test_wide_backward_host_descriptors_give_a_length_one_dim_an_aligned_stride():
    """A batch of one whose batch stride is no 16-byte multiple (never read) gets the device path's stand-in stride,
    not an assertion from the descriptor (found by review)."""
    from longattn.backends.gluon import bwd_wide_tile as W
    q = torch.randn(5 * 4 * 64, dtype=torch.bfloat16).as_strided((1, 5, 4, 64), (7, 256, 64, 1))
    stats, dq32 = torch.zeros(8, 128), torch.zeros(1, 5, 4, 64)
    qd = W.host_descriptors_of(q, q, q, q, stats, dq32)[0]
    assert list(qd.strides) == [64, 64, 256, 1]


@pytest.mark.parametrize("d, dkv_tma", [(128, True), (128, False), (64, False)])
def test_fused_backward_host_descriptors_match_the_kernels_boxes(d, dkv_tma):
    """``bwd_fused.host_descriptors_of`` (``fused_backward(..., host_descriptors=True)``): the boxes the fused
    kernel's programs otherwise build (Q/dO ``BLOCK_M`` rows, K/V ``SUB_N``, dQ half of D with ``SPLIT_DQ``, dK/dV
    ``SUB_N`` rows by all of D, the statistics 2 x ``BLOCK_M``); DK and DV stay the tensors (plain stores use them)."""
    from longattn.backends.gluon import bwd_fused as F
    B, N, M, H, Hk = 2, 200, 333, 4, 2
    block_m, sub_n = F.TILES[d]
    q = torch.randn(B, N, H, d, dtype=torch.bfloat16)
    k = torch.randn(B, M, Hk, d, dtype=torch.bfloat16)
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    stats, dq = torch.zeros(B * H * 2, 256), torch.zeros(B, N, H, d)
    qd, kd, vd, dod, sd, dqd, dk_arg, dv_arg, dkd, dvd = F.host_descriptors_of(q, k, k, q, stats, dq, dk, dv, dkv_tma)
    assert list(qd.block_shape) == [1, 1, block_m, d] and list(kd.block_shape) == [1, 1, sub_n, d]
    assert list(sd.block_shape) == [2, block_m] and list(sd.shape) == [B * H * 2, 256]
    assert list(dqd.block_shape) == [1, 1, block_m, d // 2 if F.SPLIT_DQ[d] else d]
    assert dk_arg is dk and dv_arg is dv
    if dkv_tma:
        assert list(dkd.shape) == [B, Hk, M, d] and list(dkd.block_shape) == [1, 1, sub_n, d] and dvd.base is dv
    else:
        assert dkd is dk and dvd is dv
