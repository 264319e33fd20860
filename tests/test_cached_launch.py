"""Direct kernel launches (:mod:`longattn.backends.cached_launch`): the key :func:`spec_key` against Triton's
own specialisation of the same arguments (the interpreter never takes the direct path, so the key is tested
directly), and :func:`launch` with a fake kernel: through the JIT on a specialisation's first launch, directly on
the next ones."""
import itertools
import math

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from longattn.backends.plan import Kept
from longattn.backends import cached_launch
from longattn.backends.cached_launch import launch, spec_key


def _kernel(X, Y, n, m, s, flag, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    pass


KERNEL = JITFunction(_kernel)  # (not through triton.jit: the interpreter would take it)
UNSPECIALISED = JITFunction(_kernel, do_not_specialize=["n"], do_not_specialize_on_alignment=["m", "Y"])

_buffer = torch.zeros(64, dtype=torch.float16)
VALUES = [0, 1, 2, 8, 16, 17, 24, 32, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31, -2 ** 31 - 1, -2 ** 31 - 16,
          2 ** 63 - 1, 2 ** 63, True, False, 0.5, 16.0, math.nan, math.inf, None,
          _buffer, _buffer[1:], _buffer[4:], _buffer[8:], _buffer[:16].view(4, 4).t(), _buffer.view(torch.bfloat16),
          _buffer.float(), torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.float8_e4m3fn)]
BASE = (_buffer, _buffer, 64, 64, 0.5, True)


def _tritons_key(fn, args, kwargs):
    """The key Triton's JIT files a compiled kernel under (``JITFunction.run``: the specialisation of every parameter
    and the options given), for the CUDA backend's specialisation (``BaseBackend``'s)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature
    binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    return str(specialization) + str(options)


@pytest.mark.parametrize("fn", [KERNEL, UNSPECIALISED], ids=["default", "do_not_specialize"])
@pytest.mark.parametrize("position", range(6))
def test_the_key_splits_runtime_arguments_as_triton_does(fn, position):
    """Any two values of one runtime argument get one key exactly where Triton's JIT specialises them alike (the
    Triton installed: 3.6 and 3.9 checked), with and without ``do_not_specialize`` lists."""
    kwargs = dict(BLOCK=64, num_warps=4)
    ours, tritons = [], []
    for value in VALUES:
        args = BASE[:position] + (value,) + BASE[position + 1:]
        ours.append(spec_key(fn, args, kwargs))
        tritons.append(_tritons_key(fn, args, kwargs))
    assert None not in ours
    for i, j in itertools.combinations(range(len(VALUES)), 2):
        assert (ours[i] == ours[j]) == (tritons[i] == tritons[j]), (VALUES[i], VALUES[j])


def test_the_key_splits_constexprs_and_options_as_triton_does():
    """Constexprs and launch options by value, ``True`` and ``1`` or ``2`` and ``2.0`` apart (Triton files them
    under their strings). One call given in another form (a constexpr by position, a default spelt out) may get
    another key, never one Triton launches differently."""
    by_keyword = [dict(BLOCK=64), dict(BLOCK=128), dict(BLOCK=True), dict(BLOCK=1), dict(BLOCK=2), dict(BLOCK=2.0),
                  dict(BLOCK=None), dict(BLOCK=64, EXTRA=4), dict(BLOCK=64, num_warps=8),
                  dict(BLOCK=64, num_stages=2)]
    cases = [(BASE, kw) for kw in by_keyword]
    for (a1, k1), (a2, k2) in itertools.combinations(cases, 2):
        assert (spec_key(KERNEL, a1, k1) == spec_key(KERNEL, a2, k2)) == \
            (_tritons_key(KERNEL, a1, k1) == _tritons_key(KERNEL, a2, k2)), (k1, k2)
    other_forms = [((*BASE, 64), {}), ((*BASE, 64, 3), {}), ((*BASE, 64, 4), {}), (BASE, dict(BLOCK=64, EXTRA=3))]
    for (a1, k1), (a2, k2) in itertools.combinations(cases + other_forms, 2):
        if spec_key(KERNEL, a1, k1) == spec_key(KERNEL, a2, k2):
            assert _tritons_key(KERNEL, a1, k1) == _tritons_key(KERNEL, a2, k2), (a1[6:], k1, a2[6:], k2)


def test_the_key_examples():
    """What the key holds, by example: an integer's type, ``== 1`` and ``% 16``; a tensor's dtype and 16-byte
    alignment, not its shape, strides or contents; nothing of a float or bool but its type."""
    def key(*changes, **kwargs):
        args = list(BASE)
        for i, v in changes:
            args[i] = v
        return spec_key(KERNEL, tuple(args), kwargs or dict(BLOCK=64))

    assert key((2, 17)) == key((2, 33)) != key((2, 16)) == key((2, 0)) != key((2, 1))
    assert key((2, 2 ** 31 - 16)) != key((2, 2 ** 31)) == key((2, 2 ** 32)) != key((2, 2 ** 63))
    assert key((0, _buffer[8:])) == key((0, torch.ones(5, 5, dtype=torch.float16).t())) != key((0, _buffer[1:]))
    assert key((0, _buffer)) != key((0, _buffer.view(torch.bfloat16))) != key((0, None))
    assert key((4, 0.5)) == key((4, math.nan)) == key((4, -math.inf)) != key((4, 1)) != key((4, True))
    assert key((5, True)) == key((5, False)) != key((5, 1))
    assert key(BLOCK=64) != key(BLOCK=64, num_warps=8) and key(BLOCK=True) != key(BLOCK=1)
    assert spec_key(UNSPECIALISED, (_buffer, _buffer[1:], 1, 17, 0.5, True), {}) == \
        spec_key(UNSPECIALISED, (_buffer, _buffer[8:], 16, 33, 0.5, True), {})
    assert key((2, (1, 2))) is None and key((2, torch.float16)) is None  # not keyed: through the JIT


class _Compiled:
    """A compiled kernel as Triton's JIT returns it: ``kernel[grid](*every argument)`` launches it directly."""

    function = object()

    def __init__(self, direct: list, owner):
        self.direct, self.owner = direct, owner

    def __getitem__(self, grid):
        def run(*args):
            if self.owner.fail:
                raise TypeError("launches otherwise")
            self.direct.append((grid, args))
        return run


class _Kernel:
    """A kernel with :data:`KERNEL`'s parameters: ``kernel[grid](*args, **kwargs)`` (the JIT) recorded."""

    params, signature = KERNEL.params, KERNEL.signature

    def __init__(self, fail: bool = False):
        self.jit, self.direct, self.fail = [], [], fail

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit.append((grid, args, kwargs))
            return _Compiled(self.direct, self)
        return run


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("LONGATTN_DIRECT_LAUNCH", "1")
    monkeypatch.setattr(cached_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(cached_launch, "_KEYED_HERE", True)
    monkeypatch.setattr(cached_launch, "LAUNCHES", Kept(4))


def test_launch_goes_direct_from_a_specialisations_second_launch(direct, monkeypatch):
    """The first launch of a specialisation goes through the JIT; the next ones launch the compiled kernel with
    every argument, the constexprs and defaults after the runtime ones, on any grid; another specialisation or
    device starts again through the JIT."""
    k = _Kernel()
    x = torch.zeros(8)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64, num_warps=4)
    assert len(k.jit) == 1 and not k.direct
    launch(k, (4,), x, x, 32, 33, math.nan, True, BLOCK=64, num_warps=4)
    assert len(k.jit) == 1 and k.direct == [((4, 1, 1), (x, x, 32, 33, math.nan, True, 64, 3))]
    launch(k, (4,), x, x, 16, 1, 0.5, False, BLOCK=64, num_warps=4)  # m == 1: another specialisation
    launch(k, (5, 2), x, x, 16, 17, 0.5, False, BLOCK=64, num_warps=4)  # another grid: the same kernel
    assert len(k.jit) == 2 and k.direct[-1] == ((5, 2, 1), (x, x, 16, 17, 0.5, False, 64, 3))
    launch(k, (4,), x, x[1:], 16, 17, 0.5, False, BLOCK=64, num_warps=4)  # Y misaligned
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64, num_warps=8)  # another launch option
    assert len(k.jit) == 4 and len(k.direct) == 2
    monkeypatch.setattr(cached_launch, "_current_device", lambda: 1)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64, num_warps=4)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=128, num_warps=4)
    assert len(k.jit) == 6 and len(k.direct) == 2
    assert len(cached_launch.LAUNCHES) == 4  # bounded: the oldest went


@pytest.mark.parametrize("how", ["env", "interpreter", "unkeyed"])
def test_launch_goes_through_the_jit_where_direct_launches_are_off(direct, monkeypatch, how):
    k = _Kernel()
    x = torch.zeros(8)
    if how == "env":
        monkeypatch.setenv("LONGATTN_DIRECT_LAUNCH", "0")
    elif how == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = (x, x, (1, 2) if how == "unkeyed" else 16, 17, 0.5, False)
    for _ in range(3):
        launch(k, (4,), *args, BLOCK=64)
    assert len(k.jit) == 3 and not k.direct


def test_a_failing_direct_launch_falls_back_to_the_jit_for_good(direct):
    k = _Kernel(fail=True)
    x = torch.zeros(8)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64)
    with pytest.warns(UserWarning, match="direct launch of .* failed"):
        launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64)
    assert len(k.jit) == 3 and not k.direct


def test_an_error_after_direct_launches_went_through_is_raised_not_relaunched(direct):
    """Once a direct launch has gone through, the form of the call is right: a later error is the arguments' and is
    raised, with no second launch through the JIT (an accumulating kernel must not run twice)."""
    k = _Kernel()
    x = torch.zeros(8)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64)
    launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64)
    k.fail = True
    with pytest.raises(TypeError, match="launches otherwise"):
        launch(k, (4,), x, x, 16, 17, 0.5, False, BLOCK=64)
    assert len(k.jit) == 1 and len(k.direct) == 1


@pytest.mark.parametrize("a, b", [(0.0, -0.0), ((1,), (True,)), ((1, 2), (1.0, 2.0)), (2, 2.0), (True, 1)])
def test_constexprs_equal_in_python_but_apart_in_triton_get_apart_keys(a, b):
    """Triton files constexprs and options by ``repr`` (``str`` of its lists and dicts): values Python calls equal
    (``0.0 == -0.0``, ``(1,) == (True,)``) compile apart and must not share a direct launch."""
    for args_a, kw_a, args_b, kw_b in (((*BASE, a), {}, (*BASE, b), {}), (BASE, dict(BLOCK=a), BASE, dict(BLOCK=b))):
        assert _tritons_key(KERNEL, args_a, kw_a) != _tritons_key(KERNEL, args_b, kw_b)
        assert spec_key(KERNEL, args_a, kw_a) != spec_key(KERNEL, args_b, kw_b)


def test_unhashable_constexprs_and_runtime_arguments_by_name():
    """A list-valued constexpr gets a hashable key (the JIT takes it; a dict lookup on it would raise); a runtime
    argument given by name goes through the JIT (a key by its value would keep tensors alive)."""
    hash(spec_key(KERNEL, BASE, dict(BLOCK=[1, 2])))
    hash(spec_key(KERNEL, (*BASE, [1, 2]), {}))
    assert spec_key(KERNEL, BASE[:5], dict(flag=True, BLOCK=64)) is None


def test_the_key_of_the_usual_arguments_takes_no_python_call_per_argument():
    """Ints, tensors, floats, bools and None (every runtime argument of our launches) are keyed by one generated
    function of straight-line code, not a Python call each: a launch keys some 40 arguments, and those calls were
    most of its host time."""
    import sys
    fresh = JITFunction(_kernel)  # (its key function made here, outside the count)
    spec_key(fresh, BASE, dict(BLOCK=64))
    calls = []

    def count(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)
    for args in (BASE, (_buffer, None, 2 ** 40, 1, math.inf, False)):
        sys.setprofile(count)
        try:
            key = spec_key(fresh, args, dict(BLOCK=64, num_warps=4))
        finally:
            sys.setprofile(None)
        assert key is not None
        assert "_arg_class" not in calls and len(calls) == 3, calls  # spec_key, the lookup and the key function
        calls.clear()


def _descriptors():
    """Host-side tensor descriptors (Gluon's, as the backward kernels take them) that differ in what Triton keys
    (element type, block shape, layout) and in what it does not (base, its alignment, shape, strides)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from longattn.backends.gluon.bwd_parts import BOX16, BOX32
    from longattn.backends.gluon.tma import bhnd_descriptor
    q = torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16)
    buf = torch.zeros(2 * 256 * 4 * 64 + 8, dtype=torch.bfloat16)
    f32 = torch.zeros(2, 256, 4, 64)
    return [bhnd_descriptor(q, 128, BOX16), bhnd_descriptor(torch.zeros(3, 128, 4, 64, dtype=q.dtype), 128, BOX16),
            bhnd_descriptor(buf[8:].view(2, 256, 4, 64), 128, BOX16),
            bhnd_descriptor(q.transpose(1, 2).contiguous().transpose(1, 2), 128, BOX16),
            bhnd_descriptor(q, 64, BOX16), bhnd_descriptor(q.half(), 128, BOX16), bhnd_descriptor(f32, 64, BOX32),
            bhnd_descriptor(f32, 64, BOX32, 32)]


def test_the_key_splits_host_descriptors_as_triton_does():
    """A host-side tensor descriptor is keyed as Triton's JIT files it: by its type string alone, so descriptors of
    other tensors with the same element type, box and layout share a compiled kernel (and a direct launch)."""
    kwargs = dict(BLOCK=64, num_warps=4)
    cases = [(d,) + BASE[1:] for d in _descriptors()]
    ours = [spec_key(KERNEL, args, kwargs) for args in cases]
    tritons = [_tritons_key(KERNEL, args, kwargs) for args in cases]
    assert None not in ours
    for i, j in itertools.combinations(range(len(cases)), 2):
        assert (ours[i] == ours[j]) == (tritons[i] == tritons[j]), (i, j)
    assert ours[0] == ours[1] == ours[2] == ours[3] and len(set(ours[3:])) == 5
