"""longattn.explain and longattn.routing: the plan of a dense, packed, dilated and decode call names each pass's
kernel and why the others were not chosen, planned for this CPU and for made-up sm_90 device facts; routing changes
last for their ``with`` block only."""
import pytest
import torch

import longattn
from longattn.backends.device import Device
from longattn.backends.triton import planner
from longattn.backends.triton.tiles import Tiles

SM90 = Device(capability=(9, 0), interpret=False, gluon=True)


def _qkv(b=1, n=64, h=2, d=64, dtype=torch.float16, grad=False):
    return [torch.randn(b, n, h, d, dtype=dtype, requires_grad=grad) for _ in range(3)]


def test_dense_call_on_cpu_names_the_backends_not_chosen():
    q, k, v = _qkv(dtype=torch.float32)
    plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True)
    assert plan.backend == "sdpa" and plan.passes == ()
    q, k, v = _qkv(dtype=torch.float32)
    plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True, backend="triton")
    assert plan.backend == "triton" and plan.kernel("fwd") == planner.TRITON_FWD
    assert plan.pass_("fwd").rejected[0].reason == "not a Hopper (sm_90) GPU"
    assert [r.kernel for r in plan.rejected] == ["sdpa", "fa4"]
    assert plan.rejected[1].reason == "backend='triton'"
    assert "fwd: triton_fwd" in str(plan) and "not gluon_fwd_sm90: not a Hopper (sm_90) GPU" in str(plan)


def test_dense_call_planned_for_sm90_names_the_gluon_kernels_and_their_tiles():
    q, k, v = _qkv(n=5000, d=128, grad=True)
    with longattn.routing(device=SM90):
        plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True, backend="triton")
    assert plan.kernel("fwd") == planner.GLUON_FWD and plan.kernel("bwd") == planner.GLUON_FUSED_BWD
    assert plan.pass_("fwd").chosen.option("tiles").sub_m == 64 and plan.device == "sm_90"
    # D=64 on a short call: the Triton forward with its sm90 tiles, and the two backward passes
    q, k, v = _qkv(n=1000, d=64, grad=True)
    with longattn.routing(device=SM90):
        plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True, backend="triton")
    assert plan.kernel("fwd") == planner.TRITON_FWD
    assert plan.pass_("fwd").rejected[0].reason == "fewer than 1024 keys a query at head dim 64"
    assert plan.kernel("bwd") == planner.TRITON_TWO_PASS and plan.kernel("dkdv") == "triton_dkdv"
    assert "fewer than 512 query rows a key" in plan.pass_("bwd").rejected[0].reason
    assert plan.pass_("fwd").chosen.option("tiles").block_m == 64  # sm90, D=64, causal, short: (64, 64, 4, 3)
    with longattn.routing(device=SM90, min_keys={}, fused_bwd_min_rows={}):  # the thresholds, routed
        plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True, backend="triton")
    assert plan.kernel("fwd") == planner.GLUON_FWD and plan.kernel("bwd") == planner.GLUON_WIDE_BWD
    assert "bwd: gluon_wide_bwd_sm90" in str(plan)
    with longattn.routing(device=SM90, gluon=False):
        plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True, backend="triton")
    assert plan.pass_("fwd").rejected[0].reason == "routing gluon=False"


def test_explain_says_why_sdpa_does_not_compute_a_call():
    """The reason SDPA was passed over names what it lacks (it said only "does not compute this call exactly")."""
    q, k, v = _qkv(dtype=torch.float32)
    reason = {"window": lambda: longattn.explain(longattn.flash_attention, q, k, v, window=(8, 0)),
              "lse": lambda: longattn.explain(longattn.flash_attention, q, k, v, return_lse=True),
              "causal": lambda: longattn.explain(longattn.flash_attention, q, k[:, :40], v[:, :40], causal=True),
              "softcap": lambda: longattn.explain(longattn.flash_attention, q, k, v, softcap=30.0),
              "blocks": lambda: longattn.explain(longattn.block_sparse_attention, q, k, v,
                                                 block_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), block_size=16)}
    want = {"window": "a sliding window", "lse": "the log-sum-exp is asked for", "causal": "causal with N != M",
            "softcap": "soft-capping", "blocks": "block-sparse attention"}
    for name, plan in reason.items():
        why = plan().rejected[0]
        assert why.kernel == "sdpa" and why.reason.startswith("PyTorch's SDPA does not compute this call exactly: ")
        assert want[name] in why.reason, (name, why.reason)


def test_packed_call_plan():
    cu = torch.tensor([0, 300, 400], dtype=torch.int32)
    q, k, v = (torch.randn(400, 2, 128, dtype=torch.float16) for _ in range(3))
    with longattn.routing(device=SM90):
        plan = longattn.explain(longattn.flash_attention_varlen, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=300, max_seqlen_k=300, backend="triton")
        assert plan.kernel("fwd") == planner.GLUON_FWD  # (D=128: packed schedule 1, short sequences too)
        with longattn.routing(packed_schedule=0):
            plan = longattn.explain(longattn.flash_attention_varlen, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=300, max_seqlen_k=300, backend="triton")
        assert plan.pass_("fwd").rejected[0].reason == "packed sequences of fewer than 512 query rows on average"
        with longattn.routing(packed_schedule=0, packed_min_mean_rows=100):
            plan = longattn.explain(longattn.flash_attention_varlen, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=300, max_seqlen_k=300, backend="triton")
        assert plan.kernel("fwd") == planner.GLUON_FWD
    plan = longattn.explain(longattn.flash_attention_varlen, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                            max_seqlen_q=300, max_seqlen_k=300)
    assert plan.backend == "torch" and [r.kernel for r in plan.rejected] == ["sdpa", "fa4", "triton"]


def test_dilated_call_plans_one_forward_per_branch():
    q, k, v = _qkv(n=64, d=64)
    with longattn.routing(device=SM90, min_keys={}):
        plan = longattn.explain(longattn.dilated_attention, q, k, v, segment_lengths=[16, 32],
                                dilation_rates=[1, 2], backend="triton")
    assert [p.name for p in plan.passes] == ["fwd", "fwd[1]"]
    assert all(p.chosen.kernel == planner.TRITON_FWD for p in plan.passes)
    assert plan.pass_("fwd").rejected[0].reason == "a segmented or dilated view"
    assert plan.pass_("fwd[1]").rejected[0].reason == "merged or block-list launch"


def test_decode_call_plan_and_explain_runs_nothing():
    k_cache, v_cache = (torch.zeros(2, 128, 2, 64, dtype=torch.float16) for _ in range(2))
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([5, 9], dtype=torch.int32)
    plan = longattn.explain(longattn.flash_attention_with_kvcache, q, k_cache, v_cache, k_new, v_new,
                            cache_seqlens=lens, backend="triton")
    assert plan.kernel("decode") == planner.TRITON_DECODE and plan.pass_("decode").chosen.option("splits") >= 1
    assert not k_cache.any()  # nothing appended: no kernel ran


def test_routing_is_scoped_and_checked():
    assert longattn.routing.__doc__
    with longattn.routing(packed_min_mean_rows=3) as r:
        assert r.packed_min_mean_rows == 3
        with longattn.routing(gluon=False) as inner:
            assert inner.packed_min_mean_rows == 3 and inner.gluon is False
    from longattn.backends.routing import current
    assert current().packed_min_mean_rows == 512 and current().gluon is None
    with pytest.raises(TypeError, match="MIN_KEYS"):
        with longattn.routing(MIN_KEYS={}):
            pass


def test_explain_refuses_a_function_that_runs_no_call():
    with pytest.raises(ValueError, match="ran no attention call"):
        longattn.explain(lambda: None)


def test_the_backward_plans_under_the_routing_its_forward_ran_with_on_any_thread(monkeypatch):
    """Autograd runs a CUDA call's backward on a device thread, where the caller's ``longattn.routing`` context
    is not set: the backward must still plan under the routing the forward ran with. On the CPU the same is seen
    by running ``backward()`` on another thread."""
    import threading

    from longattn.backends import routing as routing_mod
    from longattn.backends.triton import entry

    seen = []
    real = entry.backward

    def spy(*args, **kwargs):
        seen.append(routing_mod.current())
        return real(*args, **kwargs)

    monkeypatch.setattr(entry, "backward", spy)
    q, k, v = (torch.randn(1, 24, 2, 16, requires_grad=True) for _ in range(3))
    with longattn.routing(packed_min_mean_rows=7):
        out = longattn.flash_attention(q, k, v, backend="triton")
    worker = threading.Thread(target=lambda: out.sum().backward())
    worker.start()
    worker.join(timeout=120)
    assert len(seen) == 1 and seen[0].packed_min_mean_rows == 7
    assert q.grad is not None


def test_plan_key_changes_with_every_field_of_the_call():
    """The plan cache's key of a call (:func:`planner.call_key`) has one entry per field of AttentionCall, and a
    change to any field (or to a nested description's field) gives another key: a plan is never reused for a call
    it was not made for. A field added to AttentionCall fails here until the key and this list take it."""
    import dataclasses

    from longattn.backends.triton.lists import BlockLists
    from longattn.call import AttentionCall, BlockSparse, Branch, Descale, KVCache, SeqLens

    t = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype)  # noqa: E731
    i32 = lambda *shape: t(*shape, dtype=torch.int32)  # noqa: E731
    lists = BlockLists(i32(1, 1, 2, 2), i32(1, 1, 2, 2), i32(1, 1, 2, 2), i32(1, 1, 2, 2))
    seqlens = SeqLens(i32(3), i32(3), 8, 8)
    cache = KVCache(t(2, 8, 1, 4), t(2, 8, 1, 4), None, None, i32(2), None, None, 0, 8)
    base = AttentionCall(scale=0.5)
    changed = {
        "scale": [0.25], "causal": [True], "window": [(3, 0)],
        "branches": [(Branch(16, 1, 0, 2),), (Branch(16, 2, 0, 2),)],
        "blocks": [BlockSparse(None, (16, 16)), BlockSparse(None, (16, 32)), BlockSparse(None, (16, 16), lists),
                   BlockSparse(None, (16, 16), BlockLists(lists.kv_num, lists.kv_idx, None, None))],
        "seqlens": [seqlens, dataclasses.replace(seqlens, max_q=7), dataclasses.replace(seqlens, cu_q=i32(4))],
        "cache": [cache, dataclasses.replace(cache, num_splits=2), dataclasses.replace(cache, k_cache=t(2, 8, 1, 8))],
        "descale": [Descale(t(1)), Descale(t(2, 1))], "out_dtype": [torch.float16], "deterministic": [True],
        "sinks": [t(2)], "softcap": [30.0], "alibi": [t(1, 2)], "alibi_offset": [3], "need_lse": [False],
    }
    names = [f.name for f in dataclasses.fields(AttentionCall)]
    assert sorted(changed) == sorted(names), "a field of AttentionCall the plan key does not cover (or a stale one)"
    assert len(planner.call_key(base)) == len(names)
    keys = {planner.call_key(base)}
    for name in names:
        for value in changed[name]:
            key = planner.call_key(dataclasses.replace(base, **{name: value}))
            assert key not in keys, f"changing {name} to {value!r} left the plan key as it was"
            keys.add(key)
            hash(key)
    assert planner.call_key(dataclasses.replace(base, causal=True)) == planner.call_key(
        dataclasses.replace(base, causal=True))  # (equal calls share a key: plans are kept)


def test_plan_lookup_keys_on_the_tensors_routing_and_environment(monkeypatch):
    """A planned forward is found again for the same inputs; other strides, alignment, routing or LONGATTN_GLUON
    plan anew."""
    from longattn.call import AttentionCall

    planner.clear()
    q, k, v = _qkv(n=64, d=64)
    call = AttentionCall(scale=0.125, causal=True)
    first = planner.forward(q, k, v, call)
    assert planner.forward(q, k, v, call) is first and len(planner.PLANS) == 1
    planner.forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, call)  # other strides
    assert len(planner.PLANS) == 2
    planner.forward(torch.randn(1 * 64 * 2 * 64 + 1, dtype=torch.float16)[1:].view(1, 64, 2, 64), k, v, call)
    assert len(planner.PLANS) == 3  # (misaligned)
    with longattn.routing(packed_min_mean_rows=7):
        planner.forward(q, k, v, call)
    assert len(planner.PLANS) == 4
    monkeypatch.setenv("LONGATTN_GLUON", "0")
    planner.forward(q, k, v, call)
    assert len(planner.PLANS) == 5
    with longattn.routing(gluon=False):
        planner.forward(q, k, v, call)
        monkeypatch.setenv("LONGATTN_GLUON", "1")  # (not read: the routing decides)
        planner.forward(q, k, v, call)
    assert len(planner.PLANS) == 6


def test_device_facts_follow_the_interpreter_switch(monkeypatch):
    from longattn.backends.device import facts

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert facts(torch.device("cpu")).interpret and facts(torch.device("cpu")) is facts(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not facts(torch.device("cpu")).interpret


def test_decode_plan_names_the_backends_tried_for_the_backend_asked():
    """A KV-cache call's plan names SDPA, Triton and the PyTorch backend as the dispatch tried them for the backend
    the caller asked, with the reasons of this call (not those of ``backend="auto"``)."""
    k_cache, v_cache = (torch.zeros(2, 128, 2, 64, dtype=torch.float16) for _ in range(2))
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    lens = torch.tensor([5, 9], dtype=torch.int32)

    def plan(backend, cache_seqlens=lens, **kw):
        return longattn.explain(longattn.flash_attention_with_kvcache, q, k_cache, v_cache,
                                cache_seqlens=cache_seqlens, backend=backend, **kw)

    p = plan("triton")
    assert p.backend == "triton" and [(r.kernel, r.reason) for r in p.rejected] == [("sdpa", "backend='triton'")]
    p = plan("torch")
    assert p.backend == "torch" and [(r.kernel, r.reason) for r in p.rejected] == [
        ("sdpa", "backend='torch'"), ("triton", "backend='torch'")]
    p = plan("auto")  # lengths in a tensor: not SDPA's; a CPU tensor: not Triton's either
    assert p.backend == "torch" and [(r.kernel, r.reason) for r in p.rejected] == [
        ("sdpa", "PyTorch's SDPA does not compute this call exactly (cache lengths per sequence in a tensor)"),
        ("triton", "not a CUDA tensor (the interpreter is never an automatic choice)")]
    p = plan("auto", cache_seqlens=9)  # one new token against a cache of a known length: SDPA's
    assert p.backend == "sdpa" and p.rejected == ()
    p = plan("auto", cache_seqlens=9, return_lse=True)
    assert p.backend == "torch" and "the log-sum-exp is asked for" in p.rejected[0].reason


@pytest.mark.parametrize("settings,error", [
    (dict(gluon="no"), "gluon must be True, False or None"),  # a string would count as true: Gluon on
    (dict(tma=1), "tma must be True, False or None"),
    (dict(torch_score_budget=-5), "torch_score_budget must be an int >= 1"),
    (dict(tiles=5), "tiles must be a mapping"),
    (dict(tiles={"fwd": (64, 64)}), "tiles maps pass names to Tiles"),
    (dict(min_keys=-1), "min_keys must be a mapping"),
    (dict(fused_bwd_min_rows={64: -1}), "fused_bwd_min_rows maps head dims"),
    (dict(wide_bwd_head_dims=(True,)), "wide_bwd_head_dims must be a sequence of positive ints"),
    (dict(wide_bwd_min_rows=-1), "wide_bwd_min_rows must be an int >= 0"),
    (dict(wide_bwd_host_descriptors=1), "wide_bwd_host_descriptors must be True or False"),
    (dict(fused_bwd_host_descriptor_head_dims=(256,)), "fused_bwd_host_descriptor_head_dims takes head dims 64"),
    (dict(device="sm90"), "device must be a longattn.backends.device.Device"),
    # a misspelt pass would force nothing, silently; a tile no kernel can take would fail inside Triton
    (dict(tiles={"bwd": Tiles(64, 64, 4, 2)}), "tiles maps the passes .* got pass 'bwd'"),
    (dict(tiles={"fwd": Tiles(48, 64, 4, 2)}), r"tiles\['fwd'\].block_m must be a power of two, got 48"),
    (dict(tiles={"dkdv": Tiles(64, 8, 4, 2)}), r"tiles\['dkdv'\].block_n must be at least 16, got 8"),
    (dict(tiles={"decode": Tiles(64, 64, 3, 2)}), r"tiles\['decode'\].num_warps must be a power of two"),
    (dict(tiles={"dq": Tiles(64, 64, 4, 0)}), r"tiles\['dq'\].num_stages must be an int >= 1"),
])
def test_routing_refuses_values_it_cannot_mean(settings, error):
    with pytest.raises((TypeError, ValueError), match=error):
        with longattn.routing(**settings):
            pass


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_explain_of_a_zero_size_call_says_so(backend):
    """A call with no queries runs no kernel whatever the backend: explain says that, not a dispatch table's word."""
    q, k, v = torch.randn(1, 0, 1, 16), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    plan = longattn.explain(longattn.flash_attention, q, k, v, backend=backend)
    assert plan.backend == "torch"
    assert plan.rejected and all("zero-size call" in r.reason for r in plan.rejected)


@pytest.mark.parametrize("empty", ["batch", "capacity"])
def test_explain_of_a_zero_size_kvcache_call_plans_it_and_writes_nothing(empty):
    """A KV-cache call with no sequence or no key returns zeros without a backend: explain gives that plan (not 'ran
    no attention call'), and leaves the caller's ``out`` as it was."""
    q, k_cache = torch.randn(1, 1, 2, 16), torch.randn(1, 8, 2, 16)
    if empty == "batch":
        q, k_cache = q[:0], k_cache[:0]
    else:
        k_cache = k_cache[:, :0]
    out = torch.full(q.shape, 5.0)
    plan = longattn.explain(longattn.flash_attention_with_kvcache, q, k_cache, k_cache, cache_seqlens=0, out=out)
    assert plan.backend == "torch" and all("zero-size call" in r.reason for r in plan.rejected)
    assert (out == 5.0).all()


def test_explain_plans_the_explicit_passes_without_running_them(monkeypatch):
    """``longattn.ops``' forward and backward are planned like the public calls (the forward without a backward,
    the backward with it), and no backend runs."""
    from longattn import ops
    from longattn.backends.triton import entry
    monkeypatch.setattr(entry, "forward", None)  # a kernel launch would fail
    monkeypatch.setattr(entry, "backward", None)
    q, k, v = _qkv(n=64, d=64, dtype=torch.float32)
    plan = longattn.explain(ops.attention_forward, q, k, v, causal=True, backend="triton")
    assert plan.backend == "triton" and [p.name for p in plan.passes] == ["fwd"]
    assert [r.kernel for r in plan.rejected] == ["sdpa", "fa4"]
    assert plan.rejected[0].reason == "backend='triton'"
    o, lse = torch.zeros_like(q), torch.zeros(1, 2, 64)
    plan = longattn.explain(ops.attention_backward, q, q, k, v, o, lse, causal=True, backend="triton")
    assert "fwd" not in [p.name for p in plan.passes] and plan.kernel("bwd") == planner.TRITON_TWO_PASS
    # what the ring's blocks ask for (float32 gradients): the backward's own plan, on an sm_90 as on the GPU
    q, k, v = (torch.randn(1, 4096, 8, 64, dtype=torch.float16) for _ in range(3))
    o, lse = torch.zeros_like(q), torch.zeros(1, 8, 4096)
    with longattn.routing(device=SM90):
        for grad_dtype, kernel in ((None, planner.GLUON_WIDE_BWD), (torch.float32, planner.GLUON_FUSED_BWD)):
            plan = longattn.explain(ops.attention_backward, q, q, k, v, o, lse, backend="triton",
                                    grad_dtype=grad_dtype)
            assert plan.kernel("bwd") == kernel, (grad_dtype, str(plan))
        plan = longattn.explain(ops.attention_backward, q, q, k, v, o, lse, backend="auto")
        assert plan.rejected[0].reason == "explicit forward or backward passes (SDPA runs whole calls)"


@pytest.mark.parametrize("facts,error", [
    (dict(gluon="no"), "gluon must be True or False or None, got 'no'"),  # ("no" would count as Gluon available)
    (dict(cuda=1), "cuda must be True or False, got 1"),
    (dict(interpret="1"), "interpret must be True or False"),
    (dict(capability=(9,)), r"capability must be a \(major, minor\) pair of ints >= 0, got \(9,\)"),
    (dict(capability="90"), "capability must be a"),
])
def test_made_up_device_facts_are_checked(facts, error):
    """``routing(device=Device(...))``'s facts are checked where they are made: a string ``gluon`` would plan the
    Gluon kernels as importable, a capability that is no pair would fail in the middle of a plan."""
    with pytest.raises(TypeError, match=error):
        Device(**facts)
    assert Device(capability=(8, 9), interpret=True, gluon=None).arch == "sm80"


def test_a_plan_names_the_backward_a_loss_on_the_log_sum_exp_runs(monkeypatch):
    """A call returning its log-sum-exp runs another backward where the loss reads that log-sum-exp (the 128 x 128
    backward takes no upstream gradient of it; the fused one does): the plan names both, and each is what runs."""
    from longattn.backends.gluon import launch as gluon_launch

    ran = []

    def stand_in(kernel):
        def launch(do, q, k, v, *args, **kwargs):
            ran.append(kernel)
            return tuple(torch.zeros_like(x) for x in (q, k, v))
        return launch

    monkeypatch.setattr(gluon_launch, "wide_backward", stand_in(planner.GLUON_WIDE_BWD))
    monkeypatch.setattr(gluon_launch, "fused_backward", stand_in(planner.GLUON_FUSED_BWD))
    q, k, v = _qkv(n=32, d=64, grad=True)
    with longattn.routing(device=Device(capability=(9, 0), interpret=True, gluon=True), fused_bwd_min_rows={}):
        plan = longattn.explain(longattn.flash_attention, q, k, v, causal=True, return_lse=True, backend="triton")
        assert plan.kernel("bwd") == planner.GLUON_WIDE_BWD and plan.kernel("bwd+dlse") == planner.GLUON_FUSED_BWD
        assert "bwd+dlse: gluon_fused_bwd_sm90\n  not gluon_wide_bwd_sm90: an upstream gradient of the log-sum-exp" \
            in str(plan)
        for loss in (lambda o, lse: o.float().sum(), lambda o, lse: o.float().sum() + lse.sum()):
            loss(*longattn.flash_attention(q, k, v, causal=True, return_lse=True, backend="triton")).backward()
        assert ran == [planner.GLUON_WIDE_BWD, planner.GLUON_FUSED_BWD]
        # without return_lse, or where both backwards are one kernel, the plan has no second backward
        for kw in (dict(return_lse=False), dict(return_lse=True, window=(8, 0))):
            plan = longattn.explain(longattn.flash_attention, q, k, v, backend="triton", **kw)
            assert "bwd+dlse" not in [p.name for p in plan.passes]


def test_explain_plans_a_compiled_function_without_running_it(monkeypatch):
    """``torch.compile`` tracing reads no planning flag: explain runs the function eagerly, so that it plans the
    call instead of running it compiled (and then saying it ran no attention call)."""
    from longattn.backends import backend_module

    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("torch.compiler.set_stance: PyTorch 2.6 and newer")
    monkeypatch.setattr(backend_module("torch"), "attention", None)  # running the call would fail
    q, k, v = _qkv(n=16, d=16, dtype=torch.float32)
    compiled = torch.compile(lambda q, k, v: longattn.flash_attention(q, k, v, window=(4, 0)))
    plan = longattn.explain(compiled, q, k, v)
    assert plan.backend == "torch" and [r.kernel for r in plan.rejected] == ["sdpa", "fa4", "triton"]


def test_a_call_run_under_made_up_device_facts_says_so():
    """Made-up sm_90 facts plan the Gluon forward for CPU tensors (what ``explain`` is for); running that call
    launched it and failed in ``torch.cuda`` with 'Torch not compiled with CUDA enabled'. The error names the
    routing."""
    q, k, v = _qkv(n=32, d=128)
    with longattn.routing(device=Device(capability=(9, 0), interpret=True, gluon=True)):
        assert longattn.explain(longattn.flash_attention, q, k, v, backend="triton").kernel("fwd") == planner.GLUON_FWD
        with pytest.raises(ValueError, match=r"cannot run on cpu tensors: .*made-up device facts \(longattn\.routing"):
            longattn.flash_attention(q, k, v, backend="triton")
