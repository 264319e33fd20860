"""A decode step under ``torch.compile`` (what a serving loop compiles, often with ``fullgraph=True``): one graph,
no recompilation when only the values of ``cache_seqlens`` or ``block_table`` change, the eager call's output and
cache contents, and the value checks of a CPU call still made on every run of the graph. The Triton decode is the
custom op ``longattn::decode`` (``longattn::decode_append`` where new keys and values are appended); the checks
that read memory or values are ``longattn::checked_lengths``. Triton runs in the interpreter."""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import longattn
from longattn.backends.triton import entry

B, HQ, HK, D, CAP = 2, 4, 2, 16, 48


def _inputs(page=None, n_q=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n_q, HQ, D, generator=g)
    k, v = (torch.randn(B, n_q, HK, D, generator=g) for _ in range(2))
    if page is None:
        kc, vc = (torch.randn(B, CAP, HK, D, generator=g) for _ in range(2))
        return q, k, v, kc, vc, None
    n_pages = B * CAP // page + 2
    kc, vc = (torch.randn(n_pages, page, HK, D, generator=g) for _ in range(2))
    table = torch.randperm(n_pages, generator=g)[:B * CAP // page].view(B, -1).to(torch.int32)
    return q, k, v, kc, vc, table


def _lens(*values):
    return torch.tensor(values, dtype=torch.int32)


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("append", [True, False])
def test_a_compiled_decode_step_is_one_graph_that_matches_the_eager_one(backend, page, append):
    """Three steps with other lengths (and, paged, another block table) each: one graph, compiled once; the output
    and log-sum-exp of the eager call (bitwise on the Triton kernels, the same kernels with the same launch plan;
    to rounding on the PyTorch backend, which reads no lengths on the host when traced), the same cache rows
    written."""
    q, k, v, kc, vc, table = _inputs(page)
    new = (k, v) if append else ()

    def step(q, kc, vc, lens, table):
        return longattn.flash_attention_with_kvcache(q, kc, vc, *new, cache_seqlens=lens, block_table=table,
                                                     return_lse=True, backend=backend)

    counter = CompileCounter()
    compiled = _compiled(step, counter)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    for i, lens in enumerate(((3, 40), (47, 0), (16, 31))):
        t = None if table is None else table.roll(i, 0)
        want = step(q, *caches[0], _lens(*lens), t)
        got = compiled(q, *caches[1], _lens(*lens), t)
        for a, b in zip(got, want):
            if backend == "triton":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
    assert counter.frame_count == 1
    if append:
        assert not torch.equal(caches[1][0], kc)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_first_compiled_call_before_any_eager_one_compiles_once(monkeypatch, backend):
    """A process whose first KV-cache call is compiled: the backend's module, imported while tracing, is not looked
    up in (nor added to) the runner's cache of modules, on whose contents dynamo would guard: the second step
    compiled again."""
    from longattn import backends

    monkeypatch.setattr(backends, "_MODULES", {})
    q, k, v, kc, vc, _ = _inputs()
    counter = CompileCounter()
    compiled = _compiled(lambda q, kc, vc, lens: longattn.flash_attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, backend=backend), counter)
    for lens in ((3, 9), (4, 10), (5, 11)):
        compiled(q, kc, vc, _lens(*lens))
    assert counter.frame_count == 1


def _graph_ops(fn, *args):
    """The ops of the graph dynamo traces from ``fn(*args)`` (``fullgraph=True``)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _compiled(fn, keep)(*args)
    assert len(graphs) == 1
    return [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("append", [True, False])
def test_the_triton_decode_is_one_opaque_node(append):
    """Dynamo traces no launch of the Triton decode kernels: the graph calls the decode op once (the op that
    writes the caches only where new keys and values are appended), after the op checking the lengths' values."""
    q, k, v, kc, vc, table = _inputs(16)
    new = (k, v) if append else ()
    ops = _graph_ops(lambda q, kc, vc, lens: longattn.flash_attention_with_kvcache(
        q, kc, vc, *new, cache_seqlens=lens, block_table=table, backend="triton"), q, kc, vc, _lens(3, 9))
    decode_ops = [op for op in ops if "longattn" in str(op)]
    want = torch.ops.longattn.decode_append.default if append else torch.ops.longattn.decode.default
    assert decode_ops == [torch.ops.longattn.checked_lengths.default, want]


@pytest.mark.parametrize("page", [None, 16])
def test_the_decode_ops_declare_what_they_write_and_their_fake_shapes(page):
    """``torch.library.opcheck``: each op writes only the arguments it declares (the caches where it appends,
    ``out``), and its fake implementation gives the real one's shapes and dtypes."""
    q, k, v, kc, vc, table = _inputs(page)
    lens = _lens(5, 30)
    named = dict(scale=0.25, causal=True, window_left=-1, window_right=-1, segments=[], dilations=[],
                 head_starts=[], head_counts=[], offsets=[], page_size=page or 0, capacity=CAP, num_splits=0,
                 softcap=0.0)
    tests = ("test_schema", "test_faketensor")
    for op, new in ((entry.decode_op, (None, None)), (entry.decode_append_op, (k, v))):
        for return_lse in (True, False):
            args = (q, kc, vc, *new, lens, table, torch.empty_like(q), None, None, None, None)
            torch.library.opcheck(op, args, dict(named, return_lse=return_lse), test_utils=tests)
    torch.library.opcheck(torch.ops.longattn.checked_lengths.default, (q, kc, vc, k, v, None, lens, table, None),
                          dict(capacity=CAP, values=True, fn="f"), test_utils=tests)


def test_int_lengths_and_out_compile():
    """An int ``cache_seqlens`` (compiled at most twice: dynamo makes a varying int dynamic on its second value)
    and a given ``out`` (written in place, as eagerly), as the eager call."""
    q, k, v, kc, vc, _ = _inputs()

    def step(q, k, v, kc, vc, n, out):
        return longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, out=out, backend="triton")

    counter = CompileCounter()
    compiled = _compiled(step, counter)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    outs = [torch.zeros_like(q) for _ in range(2)]
    for n in (4, 9, 20):
        want = step(q, k, v, *caches[0], n, outs[0])
        got = compiled(q, k, v, *caches[1], n, outs[1])
        assert got is outs[1] and want is outs[0] and torch.equal(outs[0], outs[1])
        assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
    assert counter.frame_count <= 2


def test_the_dilated_decode_compiles():
    """LongNet's decode (its branches as the op's named parameters) with the log-sum-exp, as the eager call."""
    q, k, v, kc, vc, table = _inputs(16)

    def step(q, k, v, kc, vc, lens):
        return longattn.dilated_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                       segment_lengths=(8, 16), dilation_rates=(1, 2),
                                                       backend="triton", return_lse=True)

    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    want = step(q, k, v, *caches[0], _lens(5, 30))
    got = _compiled(step, "eager")(q, k, v, *caches[1], _lens(5, 30))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_compiled_call_still_checks_the_values_on_every_run(backend):
    """On a CPU the eager call checks the lengths and the block table on every call; the compiled one too (in the
    graph's ``longattn::checked_lengths``, before anything is written), with the same errors, and no recompilation
    for them; an int length past the capacity too."""
    q, k, v, kc, vc, table = _inputs(16)
    f = longattn.flash_attention_with_kvcache

    def step(q, kc, vc, lens, table):
        return f(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, backend=backend)

    counter = CompileCounter()
    compiled = _compiled(step, counter)
    compiled(q, kc, vc, _lens(3, 9), table)
    before = kc.clone()
    with pytest.raises(ValueError, match=r"must lie in \[0, 48\].*cache_seqlens=\[3, 48\]"):
        compiled(q, kc, vc, _lens(3, 48), table)
    with pytest.raises(ValueError, match="block_table entries must index the 8 pages"):
        compiled(q, kc, vc, _lens(3, 9), table + 3)
    with pytest.raises(ValueError, match="the pages a sequence appends to must be its own"):
        compiled(q, kc, vc, _lens(3, 3), table[[0, 0]])
    assert torch.equal(kc, before) and counter.frame_count == 1
    contiguous = _compiled(lambda q, kc, vc, n: f(q, kc, vc, k, v, cache_seqlens=n, backend=backend), "eager")
    _, _, _, kc, vc, _ = _inputs()
    for n in (3, 9):
        contiguous(q, kc, vc, n)
    with pytest.raises(ValueError, match=r"cache_seqlens=48 with 1 new tokens"):
        contiguous(q, kc, vc, 48)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_compiled_call_refuses_memory_that_the_eager_one_refuses(backend):
    """Appending into one memory as both caches, or an out that overlaps a cache, is refused eagerly (the checks
    read the tensors' memory, which tracing does not see); the compiled call refuses them in its graph's check,
    also on the SDPA route (``"auto"``: one new token, an int length), which reads no lengths tensor."""
    q, k, v, kc, _, _ = _inputs()
    fused = torch.stack([kc, kc], 0)
    step = _compiled(lambda q, k, v, kc, vc, out: longattn.flash_attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=3, backend=backend, out=out), "aot_eager")
    step(q, k, v, fused[0], fused[1], torch.empty_like(q))
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        step(q, k, v, fused[0], fused[0].view(fused[0].shape), torch.empty_like(q))
    with pytest.raises(ValueError, match="out overlaps v_cache in memory"):
        step(q, k, v, fused[0], fused[1], fused[1, :, :2].view(q.shape))


def test_inductor_writes_the_caches_in_place():
    """With inductor (what ``mode="reduce-overhead"`` compiles), the op writes the caches themselves, HF's
    ``(B, Hk, M, D)`` caches through their transposed views, with no copy in or out of the graph."""
    q, k, v, kc, vc, _ = _inputs()
    kh, vh = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()

    def step(q, k, v, kh, vh, lens):
        return longattn.flash_attention_with_kvcache(q, kh.transpose(1, 2), vh.transpose(1, 2), k, v,
                                                     cache_seqlens=lens, backend="triton")

    from torch._inductor.utils import run_and_get_code

    want_caches = (kh.clone(), vh.clone())
    want = step(q, k, v, *want_caches, _lens(7, 40))
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(step, fullgraph=True), q, k, v, kh, vh, _lens(7, 40))
    assert torch.equal(got, want) and torch.equal(kh, want_caches[0]) and torch.equal(vh, want_caches[1])
    code = "".join(code)
    assert "longattn.decode_append" in code and "copy_" not in code


def test_float8_caches_and_score_modifications_compile():
    """Float8 caches with their factors, and attention sinks, soft-capping and ALiBi: the compiled call gives the
    eager call's output, bitwise."""
    q, k, v, kc, vc, _ = _inputs()
    f8 = torch.float8_e4m3fn
    slopes, sinks = torch.rand(HQ), torch.randn(HQ)
    factors = dict(k_descale=torch.full((1,), 0.5), v_descale=torch.rand(B, HK) + 0.5)

    def step(q, k, v, kc, vc, lens):
        fp8 = longattn.flash_attention_with_kvcache(q, kc.to(f8), vc.to(f8), k.to(f8), v.to(f8), cache_seqlens=lens,
                                                    backend="triton", **factors)
        mods = longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="triton", sinks=sinks,
                                                     softcap=5.0, alibi_slopes=slopes, return_lse=True)
        return fp8, *mods

    want = step(q, k, v, kc, vc, _lens(7, 40))
    got = _compiled(step, "eager")(q, k, v, kc, vc, _lens(7, 40))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_compiled_packed_call_still_reads_its_boundaries():
    """The KV-cache decode traces without reading values; other functions that read values on the host (a packed
    batch's ``cu_seqlens``) still do under ``torch.compile``, with a graph break: the eager call's answer and its
    refusal of boundaries that do not end at the packed length, not a claim that they hold no values."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 16, generator=g) for _ in range(3))

    def packed(q, k, v, cu):
        return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="torch")

    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(packed, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, cu), packed(q, k, v, cu))
    with pytest.raises(ValueError, match="must end at the packed length 10, got 9"):
        compiled(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32))
