"""Forwards and the two Triton backward passes replayed from a recording (:mod:`longattn.backends.replay`): a
signature's second and later calls launch the recorded kernels with their own tensors, and give the reference's
outputs, log-sum-exps and gradients."""
import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.backends import replay
from longattn.backends.triton import entry

TOL = 2e-5
SLOPES = torch.tensor([0.5, 0.2, 0.1, 0.05])


def _grads(fn, q, k, v, do):
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    fn(qg, kg, vg).backward(do)
    return qg.grad, kg.grad, vg.grad


def _close(got, want):
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        err = (g.double() - w).abs().max().item()
        assert err <= TOL * (1 + w.abs().max().item()), err


def _inputs(seed, b, n, m, hq, hk, d):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for s, h in ((n, hq), (m, hk), (m, hk), (n, hq))]


CASES = {
    "causal_gqa": (dict(b=2, n=37, m=53, hq=4, hk=2, d=32),
                   lambda a, b, c, **kw: longattn.flash_attention(a, b, c, causal=True, **kw),
                   lambda a, b, c, **kw: ref.flash_attention(a, b, c, causal=True, **kw)),
    "window_softcap_alibi": (dict(b=1, n=45, m=45, hq=2, hk=2, d=24),
                             lambda a, b, c, **kw: longattn.flash_attention(
                                 a, b, c, window=(7, 3), softcap=5.0, alibi_slopes=torch.tensor([0.3, 0.1]), **kw),
                             lambda a, b, c, **kw: ref.flash_attention(a, b, c, window=(7, 3), softcap=5.0,
                                                                       alibi_slopes=torch.tensor([0.3, 0.1]), **kw)),
    "alibi_per_head_batch_of_two": (  # (Hq,) slopes for two batch rows: the kernels read a (B, Hq) copy
        dict(b=2, n=33, m=47, hq=4, hk=2, d=16),
        lambda a, b, c, **kw: longattn.flash_attention(a, b, c, causal=True, alibi_slopes=SLOPES, **kw),
        lambda a, b, c, **kw: ref.flash_attention(a, b, c, causal=True, alibi_slopes=SLOPES, **kw)),
    "dilated": (dict(b=1, n=50, m=50, hq=6, hk=2, d=16),
                lambda a, b, c, **kw: longattn.dilated_attention(a, b, c, segment_lengths=(16, 32),
                                                                 dilation_rates=(1, 3), head_split=True, **kw),
                lambda a, b, c, **kw: ref.dilated_attention(a, b, c, segment_lengths=(16, 32), dilation_rates=(1, 3),
                                                            head_split=True, **kw)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_signatures_later_calls_replay_its_launches_and_stay_exact(case):
    """The first call of a signature records its two passes (a replay kept), the next ones with other values
    replay them: each call's gradients are its own reference's."""
    shape, fn, ref_fn = CASES[case]
    entry._BACKWARD.clear()
    for seed in range(3):
        q, k, v, do = _inputs(seed, **shape)
        got = _grads(lambda a, b, c: fn(a, b, c, backend="triton"), q, k, v, do)
        want = _grads(ref_fn, *(x.double() for x in (q, k, v)), do.double())
        _close(got, want)
        kept = [r for r in entry._BACKWARD.values() if r]
        assert len(kept) == 1, (seed, entry._BACKWARD.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_signatures_later_forwards_replay_their_launches_and_stay_exact(case):
    """The first forward of a signature (no autograd graph) records its launches, the next ones with other values
    replay them: each call's output and log-sum-exp are its own reference's (a dilated call's first branch covers
    not every head: its output starts zeroed, its log-sum-exp at -inf)."""
    shape, fn, ref_fn = CASES[case]
    entry._FORWARD.clear()
    for seed in range(3):
        q, k, v, _ = _inputs(seed, **shape)
        out, lse = fn(q, k, v, backend="triton", return_lse=True)
        want, want_lse = ref_fn(*(x.double() for x in (q, k, v)), return_lse=True)
        _close((out,), (want,))
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        _close((lse[finite],), (want_lse[finite],))
        assert len([r for r in entry._FORWARD.values() if r]) == 1, (seed, entry._FORWARD.values())


def test_a_replay_keys_which_inputs_are_one_tensor():
    """A signature first met with one tensor as q, k and v (self-attention on ``x``), then with three tensors: the
    second call is not given the first one's recording (which would read q for k and v), and is exact."""
    entry._BACKWARD.clear()
    x, k, v, do = _inputs(5, 1, 40, 40, 2, 2, 16)
    xg = x.clone().requires_grad_()
    longattn.flash_attention(xg, xg, xg, causal=True, backend="triton").backward(do)
    x64 = x.double().requires_grad_()
    ref.flash_attention(x64, x64, x64, causal=True).backward(do.double())
    _close((xg.grad,), (x64.grad,))
    got = _grads(lambda a, b, c: longattn.flash_attention(a, b, c, causal=True, backend="triton"), x, k, v, do)
    want = _grads(lambda a, b, c: ref.flash_attention(a, b, c, causal=True), x.double(), k.double(), v.double(),
                  do.double())
    _close(got, want)
    assert len([r for r in entry._BACKWARD.values() if r]) == 2


def test_a_recording_with_a_tensor_it_cannot_name_is_not_replayed():
    """A launch argument that is none of the named tensors (made inside the recorded code) makes the recording
    unusable, and a plain value of an unknown type too."""
    named, other = torch.zeros(3), torch.zeros(3)
    with replay.recording() as rec:
        replay.note(replay.JitLaunch(None, {}), (1,), (named, 4, 2.0, None))
    assert replay.Replay.of(rec, (named,)) is not None
    with replay.recording() as rec:
        replay.note(replay.JitLaunch(None, {}), (1,), (named, other))
    assert replay.Replay.of(rec, (named,)) is None
    with replay.recording() as rec:
        replay.note(replay.JitLaunch(None, {}), (1,), (named, (1, 2)))
    assert replay.Replay.of(rec, (named,)) is None
    with replay.recording() as rec:
        replay.note(replay.JitLaunch(None, dict(OUT=other, BLOCK=64)), (1,), (named,))
    assert replay.Replay.of(rec, (named, other)) is None  # (a tensor by keyword would never be substituted)
    assert replay.aliasing((named, other, named)) == (0, 1, 0)
    assert not replay.active()


def test_a_host_descriptor_is_replayed_over_the_slots_tensor():
    """A host-side TMA descriptor of a named tensor is replayed as a copy over the slot's tensor (shape, strides,
    box and layout as recorded; the recorded one untouched); one over an unnamed tensor makes the recording
    unusable."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from longattn.backends.gluon.bwd_fused import BOX16
    from longattn.backends.gluon.tma import bhnd_descriptor

    class Launcher:
        def __init__(self):
            self.args = []

        def on(self, grid, *args):
            self.args.append(args)

    t, other = torch.zeros(2, 64, 3, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 3, 64, dtype=torch.bfloat16)
    desc, launcher = bhnd_descriptor(t, 32, BOX16), Launcher()
    with replay.recording() as rec:
        replay.note(launcher, (1,), (t, desc, 7))
    fresh = torch.ones_like(t)
    replay.Replay.of(rec, (t,)).run((fresh,))
    got_t, got_desc, seven = launcher.args[0]
    assert got_t is fresh and got_desc.base is fresh and desc.base is t and seven == 7
    assert (got_desc.shape, got_desc.strides, got_desc.block_shape, got_desc.layout) == (
        desc.shape, desc.strides, desc.block_shape, desc.layout)
    with replay.recording() as rec:
        replay.note(launcher, (1,), (t, bhnd_descriptor(other, 32, BOX16)))
    assert replay.Replay.of(rec, (t,)) is None
    with replay.recording() as rec:
        replay.note(replay.JitLaunch(None, dict(DESC=desc)), (1,), (t,))
    assert replay.Replay.of(rec, (t,)) is None  # (a descriptor by keyword would never be substituted)
    assert set(vars(desc)) <= replay._DESCRIPTOR_FIELDS  # (this Triton's fields: all of them known)
    unknown = bhnd_descriptor(t, 32, BOX16)
    unknown.encoded = object()  # (a field a later Triton could add, made from the base: a copy would carry it)
    with replay.recording() as rec:
        replay.note(launcher, (1,), (t, unknown))
    assert replay.Replay.of(rec, (t,)) is None


def test_a_replay_holds_no_tensor_of_the_recorded_call():
    """A replay keeps none of the recorded call's tensors alive, its descriptors' included (a training loop keeps
    a replay per shape: each would otherwise hold that call's inputs and buffers)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    import gc
    import weakref

    from longattn.backends.gluon.bwd_fused import BOX16
    from longattn.backends.gluon.tma import bhnd_descriptor

    t = torch.zeros(2, 64, 3, 64, dtype=torch.bfloat16)
    alive = weakref.ref(t)
    with replay.recording() as rec:
        replay.note(replay.JitLaunch(None, {}), (1,), (t, bhnd_descriptor(t, 32, BOX16), 5))
    kept = replay.Replay.of(rec, (t,))
    del rec, t
    gc.collect()
    assert kept is not None and alive() is None


def test_the_fused_backward_is_recorded_and_replayed_into_fresh_buffers(stubbed_sm90, monkeypatch):
    """Planned as on an sm_90 GPU with the launches stubbed (:func:`stubbed_sm90`): a signature's first backward
    records the fused kernel's two launches with its own workspace; the next call, on new tensors, launches the same
    kernels with those tensors in the recorded ones' places and a fresh workspace, without the kernel's entry."""
    from longattn.backends.gluon import bwd_fused

    launched = stubbed_sm90
    entered = []
    real_entry = bwd_fused.fused_backward
    monkeypatch.setattr(bwd_fused, "fused_backward", lambda *a, **kw: entered.append(1) or real_entry(*a, **kw))
    gradients, backwards = [], []
    for seed in range(2):
        q, k, v, do = _inputs(seed, 1, 70, 70, 4, 2, 128)
        qg, kg, vg = (x.bfloat16().requires_grad_() for x in (q, k, v))
        with longattn.routing(fused_bwd_min_rows={}):  # (a short call: the fused backward takes it too)
            out = longattn.flash_attention(qg, kg, vg, causal=True, backend="triton")
            launched.clear()
            out.backward(do.bfloat16())
        gradients.append(qg.grad)
        backwards.append(list(launched))
    first, again = backwards
    assert len(entered) == 1 and [name for name, _, _ in first] == ["_row_stats", "flash_bwd_fused"]
    assert [(name, grid) for name, grid, _ in again] == [(name, grid) for name, grid, _ in first]
    for (_, _, was), (_, _, now) in zip(first, again):
        assert len(was) == len(now)
        for a, b in zip(was, now):
            if isinstance(getattr(a, "base", None), torch.Tensor):  # (a host-made descriptor: over a new tensor)
                a, b = (a.base, a.shape, a.strides, a.block_shape), (b.base, b.shape, b.strides, b.block_shape)
                assert b[0] is not a[0] and b[0].shape == a[0].shape and b[1:] == a[1:]
            elif isinstance(a, torch.Tensor):  # every tensor a new one of the same shape: the call's own, or fresh
                assert b is not a and b.shape == a.shape and b.dtype == a.dtype
            else:
                assert a == b
    assert gradients[1] is not gradients[0]


def test_a_replay_is_keyed_by_the_descriptor_switch(monkeypatch):
    """``LONGATTN_TMA`` is read at each launch, so a signature recorded under one value is not replayed under another
    (the switch keeps working at run time); where the routing decides (``routing(tma=...)``) it is not read."""
    from longattn.backends.triton import planner
    from longattn.call import flash_call
    q, k, v, _ = _inputs(0, 1, 8, 8, 2, 2, 16)
    keys = {}
    for value in ("0", "1"):
        monkeypatch.setenv("LONGATTN_TMA", value)
        keys[value] = planner.forward_key(q, k, v, flash_call(0.25, True))
        with longattn.routing(tma=True):
            keys[value, "routed"] = planner.forward_key(q, k, v, flash_call(0.25, True))
    assert keys["0"] != keys["1"] and keys["0", "routed"] == keys["1", "routed"]


def test_a_call_that_returns_no_lse_takes_no_lse_gradient(monkeypatch):
    """``need_lse=False`` (the caller never reads the log-sum-exp): a gradient arriving for it (zeros, as
    ``torch.compile`` materialises them) is not passed on, so the backward keeps its replay and kernels."""
    from longattn.call import flash_call
    seen = []
    real = entry.backward
    monkeypatch.setattr(entry, "backward", lambda *a, **kw: seen.append(a[7] if len(a) > 7 else None) or real(*a, **kw))
    q, k, v, _ = _inputs(0, 1, 12, 12, 2, 2, 16)
    for need in (False, True):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = entry.attention(qg, kg, vg, flash_call(0.25, True, need_lse=need))
        (o.sum() + 0 * lse.sum()).backward()
    assert seen[0] is None and seen[1] is not None


def test_routing_replay_false_builds_every_call_anew():
    """``routing(replay=False)``: nothing is recorded or replayed, the results as with replays."""
    q, k, v, do = _inputs(3, 1, 20, 20, 2, 2, 16)
    entry._FORWARD.clear()
    entry._BACKWARD.clear()
    with longattn.routing(replay=False):
        off = [_grads(lambda a, b, c: longattn.flash_attention(a, b, c, causal=True, backend="triton"), q, k, v, do)
               for _ in range(2)]
    assert entry._FORWARD.values() == [] and entry._BACKWARD.values() == []
    on = [_grads(lambda a, b, c: longattn.flash_attention(a, b, c, causal=True, backend="triton"), q, k, v, do)
          for _ in range(2)]
    assert len(entry._FORWARD.values()) == 1 and len(entry._BACKWARD.values()) == 1
    for got in (*off, on[1]):
        for g, w in zip(got, on[0]):
            assert torch.equal(g, w)
    with pytest.raises(TypeError, match="replay must be True or False"):
        longattn.routing(replay=1).__enter__()


@pytest.fixture
def stubbed_sm90(monkeypatch):
    """Calls planned as on an sm_90 GPU (Gluon forward, fused and 128 x 128 backwards) with every launch stubbed:
    noted for recordings and kept in the returned list as ``(kernel name, grid, args)``, never run (CPU tensors,
    no interpreter: what is compared is the host path alone)."""
    import types

    from longattn.backends.device import Device
    from longattn.backends.gluon import bwd_fused, bwd_wide_tile
    from longattn.backends.gluon import launch as gluon_launch
    from longattn.backends.triton import launch as triton_launch

    launched = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def on(self, grid, *args):
            launched.append((self.name, grid, args))

    def launch(fn, grid, *args, **kwargs):
        name = getattr(fn, "__name__", None) or type(fn).__name__
        launched.append((name, grid, args))
        replay.note(Stub(name), grid, args)

    def flash_fwd():  # (a name for the Gluon forward's stub)
        pass

    for module in (gluon_launch, bwd_fused, bwd_wide_tile, triton_launch):
        monkeypatch.setattr(module, "launch", launch)
    monkeypatch.setattr(gluon_launch, "kernel_module", lambda: types.SimpleNamespace(flash_fwd=flash_fwd))
    monkeypatch.setattr(gluon_launch, "device_index", lambda device: 0)
    monkeypatch.setattr(gluon_launch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(bwd_fused._device, "sm_count", lambda device: 132)
    for module in (bwd_fused, bwd_wide_tile):
        monkeypatch.setattr(module, "_check", lambda *a: None, raising=False)
    monkeypatch.setattr("longattn.backends.gluon.bwd_fused._check", lambda *a: None)
    monkeypatch.setattr("longattn.backends.dispatch.triton_support.unsupported_reason", lambda *a, **kw: None)
    monkeypatch.delenv("LONGATTN_GLUON", raising=False)
    entry._FORWARD.clear()
    entry._BACKWARD.clear()
    with longattn.routing(device=Device(capability=(9, 0), interpret=False, gluon=True)):
        yield launched


def _packed(causal):
    cu = torch.tensor([0, 100, 1000, 1001, 1777, 2048], dtype=torch.int32)

    def fn(q, k, v):
        return longattn.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                               backend="triton")[None]
    return (1, 2048, 2048, 8, 2, 128), fn


def _routed_deterministic(q, k, v):
    with longattn.routing(deterministic_bwd_head_dims=(128,)):  # (the fused backward with dQ in a fixed order)
        return longattn.flash_attention(q, k, v, causal=True, deterministic=True, backend="triton")


STUBBED = {  # (B, N, M, Hq, Hk, D), fn: calls the sm_90 plan runs on the Gluon kernels
    "dense_causal_fused": ((2, 1024, 1024, 8, 2, 128),
                           lambda q, k, v: longattn.flash_attention(q, k, v, causal=True, backend="triton")),
    "dense_wide_d64": ((2, 1100, 1100, 4, 4, 64), lambda q, k, v: longattn.flash_attention(q, k, v, backend="triton")),
    "window_alibi": ((2, 1500, 1500, 4, 2, 128), lambda q, k, v: longattn.flash_attention(
        q, k, v, window=(1100, 5), alibi_slopes=torch.tensor([0.5, 0.2, 0.1, 0.05]), backend="triton")),
    "deterministic": ((1, 1024, 1024, 4, 4, 128), lambda q, k, v: _routed_deterministic(q, k, v)),
    "packed_causal": _packed(True),
    "packed_full": _packed(False),
}


@pytest.mark.parametrize("case", sorted(STUBBED))
def test_replayed_launches_are_the_launches_the_call_would_build(case, stubbed_sm90, monkeypatch):
    """On the sm_90 plan (launches stubbed): a signature's later call, replayed, makes the launches the same call
    makes with replays off: the same kernels, grids and plain arguments, the call's own tensors where it passes
    them, and fresh tensors of the same shape and dtype elsewhere (int32 tables with the same values)."""
    (B, N, M, Hq, Hk, D), fn = STUBBED[case]
    launched = stubbed_sm90
    returned = []  # the gradients the backend's backward returns (their memory names the buffers written)
    real_backward = entry.backward

    def backward(*args, **kwargs):
        grads = real_backward(*args, **kwargs)
        returned.extend(grads)
        return grads
    monkeypatch.setattr(entry, "backward", backward)
    g = torch.Generator().manual_seed(0)
    calls = [[torch.randn(B, n, h, D, generator=g, dtype=torch.bfloat16) for n, h in ((N, Hq), (M, Hk), (M, Hk))]
             for _ in range(2)]

    def step(q, k, v, **routing):
        """The launches of one forward+backward, each tensor argument named by its role where it has one (an
        input, or the memory of a returned gradient), else by its shape, strides and dtype (and int tables by
        their values)."""
        launched.clear()
        returned.clear()
        with longattn.routing(**routing):
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            fn(qg, kg, vg).backward(torch.ones(B, N, Hq, D, dtype=torch.bfloat16))
        roles = {t.data_ptr(): name
                 for name, t in (("q", qg), ("k", kg), ("v", vg), *zip(("dq", "dk", "dv"), returned))}

        def named(a):
            if isinstance(getattr(a, "base", None), torch.Tensor):  # (a host-made TMA descriptor)
                return named(a.base), a.shape, a.strides, a.block_shape, repr(a.layout)
            if not isinstance(a, torch.Tensor):
                return a
            if a.data_ptr() in roles and a.numel():
                return roles[a.data_ptr()], a.shape, a.stride()
            return (a.shape, a.stride(), a.dtype, None if a.is_floating_point() else a.tolist())
        return [(name, grid, [named(a) for a in args]) for name, grid, args in launched]

    step(*calls[0])  # records
    replayed = step(*calls[1])
    kept = [type(r).__name__ for r in (*entry._FORWARD.values(), *entry._BACKWARD.values()) if r]
    built = step(*calls[1], replay=False)
    assert [(n, grid) for n, grid, _ in replayed] == [(n, grid) for n, grid, _ in built]
    for (name, _, got), (_, _, want) in zip(replayed, built):
        assert len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want)):
            assert a == b or (a != a and b != b), (name, i, a, b)
    assert sorted(kept) == REPLAYS[case], kept


REPLAYS = {  # the replays each case keeps
    "dense_causal_fused": ["_ForwardReplay", "_GluonReplay"], "dense_wide_d64": ["_ForwardReplay", "_GluonReplay"],
    "window_alibi": ["_ForwardReplay", "_GluonReplay"], "deterministic": ["_ForwardReplay", "_GluonReplay"],
    "packed_causal": ["_ForwardReplay", "_GluonReplay"], "packed_full": ["_ForwardReplay", "_GluonReplay"],
}
