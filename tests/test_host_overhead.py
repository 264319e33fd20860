"""The host-time shortcuts of a small call (the common case checked cheaply, facts read once) give what the long way
gives: the same values, the same errors. No timing here: what they save is measured, not asserted."""
import math

import pytest
import torch

import longattn
from longattn import _fp8
from longattn import _validation as V
from longattn.backends import IMPLS, backend_module, fa4


def _slow_window(window):
    """check_window's long way (what it computed before its shortcut)."""
    left, right = window
    for x in (left, right):
        if not V._is_int(x):
            raise TypeError
        if x < -1:
            raise ValueError
    return tuple(-1 if int(x) >= V._UNBOUNDED_WINDOW else int(x) for x in (left, right))


@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (5, -1), (-1, 3), (2 ** 62 - 1, 1), (2 ** 62, 4), (3, 2 ** 70),
                                    [4, 5], (-2, 1), (1, -2), (True, 1), (1.0, 2), (2, None)])
def test_check_window_shortcut_answers_as_the_long_way(window):
    try:
        want = _slow_window(window)
    except (TypeError, ValueError) as e:
        with pytest.raises(type(e)):
            V.check_window(window, "f")
    else:
        got = V.check_window(window, "f")
        assert got == want and type(got) is tuple and all(type(x) is int for x in got)


@pytest.mark.parametrize("softcap", [0.0, -0.0, 1.5, 30.0, 2, 0, math.inf, -math.inf, math.nan, -1.0, True, "1", None,
                                     1e-30, 1e30, 1e-31, 1e31, 3e38, 10 ** 40])
def test_check_softcap_shortcut_answers_as_the_long_way(softcap):
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        with pytest.raises(TypeError, match="softcap must be a number"):
            V.check_softcap(softcap, "f")
    elif not math.isfinite(softcap) or softcap < 0:
        with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
            V.check_softcap(softcap, "f")
    elif softcap and not V.SOFTCAP_RANGE[0] <= softcap <= V.SOFTCAP_RANGE[1]:
        with pytest.raises(ValueError, match="softcap must be 0 \\(off\\) or between"):
            V.check_softcap(softcap, "f")
    else:
        got = V.check_softcap(softcap, "f")
        assert type(got) is float and got == softcap and math.copysign(1, got) == math.copysign(1, softcap)


def test_fp8_check_without_fp8_arguments():
    q = torch.randn(1, 4, 2, 8)
    assert _fp8.check(q, q, q, (None, None, None), None, batch=1, fn="f") == (None, None)
    with pytest.raises(ValueError, match=r"^f: k_descale, out_dtype apply to float8_e4m3fn inputs only"):
        _fp8.check(q, q, q, (None, torch.ones(1), None), torch.bfloat16, batch=1, fn="f")
    with pytest.raises(ValueError, match=r"^f: out_dtype apply to float8_e4m3fn inputs only"):
        _fp8.check(q, q, q, (None, None, None), torch.float16, batch=1, fn="f")


def test_backend_module_is_the_same_module_every_time():
    for impl in ("torch", "sdpa", "fa4"):
        assert backend_module(impl) is backend_module(impl)
        assert backend_module(impl).__name__ == f"longattn.backends.{impl}"
    for bad in ("cuda", "", ["torch"], None):
        with pytest.raises(ValueError, match=rf"unknown backend implementation .*expected one of {IMPLS!r}".replace(
                "(", r"\(").replace(")", r"\)")):
            backend_module(bad)


def test_fa4_reads_a_devices_capability_once(monkeypatch):
    """backends.device.capability, which FA4's checks and the dispatch table read, asks the driver once per device
    index."""
    from longattn.backends import device
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, 0))
    device._CAPABILITY.clear()
    try:
        assert device.capability(torch.device("cuda", 3)) == (9, 0)
        assert device.capability(torch.device("cuda", 3)) == (9, 0)
        assert asked == [3]
    finally:
        device._CAPABILITY.clear()  # (no made-up capability outlives the test)


def test_a_compiled_call_traces_no_lru_cache():
    """``torch.compile`` of a call (flash and KV-cache decode) traces no ``functools.lru_cache`` on the dispatch
    path: Dynamo warns of "silent incorrectness" at each one it traces through, which every user's first compiled
    call printed (``backends.device``'s memos of the driver's answers and of Triton's import). Dynamo warns once a
    process per message: its record of those seen is emptied first."""
    import warnings

    from torch._dynamo.utils import warn_once_cache

    warn_once_cache.difference_update({m for m in warn_once_cache if "lru_cache" in m})
    torch._dynamo.reset()
    q = torch.randn(1, 8, 2, 16)
    cache = torch.zeros(1, 16, 2, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        flash = torch.compile(lambda q: longattn.flash_attention(q, q, q, causal=True), backend="eager")
        decode = torch.compile(lambda q: longattn.flash_attention_with_kvcache(q[:, :1], cache, cache,
                                                                              cache_seqlens=4), backend="eager")
        torch.testing.assert_close(flash(q), longattn.flash_attention(q, q, q, causal=True))
        assert decode(q).shape == (1, 1, 2, 16)
    assert not [str(w.message) for w in seen if "lru_cache" in str(w.message)]


def test_a_compiled_call_is_compiled_once_when_its_trace_fills_the_device_memos():
    """The first compiled call of a process reads the driver's answers and Triton's import (``backends.device``'s
    memos) while Dynamo traces it: the trace takes them as constants and guards on no memo, so its second call runs
    the graph made by the first instead of compiling again (a guard on the memo's keys failed once it held them)."""
    from torch._dynamo.utils import counters

    from longattn.backends import device
    for memo in (device._CAPABILITY, device._SM_COUNT, device._TRITON):
        memo.clear()  # (as in a fresh process: the first traced call fills them)
    torch._dynamo.reset()
    counters.clear()
    flash = torch.compile(lambda q: longattn.flash_attention(q, q, q, causal=True), backend="eager")
    for _ in range(3):
        q = torch.randn(1, 8, 2, 16)
        torch.testing.assert_close(flash(q), longattn.flash_attention(q, q, q, causal=True))
    assert counters["stats"]["unique_graphs"] == 1
    assert device._TRITON  # (the memo was filled, by the trace or the eager call)


def test_fa4_on_cpu_tensors_enters_no_cuda_device(monkeypatch):
    """The device context is entered only for inputs on another CUDA device than the current one."""
    from types import SimpleNamespace

    def no_device(*a):
        raise AssertionError("torch.cuda.device entered")

    def func(q, k, v, **kw):
        return q * 1, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(torch.cuda, "device", no_device)
    monkeypatch.setattr(fa4, "_module", lambda: SimpleNamespace(flash_attn_func=func, flash_attn_varlen_func=func))
    monkeypatch.setattr(fa4, "device_reason", lambda q: None)
    q = torch.randn(1, 8, 2, 8, dtype=torch.bfloat16)
    assert torch.equal(longattn.flash_attention(q, q, q, causal=True, backend="fa4"), q)


def test_a_calls_backend_is_chosen_once_per_signature_on_cuda_tensors(monkeypatch):
    """runner's choice of a backend is made once per choice key and then found (CUDA tensors: faked here by
    ``is_cuda``); every field the choice reads gives another key; calls off CUDA, explicit dilated/ALiBi/FP8 calls and
    tracing choose every time."""
    from dataclasses import replace

    from longattn import runner
    from longattn.backends import dispatch
    from longattn.call import Descale, SeqLens, flash_call

    made = []
    monkeypatch.setattr(runner, "_choose_now", lambda *a: made.append(a) or "sdpa")
    monkeypatch.setattr(runner, "CHOICES", runner.Kept(16))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    call = flash_call(0.25, True)
    sdpa = dispatch.SdpaCall(True, True, False)
    for _ in range(3):
        assert runner._choose("auto", q, call, "f", sdpa, k, v) == "sdpa"
    assert len(made) == 1
    base = runner.choice_key("auto", q, call, sdpa, k, v)
    i32 = torch.zeros(3, dtype=torch.int32)
    qg = q.detach().requires_grad_()
    others = [runner.choice_key(*args) for args in [
        ("fa4", q, call, sdpa, k, v), ("auto", q.half(), call, sdpa, k.half(), v.half()),
        ("auto", q[..., :8], call, sdpa, k[..., :8], v[..., :8]), ("auto", q, call, sdpa, k[:, :5], v[:, :5]),
        ("auto", q, call, sdpa, None, None), ("auto", qg, call, sdpa, k, v), ("auto", q, flash_call(0.25, False), sdpa, k, v), ("auto", q, flash_call(0.25, True, (3, 0)), sdpa, k, v),
        ("auto", q, replace(call, deterministic=True), sdpa, k, v), ("auto", q, replace(call, softcap=5.0), sdpa, k, v),
        ("auto", q, replace(call, sinks=torch.zeros(4)), sdpa, k, v),
        ("auto", q, replace(call, seqlens=SeqLens(i32, i32, 4, 4)), sdpa, k, v),
        ("auto", q, replace(call, out_dtype=torch.float32), sdpa, k, v), ("auto", q, call, None, k, v)]]
    assert None not in others and len(set(others + [base])) == len(others) + 1
    with torch.no_grad():  # grad mode is read, not the tensors' flag alone
        assert runner.choice_key("auto", qg, call, sdpa, k, v) == base
    for uncached in (replace(call, alibi=torch.zeros(1, 4)), replace(call, descale=Descale(torch.ones(3, 1, 2)))):
        assert runner.choice_key("auto", q, uncached, sdpa, k, v) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert runner.choice_key("auto", q, call, sdpa, k, v) is None
    monkeypatch.undo()
    assert runner.choice_key("auto", torch.randn(1, 8, 4, 16), call, sdpa, k, v) is None  # a CPU tensor


def test_every_field_of_a_call_is_in_the_choice_key_or_keeps_the_call_out_of_the_cache():
    """A field added to AttentionCall fails here until it is classified: read by the choice of a backend (then in
    runner.choice_key), a reason to choose every time (choice_key gives None), or not read by the choice."""
    import dataclasses

    from longattn.call import AttentionCall
    keyed = {"causal", "window", "deterministic", "softcap", "sinks", "seqlens", "out_dtype"}
    uncached = {"branches", "blocks", "cache", "descale", "alibi"}
    unread = {"scale", "alibi_offset", "need_lse"}  # (the offset goes with ALiBi; FA4 computes the lse either way)
    assert keyed | uncached | unread == {f.name for f in dataclasses.fields(AttentionCall)}


@pytest.fixture
def known_calls(monkeypatch):
    """Plain ``flash_attention`` calls on (faked) CUDA tensors, the backend chosen being the PyTorch one: a fresh
    ``runner.KNOWN``; returns the list of the calls that took the long way (checked, described, then
    ``runner.run``)."""
    from longattn import runner
    checked = []
    real = runner.run
    monkeypatch.setattr(runner, "_choose_now", lambda *a: "torch")
    monkeypatch.setattr(runner, "KNOWN", runner.Kept(64))
    monkeypatch.setattr(runner, "CHOICES", runner.Kept(64))
    monkeypatch.setattr(runner, "run", lambda *a, **kw: checked.append(a) or real(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return checked


def test_a_known_plain_call_is_checked_once_and_gives_what_the_long_way_gives(known_calls):
    from longattn.reference import flash_attention as reference
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    for _ in range(3):
        out, lse = longattn.flash_attention(q, k, v, causal=True, return_lse=True)
        want, want_lse = reference(q, k, v, causal=True, return_lse=True)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
    assert len(known_calls) == 1
    q2 = torch.randn(2, 9, 4, 8, generator=g, dtype=torch.float64)  # other values, the same signature: not checked
    torch.testing.assert_close(longattn.flash_attention(q2, k, v, causal=True, return_lse=True)[0],
                               reference(q2, k, v, causal=True))
    assert len(known_calls) == 1


def test_every_part_of_a_plain_calls_signature_gives_another_key(known_calls):
    from longattn import runner
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    opts = (True, (-1, -1), None, False, "auto", False)

    def key(q=q, k=k, v=v, opts=opts):
        return runner.known_key("flash_attention", q, k, v, opts, torch.are_deterministic_algorithms_enabled())
    base = key()
    others = [key(q=q.half()), key(k=k.half()), key(v=v[:, :7]), key(q=q[:, :5]), key(k=k[..., :8]),
              key(q=q.detach().requires_grad_()), key(k=k.detach().requires_grad_()),
              key(v=v.detach().requires_grad_()), key(q=q.to("meta"))]
    others += [key(opts=opts[:i] + (o,) + opts[i + 1:]) for i, o in enumerate(
        (False, (3, 0), 0.25, True, "triton", True))]
    others += [key(opts=(1,) + opts[1:]), key(opts=opts[:2] + (1,) + opts[3:]), key(opts=opts[:2] + (1.0,) + opts[3:])]
    assert None not in others and len(set(others + [base])) == len(others) + 1
    with torch.no_grad():
        assert key() != base
    torch.use_deterministic_algorithms(True)
    try:
        assert key() != base
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("why", ["option type", "window of bools", "window of three", "subclass", "autocast",
                                 "explain", "tracing"])
def test_a_plain_call_outside_the_known_signatures_is_checked_every_time(known_calls, monkeypatch, why):
    from longattn import runner
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    opts = (True, (-1, -1), None, False, "auto", False)
    if why == "option type":
        opts = (torch.tensor(True),) + opts[1:]
    elif why == "window of bools":
        opts = (True, (True, 0)) + opts[2:]
    elif why == "window of three":
        opts = (True, (1, 2, 3)) + opts[2:]
    elif why == "subclass":
        q = torch.nn.Parameter(q)
    elif why == "autocast":
        monkeypatch.setattr(runner._autocast, "enabled", lambda device_type: True)
    elif why == "explain":
        monkeypatch.setattr(runner, "_PLANNING", runner.contextvars.ContextVar("p", default=True))
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert runner.known_key("flash_attention", q, k, v, opts, False) is None


def test_a_known_signature_still_refuses_what_its_checks_refuse(known_calls):
    """Arguments equal to a known call's under == but refused by the checks (1 for True, a window of bools) are
    checked, not run; so is every call with another signature."""
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    longattn.flash_attention(q, k, v, causal=True, window=(1, 0))
    with pytest.raises(TypeError, match="causal must be a bool"):
        longattn.flash_attention(q, k, v, causal=1, window=(1, 0))
    with pytest.raises(TypeError, match="window left must be an int"):
        longattn.flash_attention(q, k, v, causal=True, window=(True, 0))
    with pytest.raises(TypeError, match="must share one dtype"):
        longattn.flash_attention(q, k.half(), v, causal=True, window=(1, 0))
    with pytest.raises(ValueError, match="scale"):
        longattn.flash_attention(q, k, v, causal=True, window=(1, 0), scale=-1.0)
    assert len(known_calls) == 1  # (the refused calls never reach runner.run)


def test_a_known_call_with_score_modifications_is_checked_every_time(known_calls):
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    for _ in range(2):
        longattn.flash_attention(q, k, v, softcap=5.0)
        longattn.flash_attention(q, k, v, sinks=torch.zeros(4))
    assert len(known_calls) == 4


def test_a_known_signature_keeps_no_fp8_call(known_calls):
    """An FP8 call's description holds tensors (its descale factors): it is never kept, however plain its
    arguments."""
    from longattn import runner
    q = torch.randn(1, 8, 4, 16).to(torch.float8_e4m3fn)
    k = v = torch.randn(1, 8, 2, 16).to(torch.float8_e4m3fn)
    for _ in range(2):
        longattn.flash_attention(q, k, v, backend="torch")
    assert len(known_calls) == 2 and len(runner.KNOWN) == 0


def test_the_deterministic_mode_of_a_known_call_is_the_one_its_key_holds(known_calls, monkeypatch):
    """PyTorch's deterministic mode is read once a call: the kept call's deterministic flag agrees with the key even
    where the mode changes between two readings (another thread switching it)."""
    from longattn import runner
    readings = iter([False, True] * 4)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: next(readings))
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    longattn.flash_attention(q, k, v)
    (key, kept), = runner.KNOWN._kept.items()
    assert key[-1] is False and kept.call.deterministic is False


def test_fa4_arguments_are_kept_per_call_object_and_never_for_another(monkeypatch):
    """FA4's keyword arguments are made once per call object (calls are immutable): each call gets its own, a call
    made again by ``replace`` (a new object) is not served another's, an entry whose call is not the one asked for
    (an id reused) is made again, and a call with sinks reads their values on every call."""
    from dataclasses import replace

    from longattn.call import flash_call
    monkeypatch.setattr(fa4, "_ARGUMENTS", {})
    causal, window, dense = flash_call(0.25, True), flash_call(0.25, False, (3, 1)), flash_call(0.25, False)
    for call in (causal, window, dense, replace(causal, deterministic=True), replace(causal, need_lse=False)):
        for _ in range(2):
            assert fa4._arguments(call) == fa4._make_arguments(call)
    assert fa4._arguments(causal) is fa4._arguments(causal)
    assert fa4._arguments(replace(causal, softcap=5.0))["softcap"] == 5.0
    fa4._ARGUMENTS[id(dense)] = (causal, fa4._make_arguments(causal))  # (another object under dense's id)
    assert fa4._arguments(dense) == fa4._make_arguments(dense) and fa4._arguments(dense)["causal"] is False
    sinks = torch.zeros(2)
    with_sinks = replace(causal, sinks=sinks)
    assert fa4._arguments(with_sinks)["learnable_sink"].tolist() == [0.0, 0.0]
    sinks.fill_(1.0)
    assert fa4._arguments(with_sinks)["learnable_sink"].tolist() == [1.0, 1.0]
    assert not any(c.sinks is not None for c, _ in fa4._ARGUMENTS.values())


def test_a_known_fa4_call_runs_the_backends_attention_as_it_is_then(known_calls, monkeypatch):
    """A kept FA4 call goes straight to ``fa4.attention`` (looked up on the module at each call, so a wrapper set
    later sees it), its gradients as the long way's, and its node still refuses a second derivative."""
    from types import SimpleNamespace

    from longattn import runner

    def func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
             deterministic=False, return_lse=False):
        return _Fa4Stub.apply(q, k, v, softmax_scale)

    monkeypatch.setattr(runner, "_choose_now", lambda *a: "fa4")
    monkeypatch.setattr(fa4, "_module", lambda: SimpleNamespace(flash_attn_func=func, flash_attn_varlen_func=None))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (a CPU tensor's index: no device switch)
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16).requires_grad_() for _ in range(3))
    out = longattn.flash_attention(q, k, v, causal=True)
    assert len(known_calls) == 1 and runner.KNOWN.values()[0].module is fa4
    seen = []
    real = fa4.attention
    monkeypatch.setattr(fa4, "attention", lambda *a: seen.append(a[3]) or real(*a))
    out2 = longattn.flash_attention(q, k, v, causal=True)
    assert len(known_calls) == 1 and len(seen) == 1 and seen[0].causal and torch.equal(out, out2)
    dq, = torch.autograd.grad(out2.float().sum(), q, retain_graph=True)
    torch.testing.assert_close(dq, torch.full_like(q, 2.0))
    with pytest.raises(RuntimeError, match=r"backend 'fa4'.*second derivatives"):
        torch.autograd.grad(out2.float().sum(), q, create_graph=True)
    empty = torch.randn(1, 0, 2, 16, dtype=torch.float16)
    for _ in range(2):  # a known empty signature runs no backend: its zeros, kept without a module
        assert longattn.flash_attention(empty, k, v, causal=True).shape == empty.shape
    assert [kept.module for kept in runner.KNOWN.values()] == [fa4, None]


class _Fa4Stub(torch.autograd.Function):
    """A stand-in for FA4's autograd Function: out = 2 q (its gradient 2 dO, no graph), lse zeros."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        return 2 * q, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    @staticmethod
    def backward(ctx, do, dlse):
        return 2 * do, None, None, None


@pytest.mark.parametrize("band", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 3)), (False, (4, 2)),
                                  (False, (2 ** 62, 2 ** 62)), (True, (2 ** 31, -1))])
def test_band_arguments_are_made_once_per_band_and_as_the_long_way(band):
    from longattn.backends.triton.launch import BandArgs
    from longattn.call import Band
    b = Band.of(*band)
    long_way = b.for_kernels()
    want = BandArgs(long_way.left or 0, long_way.right or 0, long_way.left is not None, long_way.right is not None)
    assert BandArgs.of(b) == want and BandArgs.of(Band(b.left, b.right)) is BandArgs.of(b)


def test_row_stats_plane_offset_is_the_first_planes_size():
    from longattn.backends.triton.launch import RowStats
    planes = torch.empty(2, 3, 4, 5)
    assert RowStats(planes, False).kernel_args()[1] == planes[0].numel() == 60
    assert RowStats(torch.empty(3, 4, 5, 2), True).kernel_args()[1] == 0


def test_on_device_switches_only_to_another_device(monkeypatch):
    """launch.on_device: no torch.cuda.device context (a few microseconds of host time on entry and exit) where the
    tensor's GPU is current already, one where another is; none off the GPU."""
    import contextlib
    from types import SimpleNamespace
    from longattn.backends.triton.launch import on_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    switched = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: switched.append(d) or contextlib.nullcontext())
    for index in (1, 0):
        with on_device(SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))):
            pass
    with on_device(torch.zeros(1)):
        pass
    assert switched == [torch.device("cuda", 0)]


def _slow_aligned(t):
    """gluon.tma.aligned's long way (what it computed before it was written out)."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(t.shape[i] == 1 or (t.stride(i) > 0 and (t.stride(i) * size) % 16 == 0) for i in (0, 1, 2))


def test_tma_alignment_and_box_strides_answer_as_the_long_way():
    from longattn.backends.gluon.tma import aligned, box_strides
    base = torch.zeros(4096, dtype=torch.float16)
    cases = []
    for shape in [(2, 8, 4, 16), (1, 8, 1, 16), (2, 1, 4, 8), (1, 1, 1, 16), (3, 5, 2, 4)]:
        n = shape[0] * shape[1] * shape[2] * shape[3]
        x = base[:n].view(shape)
        cases += [x, x.transpose(1, 2), base[1:n + 1].view(shape), base[8:n + 8].view(shape), x.float(),
                  x.expand(shape[0], shape[1], 3 if shape[2] == 1 else shape[2], shape[3])]
        cases.append(torch.zeros(shape[0], shape[1], shape[2], 2 * shape[3], dtype=torch.float16)[..., ::2])
        cases.append(x.flip(1) if shape[1] > 1 else x)
    for t in cases:
        assert aligned(t) == _slow_aligned(t), (t.shape, t.stride())
        assert box_strides(t) == tuple(t.stride(i) if t.shape[i] > 1 else t.shape[-1] for i in (0, 1, 2))
