"""Packed variable-length attention: the reference, the argument checks and the public function.

The reference attends every sequence on its own tensors (with the mask of ``varlen_mask``'s block for it); here it
is checked against the plain reference applied to every sequence (including empty sequences, N != M per sequence,
causal and windows, GQA), and a non-finite value in one sequence is checked to reach no other."""
import warnings

import numpy as np
import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.call import longest_sequence
from longattn.utils import cu_seqlens_of


def _packed(lens_q, lens_k, hq=4, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64, requires_grad=True)
    cu = lambda lens: cu_seqlens_of(lens, "cpu")  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (3, 1)}, {"causal": True, "window": (2, -1)}])
def test_varlen_reference_is_each_sequence_alone(kw):
    lens_q, lens_k = [5, 0, 9, 1, 7], [3, 4, 9, 6, 0]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    out, lse = ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        want, want_lse = ref.flash_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], return_lse=True, **kw)
        torch.testing.assert_close(out[q0:q1], want[0])
        torch.testing.assert_close(lse[:, q0:q1], want_lse[0])
    (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert (out[cu_q[-2]:] == 0).all() and torch.isneginf(lse[:, cu_q[-2]:]).all()  # the last sequence has no keys


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_value_reaches_no_other_sequence(where, value):
    """A NaN or inf in one sequence of a packed batch leaves the others' outputs, log-sum-exps and gradients as they
    are without it, in the reference (whose product over the whole packed batch spread ``0 * inf`` from a value row
    to every other sequence) as on the backends."""
    lens_q, lens_k = [4, 5, 3], [6, 2, 5]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    poisoned = [x.detach().clone() for x in (q, k, v)]
    cu = cu_q if where == "q" else cu_k
    poisoned["qkv".index(where)][cu[1], 0, 0] = value  # the middle sequence's first row
    rows = torch.cat([torch.arange(cu_q[0], cu_q[1]), torch.arange(cu_q[2], cu_q[3])])
    keys = torch.cat([torch.arange(cu_k[0], cu_k[1]), torch.arange(cu_k[2], cu_k[3])])
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)
    want, want_lse = ref.flash_attention_varlen(q, k, v, **kw)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    fns = {"reference": (ref.flash_attention_varlen, torch.float64),  # (the interpreted kernels take float32)
           **{be: (lambda *t, be=be, **a: longattn.flash_attention_varlen(*t, backend=be, **a), dtype)
              for be, dtype in (("torch", torch.float64), ("triton", torch.float32))}}
    for name, (fn, dtype) in fns.items():
        leaves = [x.to(dtype).requires_grad_() for x in poisoned]
        out, lse = fn(*leaves, **kw)
        grads = [g.double() for g in torch.autograd.grad(out.sum(), leaves)]
        close = lambda a, b: torch.testing.assert_close(a.double(), b.detach(), atol=1e-5, rtol=1e-5,  # noqa: E731
                                                         msg=name)
        close(out[rows], want[rows])
        close(lse[:, rows], want_lse[:, rows])
        close(grads[0][rows], want_grads[0][rows])
        for g, w in zip(grads[1:], want_grads[1:]):
            close(g[keys], w[keys])


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([0, 3, 2, 9], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([1, 3, 9], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), "end at"),
    (torch.tensor([[0, 9]], dtype=torch.int32), "shape"),
    (torch.tensor([0.0, 9.0]), "int32 or int64"),
    ([0, 9], "torch.Tensor"),
])
def test_invalid_cu_seqlens_are_named(cu, match):
    q, k, v, _, cu_k = _packed([9], [4])
    with pytest.raises((ValueError, TypeError), match=match) as err:
        ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k)
    assert "cu_seqlens_q" in str(err.value)


def test_dilated_varlen_names_its_cu_seqlens():
    """dilated_attention_varlen takes one ``cu_seqlens``: a bad one is reported under that name."""
    import longattn

    q = torch.randn(9, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="start at 0") as err:
        longattn.dilated_attention_varlen(q, q, q, cu_seqlens=torch.tensor([1, 3, 9], dtype=torch.int32),
                                          segment_lengths=(4,), dilation_rates=(1,))
    assert "cu_seqlens" in str(err.value) and "cu_seqlens_q" not in str(err.value)


def _rewritten_buffer_case(write):
    """Two calls given the same cu_seqlens tensor whose contents ``write`` changes between them, without a PyTorch
    in-place op: the second call must use (and check) the new boundaries."""
    import longattn

    buf = np.array([0, 10, 30], dtype=np.int32)
    cu = torch.from_numpy(buf)
    q, k, v = (torch.randn(30, 2, 8, dtype=torch.float64) for _ in range(3))
    for fn, kw in ((longattn.flash_attention_varlen, lambda cu: dict(cu_seqlens_q=cu, cu_seqlens_k=cu)),
                   (longattn.dilated_attention_varlen,
                    lambda cu: dict(cu_seqlens=cu, segment_lengths=(4, 8), dilation_rates=(1, 2)))):
        reference = getattr(ref, fn.__name__)
        buf[:] = [0, 10, 30]
        torch.testing.assert_close(fn(q, k, v, **kw(cu)), reference(q, k, v, **kw(torch.tensor([0, 10, 30]))))
        write(buf, cu, 1, 25)
        torch.testing.assert_close(fn(q, k, v, **kw(cu)), reference(q, k, v, **kw(torch.tensor([0, 25, 30]))))
        write(buf, cu, 1, 99)  # invalid now: must be checked again
        with pytest.raises(ValueError, match="non-decreasing"):
            fn(q, k, v, **kw(cu))


def _numpy_write(buf, cu, i, value):
    buf[i] = value


def _data_write(buf, cu, i, value):
    cu.data[i] = value


def _foreign_write(buf, cu, i, value):
    torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(cu.detach()))[i] = value


@pytest.mark.parametrize("write", [_numpy_write, _data_write, _foreign_write])
def test_cu_seqlens_rewritten_without_a_version_bump_are_read_again(write):
    """A reused torch.from_numpy buffer (the case a user reported), a write through .data and a write
    through another tensor sharing the memory (DLPack) keep the version counter; the new values must be used."""
    _rewritten_buffer_case(write)


def test_cu_seqlens_are_read_on_every_call(monkeypatch):
    """A CPU cu_seqlens is read on every call (free; a NumPy array may share its memory); in-place writes and fresh
    tensors at reused addresses are seen."""
    import longattn

    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.numel()) or tolist(t))
    q, k, v, cu_q, cu_k = _packed([4, 5], [3, 6])
    for _ in range(3):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")
    assert copies.count(3) >= 6  # cu_q and cu_k on each of the three calls
    cu_q[1] = 6
    out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")
    want = ref.flash_attention_varlen(q, k, v, cu_seqlens_q=torch.tensor([0, 6, 9], dtype=torch.int32),
                                      cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, want)
    cu_q[2] = 8
    with pytest.raises(ValueError, match="end at"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")
    for _ in range(3):  # fresh tensors each time (freed ones' addresses are reused): each is checked
        bad = torch.tensor([0, 5, 8], dtype=torch.int32)
        with pytest.raises(ValueError, match="end at"):
            longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=bad, cu_seqlens_k=cu_k, backend="torch")
        del bad


def test_host_reads_are_remembered_only_where_allowed():
    """_memo.per_tensor: CPU tensors are read every time; other devices' (meta stands in for CUDA here) once per
    object and version, unless remember_host_reads(False); tensors the library owns once per object and version on
    any device."""
    import longattn
    from longattn import _memo

    calls = []

    @_memo.per_tensor(size=4)
    def read(t):
        calls.append(id(t))
        return tuple(t.shape)

    cpu = torch.tensor([0, 3, 5])
    read(cpu), read(cpu)
    assert len(calls) == 2  # a CPU tensor of the user's: read each time
    gpu_like = torch.empty(3, device="meta")
    read(gpu_like), read(gpu_like)
    assert len(calls) == 3
    gpu_like.add_(1)  # an in-place write bumps the version: read again
    read(gpu_like)
    assert len(calls) == 4
    with longattn.remember_host_reads(False):
        read(gpu_like), read(gpu_like)
        assert len(calls) == 6
    read(gpu_like)
    assert len(calls) == 7  # what was remembered before the block was dropped when it exited
    mine = _memo.own(torch.tensor([0, 1]))
    read(mine), read(mine)
    assert len(calls) == 8
    mine.add_(1)
    read(mine)
    assert len(calls) == 9
    with pytest.raises(TypeError, match="enabled"):
        with longattn.remember_host_reads("no"):
            pass


def test_remember_host_reads_takes_the_flags_the_api_takes():
    """A NumPy bool or 0-d bool tensor, as every flag of the API; anything else is named."""
    from longattn import _memo

    for off in (np.False_, torch.tensor(False)):
        with longattn.remember_host_reads(off):
            assert not _memo._REMEMBER.get()
    with pytest.raises(TypeError, match="remember_host_reads: enabled must be a bool .*got int 0"):
        with longattn.remember_host_reads(0):
            pass


def test_packed_shapes_and_batch_counts_are_checked():
    q, k, v, cu_q, cu_k = _packed([4, 5], [4, 5])
    with pytest.raises(ValueError, match="3 dims"):
        ref.flash_attention_varlen(q[None], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="same number of sequences"):
        ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="multiple"):
        ref.flash_attention_varlen(q[:, :3], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _compare(public, reference, q, k, v, backend, dtype, **kw):
    """``public`` on ``dtype`` copies of the float64 inputs against ``reference``: out, lse and the three gradients
    (float32 tolerances for float32, 2e-2 for float16)."""
    qs, ks, vs = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = public(qs, ks, vs, return_lse=True, backend=backend, **kw)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    want, want_lse = reference(q, k, v, return_lse=True, **kw)
    tol = {torch.float64: {}, torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
    torch.testing.assert_close(out.double(), want, **tol[dtype])
    torch.testing.assert_close(lse.double(), want_lse, **tol[dtype])
    do = torch.randn_like(want)
    out.backward(do.to(dtype))
    want.backward(do)
    for got, w in ((qs.grad, q.grad), (ks.grad, k.grad), (vs.grad, v.grad)):
        torch.testing.assert_close(got.double(), w, **tol[dtype])
    plain = public(qs, ks, vs, backend=backend, **kw)
    torch.testing.assert_close(plain, out)


def _flash_public(q, k, v, *, cu_q, cu_k, **kw):
    import longattn

    return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)


def _flash_reference(q, k, v, *, cu_q, cu_k, **kw):
    return ref.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)


# (query lengths, key lengths): awkward, empty, single, shorter than a block, N != M per sequence
FLASH_LENGTHS = [
    ([5, 0, 19, 1, 7], [3, 4, 17, 6, 0]),
    ([1, 2, 127, 129, 33], [1, 2, 127, 129, 33]),
    ([40], [40]),
    ([3, 70, 0, 16], [50, 9, 12, 0]),
]


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.parametrize("lengths", range(len(FLASH_LENGTHS)))
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (3, 1)}, {"causal": True, "window": (20, -1)}])
def test_flash_attention_varlen_matches_the_reference(backend, lengths, kw):
    """All sequences in one call: Triton in the interpreter (float32, one launch per pass), PyTorch in float64."""
    lens_q, lens_k = FLASH_LENGTHS[lengths]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, seed=lengths)
    dtype = torch.float32 if backend == "triton" else torch.float64
    _compare(_flash_public, _flash_reference, q, k, v, backend, dtype, cu_q=cu_q, cu_k=cu_k, **kw)


@pytest.mark.parametrize("hq, hk, d", [(4, 4, 32), (6, 2, 48), (2, 1, 256)])
def test_flash_attention_varlen_heads_and_head_dims(hq, hk, d):
    """GQA and head dims 32..256 on the kernels (float16 in the interpreter) and on PyTorch."""
    lens_q, lens_k = [9, 0, 37, 2], [20, 5, 37, 1]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq=hq, hk=hk, d=d, seed=d)
    for backend, dtype in (("triton", torch.float16), ("torch", torch.float64)):
        _compare(_flash_public, _flash_reference, q, k, v, backend, dtype, cu_q=cu_q, cu_k=cu_k, causal=True)


def test_flash_attention_varlen_long_sequences_on_pytorch():
    """Lengths up to 1000 (PyTorch backend, float64)."""
    lens = [1000, 1, 129, 0, 300]
    q, k, v, cu_q, cu_k = _packed(lens, lens, hq=2, hk=1, d=16)
    for kw in ({}, {"causal": True}):
        _compare(_flash_public, _flash_reference, q, k, v, "torch", torch.float64, cu_q=cu_q, cu_k=cu_k, **kw)


def test_flash_attention_varlen_triton_is_one_launch_per_pass(monkeypatch):
    """The Triton backend launches each pass once for the whole packed batch (no loop over sequences)."""
    import longattn
    from longattn.backends.triton import launch

    counts = {}
    for name in ("forward", "backward_dkdv", "backward_dq"):
        real = getattr(launch, name)

        def counted(*a, _real=real, _name=name, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            assert kw.get("packed") is not None
            return _real(*a, **kw)

        monkeypatch.setattr(launch, name, counted)
    q, k, v, cu_q, cu_k = _packed([5, 9, 1, 30, 2], [5, 9, 1, 30, 2])
    qs, ks, vs = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = longattn.flash_attention_varlen(qs, ks, vs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                          backend="triton")
    out.sum().backward()
    assert counts == {"forward": 1, "backward_dkdv": 1, "backward_dq": 1}


def _dilated_public(q, k, v, *, cu, **kw):
    import longattn

    return longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu, **kw)


def _dilated_reference(q, k, v, *, cu, **kw):
    return ref.dilated_attention_varlen(q, k, v, cu_seqlens=cu, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kw", [
    dict(segment_lengths=[8, 32], dilation_rates=[1, 2]),
    dict(segment_lengths=[16, 64], dilation_rates=[2, 4], causal=True),
    dict(segment_lengths=[8, 32, 128], dilation_rates=[1, 2, 4], head_split=True),
    dict(segment_lengths=[12], dilation_rates=[3], causal=True),
])
def test_dilated_attention_varlen_matches_the_reference(backend, kw):
    """Documents shorter and longer than the segments (1, 5, 70 and 133 rows against segments 8..128), empty ones."""
    lens = [5, 0, 70, 1, 133, 20]
    q, k, v, cu, _ = _packed(lens, lens, hq=4, hk=2, d=16, seed=3)
    dtype = torch.float32 if backend == "triton" else torch.float64
    _compare(_dilated_public, _dilated_reference, q, k, v, backend, dtype, cu=cu, **kw)


def test_dilated_attention_varlen_is_dilated_attention_per_document():
    """The reference is the plain dilated reference on each document (and a one-document batch is the plain call)."""
    import longattn

    lens = [30, 64]
    q, k, v, cu, _ = _packed(lens, lens, hq=2, hk=2, d=8, seed=5)
    kw = dict(segment_lengths=[16, 32], dilation_rates=[1, 2], causal=True)
    out = longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu, backend="torch", **kw)
    for a, e in zip(cu.tolist(), cu.tolist()[1:]):
        want = ref.dilated_attention(q[None, a:e], k[None, a:e], v[None, a:e], **kw)[0]
        torch.testing.assert_close(out[a:e], want)


def test_varlen_bad_arguments_are_named():
    import longattn

    q, k, v, cu_q, cu_k = _packed([4, 5], [4, 5])
    with pytest.raises(ValueError, match="3 dims"):
        longattn.flash_attention_varlen(q[None], k[None], v[None], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q.*device"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q.to("meta"), cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="total_q == total_k"):
        longattn.dilated_attention_varlen(q, k[:5], v[:5], cu_seqlens=cu_q, segment_lengths=[4],
                                          dilation_rates=[1])
    with pytest.raises(ValueError, match="dilated_attention_varlen: segment_lengths"):
        longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu_q, segment_lengths=[0], dilation_rates=[1])
    with pytest.raises(TypeError, match="cu_seqlens"):
        longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu_q.float(), segment_lengths=[4],
                                          dilation_rates=[1])


def test_flash_attention_varlen_hints_and_empty_batch():
    import longattn

    q, k, v, cu_q, cu_k = _packed([4, 5], [4, 5])
    with pytest.raises(ValueError, match="max_seqlen_q"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4)
    # a tensor or a float is refused for its type (the message said "an int >= 5, got tensor(6)")
    with pytest.raises(TypeError, match=r"max_seqlen_q must be None or a Python int .*got Tensor tensor\(6\)"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=torch.tensor(6))
    with pytest.raises(TypeError, match="causal"):
        longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=1)
    empty = torch.zeros(1, dtype=torch.int32)
    out, lse = longattn.flash_attention_varlen(q[:0], k[:0], v[:0], cu_seqlens_q=empty, cu_seqlens_k=empty,
                                               return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)


@pytest.mark.parametrize("fn", ["flash", "dilated"])
def test_cu_seqlens_rewritten_before_the_backward_is_an_error_not_other_gradients(fn):
    """A buffer of lengths reused for the next batch (rewritten in place) between a forward and its backward: the
    Triton backend's backward would read the new boundaries; it raises PyTorch's in-place error instead."""
    q, k, v = (torch.randn(40, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    if fn == "flash":
        out = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                              backend="triton")
    else:
        out = longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu, segment_lengths=(8, 16),
                                                dilation_rates=(1, 2), backend="triton")
    cu.copy_(torch.tensor([0, 22, 40], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_alibi_slopes_rewritten_before_the_backward_is_an_error():
    slopes = torch.rand(2, 2)
    q, k, v = (torch.randn(2, 20, 2, 16, requires_grad=True) for _ in range(3))
    out = longattn.flash_attention(q, k, v, alibi_slopes=slopes, causal=True, backend="triton")
    slopes.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
@pytest.mark.parametrize("cu_q, cu_k", [([0, 3, 3], [0, 0, 2]), ([0, 0, 0], [0, 1, 2])])
def test_packed_batch_without_any_query_key_pair_gives_zero_gradients_not_none(backend, cu_q, cu_k):
    """Sequences with queries but no keys, or keys but no queries: k and v stay in the graph with zero gradients on
    every backend (the PyTorch backend left them out, so their .grad stayed None while the Triton one gave zeros)."""
    q = torch.randn(cu_q[-1], 1, 16, requires_grad=True)
    k, v = (torch.randn(cu_k[-1], 1, 16, requires_grad=True) for _ in range(2))
    out, lse = longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                                               cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), backend=backend,
                                               return_lse=True)
    assert not out.any() and bool(torch.isneginf(lse).all())
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


def test_compiled_packed_calls_break_the_graph_only_where_they_read_the_host():
    """Under ``torch.compile`` the longest sequence was ``max(..., default=0)``, which Dynamo cannot trace (a logged
    warning and a graph break on every trace), and ``dilated_attention_varlen`` looked its own name up with
    ``sys._getframe`` on every call (Dynamo's warning about an untraceable builtin). Neither remains."""
    q = torch.randn(10, 4, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert torch.compile(lambda x: x * longest_sequence([0, 3, 3, 10]), fullgraph=True)(q).equal(q * 7)

    def f(q, cu):
        return (longattn.flash_attention_varlen(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
                + longattn.dilated_attention_varlen(q, q, q, cu_seqlens=cu, segment_lengths=[2], dilation_rates=[1]))

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(f)(q, cu)
    assert not [w for w in caught if "_getframe" in str(w.message)]
    where = [r.user_stack[-1].filename for r in explained.break_reasons if r.user_stack]
    assert not [name for name in where if name.endswith(("varlen.py", "call.py"))], where
