"""GPU tests of flash_attention_with_kvcache: bf16 against the float32 reference, paged and contiguous, and a
decode step captured in a CUDA graph and replayed."""
import pytest
import torch

import _rows as rows

import longattn
from longattn import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(B, n_q, hq, hk, d, cap, page, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = r(B, n_q, hq, d), r(B, n_q, hk, d), r(B, n_q, hk, d)
    if page is None:
        return q, k, v, r(B, cap, hk, d), r(B, cap, hk, d), None
    per = -(-cap // page)
    table = torch.randperm(B * per + 5, device="cuda", generator=g)[:B * per].view(B, per).to(torch.int32)
    return q, k, v, r(B * per + 5, page, hk, d), r(B * per + 5, page, hk, d), table


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [None, 256, 16])
@pytest.mark.parametrize("n_q,hq,hk", [(1, 32, 8), (5, 8, 8), (16, 12, 4)])
def test_kvcache_bf16(d, page, n_q, hq, hk):
    q, k, v, kc, vc, table = _inputs(3, n_q, hq, hk, d, 3000, page, seed=d)
    seqlens = torch.tensor([0, 1234, 3000 - n_q], dtype=torch.int32, device="cuda")
    want, want_lse = ref.flash_attention_with_kvcache(q.float(), kc.float(), vc.float(), k.float(), v.float(),
                                                      cache_seqlens=seqlens, block_table=table, return_lse=True)
    out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                     return_lse=True)
    err = rows.rel(out, want)
    assert err < 1e-2
    assert (lse - want_lse).abs().max().item() < 2e-2


@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("n_q", [1, 4, 8])
@pytest.mark.parametrize("hq", [32, 64])
def test_paged_decode_agrees_with_the_contiguous_cache(page, n_q, hq):
    """The same rows in a contiguous cache and in scattered pages (16 rows: a 128-key tile spans pages; 64; 256:
    a tile inside one page) give outputs within the reference's tolerance, each paged call with its page size's
    row of tiles (``decode_kind``); where that row has the contiguous row's tiles (on sm_90, "sm90_paged": the same
    tiles, more stages) the same split count and nearly the same output."""
    from longattn.backends.triton import decode_launch

    B, hk, d, cap = 2, 8, 128, 8192
    q, k, v, kp, vp, table = _inputs(B, n_q, hq, hk, d, cap, page, seed=page + n_q + hq)
    kc, vc = (x[table.long()].reshape(B, cap, hk, d) for x in (kp, vp))  # the same rows, contiguous
    seqlens = torch.tensor([4000, cap - n_q], dtype=torch.int32, device="cuda")
    want = ref.flash_attention_with_kvcache(q.float(), kc.float(), vc.float(), k.float(), v.float(),
                                            cache_seqlens=seqlens)
    got = {}
    for name, caches, bt in (("contiguous", (kc, vc), None), ("paged", (kp, vp), table)):
        call = dict(cache_seqlens=seqlens, block_table=bt, backend="triton")
        plan = longattn.explain(longattn.flash_attention_with_kvcache, q, *caches, k, v, **call).pass_("decode")
        out = longattn.flash_attention_with_kvcache(q, *caches, k, v, **call)
        got[name] = (out, plan.chosen.option("splits"), plan.chosen.option("block_n"))
        assert rows.rel(out, want) < 1e-2, name
    major, minor = torch.cuda.get_device_capability()
    row = decode_launch.DECODE_TILES[decode_launch.decode_kind(False, True, False, d, 2, f"sm{major}{minor}", page)]
    assert got["paged"][2] == row.block_n
    if got["paged"][2] == got["contiguous"][2]:
        assert got["paged"][1] == got["contiguous"][1]
        assert rows.rel(got["paged"][0], got["contiguous"][0]) < 1e-3


def _captured(step) -> torch.cuda.CUDAGraph:
    """``step`` run once (compilation), once on a side stream (warm-up, as CUDA graphs want), then captured."""
    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_kvcache_decode_step_in_a_cuda_graph():
    B, hq, hk, d, cap = 4, 16, 4, 128, 4096
    q, k, v, kc, vc, table = _inputs(B, 1, hq, hk, d, cap, 64)
    seqlens = torch.tensor([5, 100, 2000, 4000], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    kw = dict(cache_seqlens=seqlens, block_table=table, out=out)
    graph = _captured(lambda: longattn.flash_attention_with_kvcache(q, kc, vc, k, v, **kw))
    for step in range(3):  # replay with new tokens and advanced lengths
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        seqlens.add_(1)
        graph.replay()
        kc_ref = kc.clone()
        want = ref.flash_attention_with_kvcache(q.float(), kc_ref.float(), vc.float(), cache_seqlens=seqlens + 1,
                                                block_table=table)
        assert rows.rel(out, want) < 1e-2


def test_kvcache_debug_checks_values_on_the_gpu(monkeypatch):
    q, k, v, kc, vc, table = _inputs(2, 1, 8, 2, 64, 512, 64)
    bad = torch.tensor([3, 600], dtype=torch.int32, device="cuda")
    longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=bad, block_table=table)  # clamped, no error
    monkeypatch.setenv("LONGATTN_DEBUG", "1")
    with pytest.raises(ValueError, match="capacity"):
        longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=bad, block_table=table)
    with pytest.raises(ValueError, match="block_table entries"):
        longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=bad.clamp(max=500), block_table=table + 1000)


@pytest.mark.parametrize("page", [None, 64])
def test_kvcache_direct_launch_equals_the_jit_launch(monkeypatch, page):
    """Later calls of one signature launch the compiled kernels directly: bitwise the result of Triton's JIT launch,
    over decode steps whose lengths change (the values are not part of the plan)."""
    from longattn.backends.triton.decode_launch import PLANS

    def steps():
        q, k, v, kc, vc, table = _inputs(3, 2, 16, 4, 128, 1000, page, seed=7)
        seqlens = torch.tensor([0, 17, 500], dtype=torch.int32, device="cuda")
        outs = []
        for _ in range(4):
            outs.append(longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                             block_table=table, return_lse=True))
            seqlens += 2
        want = ref.flash_attention_with_kvcache(q.float(), kc.float(), vc.float(), cache_seqlens=seqlens,
                                                block_table=table)
        assert rows.rel(outs[-1][0], want) < 1e-2
        return outs, kc

    PLANS.clear()
    monkeypatch.setenv("LONGATTN_DIRECT_LAUNCH", "0")
    jit, kc_jit = steps()
    PLANS.clear()
    monkeypatch.setenv("LONGATTN_DIRECT_LAUNCH", "1")
    direct, kc_direct = steps()
    assert any(plan.split._proven for plan in PLANS.plans())  # a direct launch went through
    assert torch.equal(kc_jit, kc_direct)
    for (o1, l1), (o2, l2) in zip(jit, direct):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)


DILATED = [dict(segment_lengths=(256, 512, 1024), dilation_rates=(1, 2, 4)),
           dict(segment_lengths=(100, 300), dilation_rates=(3, 2), head_split=True)]


@pytest.mark.parametrize("kw", DILATED)
@pytest.mark.parametrize("page", [None, 64])
@pytest.mark.parametrize("n_q,hq,hk,d", [(1, 16, 16, 64), (4, 16, 4, 128)])
def test_dilated_kvcache_bf16(kw, page, n_q, hq, hk, d):
    q, k, v, kc, vc, table = _inputs(3, n_q, hq, hk, d, 3000, page, seed=d + n_q)
    seqlens = torch.tensor([0, 1234, 3000 - n_q], dtype=torch.int32, device="cuda")
    want, want_lse = ref.dilated_attention_with_kvcache(q.float(), kc.float(), vc.float(), k.float(), v.float(),
                                                        cache_seqlens=seqlens, block_table=table, return_lse=True,
                                                        **kw)
    out, lse = longattn.dilated_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                       return_lse=True, **kw)
    err = rows.rel(out, want)
    assert err < 1e-2
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=0)  # -inf where no branch selects the query


def test_dilated_decode_step_in_a_cuda_graph():
    B, hq, d = 2, 8, 64
    q, k, v, kc, vc, table = _inputs(B, 1, hq, hq, d, 2048, None, seed=3)
    seqlens = torch.tensor([10, 1500], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=seqlens, segment_lengths=(128, 512), dilation_rates=(1, 4), out=torch.empty_like(q))
    graph = _captured(lambda: longattn.dilated_attention_with_kvcache(q, kc, vc, k, v, **kw))
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        seqlens.add_(1)
        graph.replay()
        want = ref.dilated_attention_with_kvcache(q.float(), kc.float(), vc.float(), cache_seqlens=seqlens + 1,
                                                  segment_lengths=(128, 512), dilation_rates=(1, 4))
        assert rows.rel(kw["out"], want) < 1e-2


@pytest.mark.parametrize("page_size", [None, 64])
def test_longnet_generate_on_the_gpu(page_size):
    from longattn.models import LongNet, LongNetConfig

    torch.manual_seed(0)
    cfg = LongNetConfig(vocab_size=97, embed_dim=128, num_heads=4, num_kv_heads=2, num_layers=2,
                        segment_lengths=(64, 256), dilation_rates=(1, 4))
    model = LongNet(cfg, device="cuda").eval()
    with torch.no_grad():
        model.embedding.weight.mul_(8)
    tokens = torch.randint(0, 97, (2, 300), device="cuda")
    got = model.generate(tokens, 40, page_size=page_size)
    with torch.no_grad():  # teacher-forced: every generated token is the full forward's argmax (up to a near-tie)
        logits = model(got[:, :-1])[:, 299:].float()
    picked = logits.gather(-1, got[:, 300:, None])[..., 0]
    assert (picked >= logits.max(-1).values - 1e-3 * logits.abs().max()).all()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("page", [None, 16])
def test_a_compiled_decode_step_matches_the_eager_one(page, mode):
    """A serving loop compiles its decode step (``fullgraph=True``; with ``mode="reduce-overhead"`` replayed as a
    CUDA graph, its caches marked static as transformers' static cache marks them): with per-sequence lengths in
    a tensor and new tokens appended, each of four steps (the lengths one longer each) gives the eager call's output
    and cache contents, compiled once."""
    from torch._dynamo.utils import counters

    q, k, v, kc, vc, table = _inputs(2, 1, 8, 2, 128, 512, page, seed=3)

    def step(q, k, v, kc, vc, seqlens):
        return longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)

    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    for c in caches[1] if mode else ():
        torch._dynamo.mark_static_address(c)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for i in range(4):
        seqlens = torch.tensor([100 + i, 507 + i], dtype=torch.int32, device="cuda")
        want = step(q, k, v, *caches[0], seqlens)
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(q, k, v, *caches[1], seqlens).clone()
        assert rows.rel(got, want) < 1e-3
        assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("page", [None, 16, 256])
@pytest.mark.parametrize("n_q,hq", [(1, 32), (4, 64), (8, 8)])
@pytest.mark.parametrize("B,cap", [(17, 3000), (18, 2048), (40, 1000), (64, 1024)])
def test_decode_of_more_programs_than_sms_on_narrow_programs(B, cap, n_q, hq, page):
    """Single-query steps whose (sequence, KV head) programs outnumber the SMs over short caches run the many-programs
    row of their GPU where it has one (sm_90: 64-key tiles, K and V by TMA up to 1.2 programs an SM on contiguous
    caches, 32-key tiles of 2 warps beyond three, ``decode_launch.MANY_PROGRAMS``); the result stays within the
    reference's tolerance, appended new tokens, empty and full sequences among them."""
    from longattn.backends.triton import decode_launch

    hk, d = 8, 128
    q, k, v, kc, vc, table = _inputs(B, n_q, hq, hk, d, cap, page, seed=B + n_q)
    seqlens = torch.arange(B, device="cuda", dtype=torch.int32) * (cap - n_q) // (B - 1)
    want = ref.flash_attention_with_kvcache(q.float(), kc.float(), vc.float(), k.float(), v.float(),
                                            cache_seqlens=seqlens, block_table=table)
    call = dict(cache_seqlens=seqlens, block_table=table, backend="triton")
    plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, k, v, **call).pass_("decode").chosen
    out = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, **call)
    assert rows.rel(out, want) < 1e-2
    major, minor = torch.cuda.get_device_capability()
    kind = decode_launch.decode_kind(False, page is not None, False, d, 2, f"sm{major}{minor}", page or 0)
    kind = decode_launch.many_programs_kind(kind, B * hk, cap, n_q, q.device)
    assert plan.option("block_n") == decode_launch.DECODE_TILES[kind].block_n
    assert plan.option("tma") == (decode_launch.DECODE_TILES[kind].tma and page is None)
    if (major, minor) == (9, 0) and n_q == 1:
        assert kind.endswith(("_many", "_most", "_many_tma"))


@pytest.mark.parametrize("kw", [{}, {"softcap": 20.0, "window": (700, 0)}, {"sinks": True}, {"alibi": True}])
@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("n_q,hq,d", [(1, 32, 128), (4, 64, 128), (2, 16, 64)])
def test_decode_by_descriptors_matches_decode_by_pointers(n_q, hq, d, splits, kw):
    """The split kernel with K and V by tensor descriptors (``DecodeTiles.tma`` in every row) against the same plan
    by pointers, and both against the reference: contiguous caches holding NaN past every sequence's length (the
    descriptors end there), empty, partial and full sequences, several new queries, explicit splits, soft-capping
    with a window, sinks, ALiBi."""
    from longattn.backends.triton import decode_launch

    B, hk, cap = 19, 8, 1500
    q, k, v, kc, vc, _ = _inputs(B, n_q, hq, hk, d, cap, None, seed=n_q + d)
    seqlens = torch.arange(B, device="cuda", dtype=torch.int32) * (cap - n_q) // (B - 1)
    for b, n in enumerate((seqlens + n_q).tolist()):
        kc[b, n:] = float("nan")
        vc[b, n:] = float("nan")
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, device="cuda")
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(B, hq, device="cuda") * 0.05
    want = ref.flash_attention_with_kvcache(q.float(), kc.nan_to_num().float(), vc.nan_to_num().float(), k.float(),
                                            v.float(), cache_seqlens=seqlens, **kw)
    outs = []
    for tma in (False, True):
        with decode_launch.tiles_set(tma=tma):
            caches = (kc.clone(), vc.clone())
            outs.append(longattn.flash_attention_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens,
                                                              num_splits=splits, backend="triton", **kw))
            assert [p.tma for p in decode_launch.PLANS.plans()] == [tma]
    for out in outs:
        assert not out.isnan().any()
        assert rows.rel(out, want) < 1e-2
    assert (outs[0].float() - outs[1].float()).abs().max().item() <= 1e-2
