"""flash_attention_with_kvcache: contiguous and paged caches, appended tokens, split-KV, against the
reference (which gathers each sequence's keys and never touches the caches). Triton runs in the interpreter."""
import itertools

import pytest
import torch

import longattn
from longattn import reference as ref


def _case(B=3, n_q=2, hq=4, hk=2, d=16, cap=70, page=None, dtype=torch.float64, seed=0, lens=(0, 37, 61)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n_q, hq, d, generator=g, dtype=dtype)
    k, v = (torch.randn(B, n_q, hk, d, generator=g, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor(lens[:B], dtype=torch.int32)
    if page is None:
        kc, vc = (torch.randn(B, cap, hk, d, generator=g, dtype=dtype) for _ in range(2))
        return q, k, v, kc, vc, seqlens, None
    pages_per = -(-cap // page)
    n_pages = B * pages_per + 3
    kc, vc = (torch.randn(n_pages, page, hk, d, generator=g, dtype=dtype) for _ in range(2))
    table = torch.randperm(n_pages, generator=g)[:B * pages_per].view(B, pages_per).to(torch.int32)
    return q, k, v, kc, vc, seqlens, table


def _descriptors() -> bool:
    """Whether this Triton has device-side tensor descriptors (what ``DecodeTiles.tma`` loads K and V by)."""
    import triton.language as tl
    return hasattr(tl, "make_tensor_descriptor")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("page", [None, 16, 7])
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("kw", [{}, {"window": (20, 0)}, {"causal": False}])
def test_kvcache_matches_the_reference(backend, page, append, kw):
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, kc, vc, seqlens, table = _case(page=page, dtype=dtype, seed=page or 0)
    want, want_lse = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(),
                                                      *((k.double(), v.double()) if append else ()),
                                                      cache_seqlens=seqlens, block_table=table, return_lse=True, **kw)
    kc0 = kc.clone()
    out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, *((k, v) if append else ()), cache_seqlens=seqlens,
                                                     block_table=table, return_lse=True, backend=backend,
                                                     num_splits=3, **kw)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse.double(), **tol)
    if append:  # the new rows were written at cache_seqlens, nothing else changed
        for b in range(q.shape[0]):
            rows = ref.cache_rows(kc, b, int(seqlens[b]) + q.shape[1], table)
            torch.testing.assert_close(rows[int(seqlens[b]):], k[b])
        changed = (kc != kc0).any(-1).any(-1).sum().item()
        assert changed <= q.shape[0] * q.shape[1]
    else:
        assert torch.equal(kc, kc0)


@pytest.mark.parametrize("splits", [0, 1, 5])
def test_kvcache_splits_gqa_and_strided_cache(splits):
    """The number of splits does not change the result; an HF-style (B, Hk, M, D) cache works as a view."""
    q, k, v, kc, vc, seqlens, _ = _case(B=2, n_q=1, hq=8, hk=2, d=32, cap=100, dtype=torch.float32, lens=(99, 3))
    kc_hf, vc_hf = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens)
    out = longattn.flash_attention_with_kvcache(q, kc_hf.transpose(1, 2), vc_hf.transpose(1, 2),
                                                cache_seqlens=seqlens, backend="triton", num_splits=splits)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_kvcache_bad_input_is_named():
    q, k, v, kc, vc, seqlens, table = _case(page=16)
    f = longattn.flash_attention_with_kvcache
    with pytest.raises(ValueError, match="capacity"):  # 69 cached + 2 new rows in a paged cache of 80 rows: fits
        f(q, kc, vc, k, v, cache_seqlens=torch.tensor([0, 3, 79], dtype=torch.int32), block_table=table)
    with pytest.raises(ValueError, match="block_table entries"):
        f(q, kc, vc, cache_seqlens=seqlens, block_table=table + 100)
    with pytest.raises(TypeError, match="cache_seqlens"):
        f(q, kc, vc, cache_seqlens=seqlens.float(), block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        f(q, kc, vc, cache_seqlens=seqlens[:2], block_table=table)
    with pytest.raises(ValueError, match="both k and v"):
        f(q, kc, vc, k, None, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match="inference only"):
        f(q.requires_grad_(), kc, vc, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match="num_splits"):
        f(q.detach(), kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=-1)
    with pytest.raises(ValueError, match="4 dims"):
        f(q[0].detach(), kc, vc, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match="head_dim differs: q has .*, k_cache and v_cache have"):
        f(q.detach()[..., :8], kc, vc, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(TypeError, match="q, k_cache, v_cache must share one dtype"):
        f(q.detach().to(torch.float16 if q.dtype != torch.float16 else torch.float32), kc, vc, cache_seqlens=seqlens,
          block_table=table)


@pytest.mark.parametrize("n_q,hq,hk,d,page", [(1, 8, 8, 64, 64), (17, 8, 2, 32, None), (4, 8, 1, 16, 256),
                                               (3, 4, 4, 40, 16)])
def test_kvcache_shapes_and_out(n_q, hq, hk, d, page):
    """Nq 1..17, GQA ratios 1/4/8, head dims that are and are not powers of two; ``out=`` is written in place,
    through its strides (here a transposed view)."""
    q, k, v, kc, vc, seqlens, table = _case(B=3, n_q=n_q, hq=hq, hk=hk, d=d, cap=300, page=page,
                                            dtype=torch.float32, seed=n_q, lens=(1, 0, 300 - n_q))
    want, want_lse = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                                      cache_seqlens=seqlens, block_table=table, return_lse=True)
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], d).transpose(1, 2)
    got, lse = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                     backend="triton", return_lse=True, out=out)
    assert got is out
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n_q,kw", [(1, {}), (3, {}), (3, {"causal": False}), (1, {"window": (5, 0)}),
                                     (2, {"window": (200, 1)})])
@pytest.mark.parametrize("page", [None, 16])
def test_kvcache_torch_path_full_caches(n_q, kw, page):
    """Every sequence at the same length (where the PyTorch path may drop the mask) and a partly used paged pool."""
    q, k, v, kc, vc, seqlens, table = _case(B=2, n_q=n_q, cap=64, page=page, seed=5, lens=(60, 60))
    want, want_lse = ref.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=seqlens,
                                                      block_table=table, return_lse=True, **kw)
    out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                     return_lse=True, backend="torch", **kw)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.to(lse.dtype))


# ------------------------------------------------------------------------------------------------- dilated decode
DILATED = [dict(segment_lengths=(8, 16, 40), dilation_rates=(1, 2, 4)),
           dict(segment_lengths=(12, 30), dilation_rates=(3, 2), head_split=True),
           dict(segment_lengths=(5,), dilation_rates=(2,))]


def test_dilated_kvcache_reference_is_the_tail_of_dilated_attention():
    """The reference's definition, checked once against dilated_attention on the concatenated sequence."""
    q, k, v, kc, vc, seqlens, _ = _case(B=1, n_q=3, hq=4, hk=2, cap=70, lens=(41,), seed=3)
    kw = DILATED[0]
    got = ref.dilated_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, **kw)
    n = 41 + 3
    keys, values = torch.cat([kc[0, :41], k[0]])[None], torch.cat([vc[0, :41], v[0]])[None]
    q_full = torch.cat([torch.randn(1, n - 3, 4, 16, dtype=q.dtype), q], dim=1)  # earlier queries do not matter
    want = ref.dilated_attention(q_full, keys, values, causal=True, **kw)[:, -3:]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kw", DILATED)
@pytest.mark.parametrize("page,append,n_q", [(None, True, 1), (16, True, 5), (7, False, 2), (None, False, 17)])
def test_dilated_kvcache_matches_the_reference(backend, kw, page, append, n_q):
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, kc, vc, seqlens, table = _case(B=3, n_q=n_q, hq=4, hk=2, cap=90, page=page, dtype=dtype, seed=n_q,
                                            lens=(0, 1, 90 - n_q) if append else (n_q + 2, 1, 66))
    new = (k, v) if append else ()
    want, want_lse = ref.dilated_attention_with_kvcache(q.double(), kc.double(), vc.double(),
                                                        *(x.double() for x in new), cache_seqlens=seqlens,
                                                        block_table=table, return_lse=True, **kw)
    out, lse = longattn.dilated_attention_with_kvcache(q, kc, vc, *new, cache_seqlens=seqlens, block_table=table,
                                                       return_lse=True, backend=backend, num_splits=2, **kw)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse.double(), **tol)


def test_dilated_kvcache_bad_input_is_named():
    q, k, v, kc, vc, seqlens, _ = _case()
    f = longattn.dilated_attention_with_kvcache
    with pytest.raises(ValueError, match="dilated_attention_with_kvcache: segment_lengths and dilation_rates"):
        f(q, kc, vc, cache_seqlens=seqlens, segment_lengths=(4, 8), dilation_rates=(1,))
    with pytest.raises(TypeError, match="head_split"):
        f(q, kc, vc, cache_seqlens=seqlens, segment_lengths=(4,), dilation_rates=(1,), head_split=1)
    with pytest.raises(ValueError, match="dilated_attention_with_kvcache: k_cache and v_cache"):
        f(q, kc, vc[:, :3], cache_seqlens=seqlens, segment_lengths=(4,), dilation_rates=(1,))


@pytest.mark.parametrize("fn,kw", [("flash", {"window": (9, 0)}), ("dilated", {"segment_lengths": (8, 16),
                                                                              "dilation_rates": (1, 2)})])
def test_growing_cache_keeps_its_plan_and_stays_exact(fn, kw):
    """A cache that is a new, longer tensor at every step (transformers' dynamic cache, seen through
    ``transpose(1, 2)``) is exact at every length on the Triton path, and its launch plans are shared: one per
    power-of-two length bucket and specialisation class, not one per length."""
    from longattn.backends.triton.decode_launch import PLANS

    B, hq, hk, d = 2, 4, 2, 16
    call = longattn.flash_attention_with_kvcache if fn == "flash" else longattn.dilated_attention_with_kvcache
    reference = ref.flash_attention_with_kvcache if fn == "flash" else ref.dilated_attention_with_kvcache
    PLANS.clear()
    keys = torch.randn(B, hk, 3, d)
    values = torch.randn(B, hk, 3, d)
    for m in range(3, 41):
        n_q = 3 if m % 5 == 0 else 1
        q = torch.randn(B, hq, n_q, d).transpose(1, 2)
        keys = torch.cat([keys, torch.randn(B, hk, 1, d)], 2)  # a new tensor each step
        values = torch.cat([values, torch.randn(B, hk, 1, d)], 2)
        kc, vc = keys.transpose(1, 2), values.transpose(1, 2)
        got = call(q, kc, vc, cache_seqlens=m + 1, backend="triton", **kw)
        want = reference(q.double(), kc.double(), vc.double(), cache_seqlens=m + 1, **kw)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # lengths 4..41: 5 power-of-two buckets x (multiple of 16 or not) x two query counts, at most
    assert 0 < len(PLANS) <= 5 * 2 * 2 + 2 < 38


@pytest.mark.parametrize("sms", [8, 108, 132])
def test_split_count_makes_at_most_four_waves(monkeypatch, sms):
    """Splits per (sequence, KV head): at most four programs per SM in all (a fifth, partial wave cost paged caches
    about 20% on an H100), at least one, no split shorter than four key blocks, one split once the (sequence,
    KV head) programs alone fill two per SM."""
    from longattn.backends.triton import decode_launch as D

    monkeypatch.setattr(D, "_sm_count", lambda device: sms)
    cpu = torch.device("cpu")
    for batch in (1, 2, 3, 8, 13, 64):
        for kv_heads in (1, 2, 8):
            for capacity in (1, 100, 4096, 131072):
                programs = batch * kv_heads
                s = D.choose_splits(batch, kv_heads, capacity, cpu)
                assert s >= 1
                if programs >= 2 * sms:
                    assert s == 1
                    continue
                assert programs * s <= max(4 * sms, programs)
                assert s == 1 or s * 4 * D.BLOCK_N <= capacity + 4 * D.BLOCK_N - 1
    monkeypatch.setattr(D, "_sm_count", lambda device: 132)
    assert D.choose_splits(8, 8, 32768, cpu) == 8  # the B=8 row of the decode table: 512 programs, not 576


@pytest.mark.parametrize("sms", [78, 132])
def test_hopper_decode_splits_end_earliest(monkeypatch, sms):
    """The sm_90 rows of the decode tiles (programs that take a whole SM) split by predicted makespan: no split
    without a key block, one split where the programs fill whole waves, the earliest predicted end of all counts
    (waves of ``sms`` programs, each its blocks plus a fixed cost, a merge beyond one split); on 132 SMs with 8 KV
    heads the counts measured fastest on an H200 (docs/kernel_notes.md)."""
    from longattn.backends.triton import decode_launch as D

    tiles = D.DECODE_TILES["sm90"]
    monkeypatch.setattr(D, "_sm_count", lambda device: sms)
    cpu = torch.device("cpu")

    def end(programs, blocks, s):  # programs assigned to SMs one wave after another: the busiest SM's work
        busiest = -(-programs * s // sms)
        return busiest * (-(-blocks // s) + tiles.program_blocks) + (tiles.merge_blocks if s > 1 else 0.0)

    for batch in (1, 2, 3, 8, 13, 20, 64):
        for kv_heads in (1, 2, 8):
            for capacity in (1, 100, 2048, 8192, 131072):
                programs, blocks = batch * kv_heads, -(-capacity // tiles.block_n)
                s = D.choose_splits(batch, kv_heads, capacity, cpu, tiles)
                assert 1 <= s <= blocks
                counts = range(1, min(blocks, D.MAX_SPLITS) + 1)
                assert end(programs, blocks, s) <= min(end(programs, blocks, c) for c in counts)
                if programs % sms == 0:
                    assert s == 1
    if sms == 132:
        assert [D.choose_splits(b, 8, 131072, cpu, tiles) for b in (1, 2, 4, 16)] == [16, 8, 4, 1]
        assert [D.choose_splits(b, 8, 8192, cpu, tiles) for b in (10, 14, 18, 20, 22, 28, 36, 44)] == [3, 1, 4, 4, 3,
                                                                                                       1, 4, 1]
        assert [D.choose_splits(b, 8, 2048, cpu, tiles) for b in (10, 14, 25, 28, 44)] == [1] * 5
        paged = D.DECODE_TILES["sm90_paged"]  # the same split rule over the same tiles, deeper pipelined
        assert [D.choose_splits(b, 8, m, cpu, paged) for b, m in ((1, 32768), (8, 8192), (16, 2048))] == [16, 2, 1]


@pytest.mark.parametrize("case,kind", [
    (dict(), "sm90"), (dict(arch="sm80"), "plain"), (dict(element_size=4), "plain"),
    (dict(padded_d=256), "plain_wide_d"), (dict(dilated=True), "plain"), (dict(fp8=True), "fp8"),
    (dict(fp8=True, paged=True), "fp8_paged"),
    (dict(fp8=True, dilated=True, paged=True), "fp8_dilated_paged"), (dict(paged=True, page_size=16), "sm90_paged"),
    (dict(paged=True, page_size=256), "sm90_paged"), (dict(paged=True, page_size=64), "plain"),
    (dict(paged=True, page_size=192), "plain"), (dict(paged=True, page_size=24), "sm90_paged"),
    (dict(paged=True, arch="sm80"), "plain"), (dict(paged=True, dilated=True), "plain")])
def test_decode_kind_picks_the_measured_row(case, kind):
    """The split kernel's tiles come from one table row per kind of cache: the Hopper rows only for 16-bit flash
    decode up to D = 128 on sm_90 (the only GPU they were measured on), paged caches with a row of their own (the
    contiguous row's tiles and splits, more stages: a block-table read inside the loop takes stages), except where
    the pages hold whole 64-key tiles but not whole 128-key ones (one table read a tile, measured faster)."""
    from longattn.backends.triton import decode_launch as D

    args = dict(fp8=False, paged=False, dilated=False, padded_d=128, element_size=2, arch="sm90") | case
    assert D.decode_kind(**args) == kind


def test_decode_plan_for_sm90_names_the_hopper_tiles():
    """``longattn.explain`` with made-up sm_90 facts plans the Hopper row's tiles for a 16-bit cache and keeps the
    float8 row for a float8 one (plans are kept per routing, so the CPU plan of the same call is not reused)."""
    from longattn.backends.device import Device
    q, _, _, kc, vc, seqlens, _ = _case(B=2, n_q=1, hq=8, hk=2, d=32, cap=300, dtype=torch.float16, lens=(299, 3))
    call = dict(cache_seqlens=seqlens, backend="triton")
    cpu_plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, **call).pass_("decode").chosen
    with longattn.routing(device=Device(capability=(9, 0))):
        plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, **call).pass_("decode").chosen
    assert (cpu_plan.option("block_n"), cpu_plan.option("num_warps")) == (64, 4)
    assert (plan.option("block_n"), plan.option("num_warps"), plan.option("num_stages")) == (128, 8, 3)


@pytest.mark.parametrize("page, tiles", [(16, [128, 8, 5, 3]), (256, [128, 8, 5, 4]), (64, [64, 4, 4, 2]),
                                         (24, [128, 8, 5, 3])])
def test_paged_decode_for_sm90_plans_the_deeper_pipelined_row_and_stays_exact(page, tiles):
    """With made-up sm_90 facts a paged 16-bit cache plans the "sm90_paged" row (128-key tiles of 8 warps, 5
    stages, one wave of splits: two programs on the interpreter's 8 SMs, a split per 128-key block of the capacity
    (304, 312 or 512 rows), at most four) and the call run with it matches the reference: 128-key tiles spanning eight
    16-row pages (a table read per row), or inside one 256-row page. 64-row pages hold whole 64-key tiles but not
    128-key ones: they keep the "plain" row (64-key tiles of 4 warps, 4 stages, splits of at least 4 blocks). 24-row
    pages (not a power of two) take "sm90_paged" with the page size read at run time (``PAGE`` 0)."""
    from longattn.backends.device import Device
    q, k, v, kc, vc, seqlens, table = _case(B=2, n_q=2, hq=8, hk=1, d=32, cap=300, page=page, dtype=torch.float16,
                                            lens=(296, 3))
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                           cache_seqlens=seqlens, block_table=table)
    call = dict(cache_seqlens=seqlens, block_table=table, backend="triton")
    with longattn.routing(device=Device(capability=(9, 0))):
        plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, k, v, **call).pass_("decode").chosen
        out = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, **call)
    assert [plan.option(n) for n in ("block_n", "num_warps", "num_stages", "splits")] == tiles
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("sms", [8, 78, 132])
def test_calls_of_more_programs_than_sms_take_narrow_programs_on_short_caches(monkeypatch, sms):
    """On sm_90, a step over a 16-bit cache of fewer than 4096 keys whose (sequence, KV head) programs outnumber the
    SMs takes a row for many programs: up to three programs an SM 64-key tiles ("sm90_many", one split, with up to 4
    new queries a sequence; up to 1.2 programs an SM with K and V by TMA, "sm90_many_tma"; "sm90_paged_many", single-query steps), beyond that 32-key tiles ("sm90_most",
    "sm90_paged_most", single-query steps); each splits until it has ``load`` programs an SM (1.9: 256 programs on 132
    SMs count as two), never more splits than key blocks; other calls keep their row (speculative steps beyond three
    programs an SM too, not the row before). On 132 SMs with 8 KV heads: the counts measured fastest of those tried
    (docs/kernel_notes.md)."""
    from longattn.backends.triton import decode_launch as D

    monkeypatch.setattr(D, "_sm_count", lambda device: sms)
    cpu = torch.device("cpu")
    for kind in ("sm90", "sm90_paged", "plain", "fp8"):
        for programs in (1, sms - 1, sms, sms + 1, 2 * sms, 3 * sms, 3 * sms + 1, 9 * sms):
            for capacity in (1, 100, 4095, 4096, 131072):
                for queries in (2, 4, 5, 8):  # speculative steps: contiguous caches' 64-key row only, up to 4
                    wide = kind == "sm90" and sms < programs <= 3 * sms and capacity < 4096 and queries <= 4
                    want = ("sm90_many_tma" if programs <= 1.2 * sms else "sm90_many") if wide else kind
                    assert D.many_programs_kind(kind, programs, capacity, queries, cpu) == want
                got = D.many_programs_kind(kind, programs, capacity, 1, cpu)
                if programs <= sms or capacity >= 4096 or kind not in ("sm90", "sm90_paged"):
                    assert got == kind
                    continue
                assert got == kind + ("_most" if programs > 3 * sms else "_many") + (
                    "_tma" if kind == "sm90" and programs <= 1.2 * sms else "")
                many = D.DECODE_TILES[got]
                s = D.choose_splits(programs, 1, capacity, cpu, many)
                blocks = -(-capacity // many.block_n)
                assert 1 <= s <= blocks
                assert programs * s >= many.load * sms or s == blocks
                assert s == 1 or programs * (s - 1) < many.load * sms
    if sms == 132:
        assert [D.many_programs_kind("sm90", b * 8, 2048, 1, cpu) for b in (16, 17, 19, 20, 49, 50)] == [
            "sm90", "sm90_many_tma", "sm90_many_tma", "sm90_many", "sm90_many", "sm90_most"]
        assert [D.choose_splits(b, 8, 2048, cpu, D.DECODE_TILES["sm90_many"]) for b in (17, 30, 49)] == [1, 1, 1]
        most = D.DECODE_TILES["sm90_most"]
        assert [D.choose_splits(b, 8, 2048, cpu, most) for b in (17, 18, 24, 32, 40, 64)] == [2, 2, 2, 1, 1, 1]
        assert [D.many_programs_kind("sm90_paged", b * 8, 2048, 1, cpu) for b in (16, 18, 49, 50)] == [
            "sm90_paged", "sm90_paged_many", "sm90_paged_many", "sm90_paged_most"]


def test_decode_tiles_forced_through_the_routing_reach_the_plan_and_stay_exact():
    """``longattn.routing(tiles={"decode": Tiles(...)})`` sets the split kernel's tiles (tuning tools sweep them so);
    the plan kept for the call's signature under the default routing is not the one used under another."""
    from longattn.backends.triton.tiles import Tiles
    q, k, v, kc, vc, seqlens, _ = _case(B=2, n_q=1, hq=8, hk=2, d=32, cap=100, dtype=torch.float32, lens=(99, 3))
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens)
    call = dict(cache_seqlens=seqlens, backend="triton")
    base = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, **call).pass_("decode").chosen
    for tiles in (Tiles(0, 32, 2, 1), Tiles(0, 64, 4, 2)):
        with longattn.routing(tiles={"decode": tiles}):
            plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, **call).pass_("decode").chosen
            out = longattn.flash_attention_with_kvcache(q, kc, vc, **call)
        assert (plan.option("block_n"), plan.option("num_warps"), plan.option("num_stages")) == (
            tiles.block_n, tiles.num_warps, tiles.num_stages)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    again = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, **call).pass_("decode").chosen
    assert again == base


@pytest.mark.parametrize("append,page,kw", [
    (False, None, {}), (True, None, {}), (True, None, {"softcap": 5.0}), (False, None, {"window": (30, 0)}),
    (True, None, {"alibi_slopes": True}), (False, None, {"sinks": True}), (True, 16, {}),
    (False, 256, {"softcap": 5.0}), (True, 16, {"sinks": True}), (False, None, {"most": True}),
    (True, None, {"most": True, "sinks": True}), (True, 16, {"most": True, "softcap": 5.0}),
    (False, None, {"queries": 4, "softcap": 5.0}), (False, None, {"queries": 2, "sinks": True, "window": (40, 0)})])
def test_decode_of_many_programs_on_sm90_plans_narrow_programs_and_stays_exact(append, page, kw):
    """With made-up sm_90 facts, a call of more (sequence, KV head) programs than the interpreter's 8 SMs over a
    short 16-bit cache plans the rows for many programs and matches the reference, with soft-capping, a window,
    ALiBi and sinks (in the merge kernel where the call splits), sequences of no key, one key, a partial last tile and a full cache
    among them. 12 programs (up to three an SM): 64-key tiles, contiguous ("sm90_many": 4 warps, 3 stages, one split)
    and paged ("sm90_paged_many": 4 warps, 6 stages, split in two for about two programs an SM); ``most``, 27
    programs (beyond three an SM): 32-key tiles of 2 warps ("sm90_most": 4 stages; "sm90_paged_most": 6), one split;
    ``queries``, 2-4 new queries a sequence (speculative steps): the contiguous 64-key row."""
    from longattn.backends.device import Device
    kw = dict(kw)
    most = kw.pop("most", False)
    lens = (0, 1, 45, 127, 64, 2, 100, 31, 127) if most else (0, 1, 45, 127)
    q, k, v, kc, vc, seqlens, table = _case(B=len(lens), n_q=kw.pop("queries", 1), hq=6, hk=3, d=32, cap=128,
                                            page=page, dtype=torch.float16, lens=lens)
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(len(lens), 6) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(6)
    new = (k, v) if append else ()
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), *(x.double() for x in new),
                                           cache_seqlens=seqlens, block_table=table, **kw)
    call = dict(cache_seqlens=seqlens, block_table=table, backend="triton", **kw)
    with longattn.routing(device=Device(capability=(9, 0))):
        plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, *new, **call).pass_("decode").chosen
        out = longattn.flash_attention_with_kvcache(q, kc, vc, *new, **call)
    if most:
        tiles = [32, 2, 4, 1] if page is None else [32, 2, 6, 1]
    else:
        tiles = [64, 4, 3, 1] if page is None else [64, 4, 6, 2]
    assert [plan.option(n) for n in ("block_n", "num_warps", "num_stages", "splits")] == tiles
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("queries,kw", [(1, {}), (1, {"softcap": 5.0, "window": (40, 0)}), (4, {"sinks": True})])
def test_decode_of_slightly_more_programs_than_sms_loads_by_descriptor_and_stays_exact(queries, kw):
    """With made-up sm_90 facts, 9 (sequence, KV head) programs on the interpreter's 8 SMs (at most 1.2 an SM) over a
    short 16-bit contiguous cache take "sm90_many_tma": the 64-key row with K and V by tensor descriptors, one split;
    exact against the reference with NaN past every sequence's length."""
    from longattn.backends.device import Device
    kw = dict(kw)
    lens = (0, 45, 127 - queries)
    q, k, v, kc, vc, seqlens, _ = _case(B=3, n_q=queries, hq=6, hk=3, d=32, cap=128, dtype=torch.float16, lens=lens)
    kc, vc = (_poison_past_lengths(c, seqlens + queries, None) for c in (kc, vc))
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(6)
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                           cache_seqlens=seqlens, **kw)
    call = dict(cache_seqlens=seqlens, backend="triton", **kw)
    with longattn.routing(device=Device(capability=(9, 0))):
        plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, k, v, **call).pass_("decode").chosen
        out = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, **call)
    assert [plan.option(n) for n in ("block_n", "num_warps", "num_stages", "splits", "tma")] == [
        64, 4, 3, 1, _descriptors()]
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)


def test_a_kept_descriptor_plan_meeting_strides_no_descriptor_takes_loads_by_pointer():
    """A plan kept for a growing contiguous cache's signature (its strides' classes, not values) that loads K and V
    by descriptor, then called with caches of the same signature whose row stride no descriptor takes (72 bytes, not
    a multiple of 16): it loads them by pointer from then on, exact (never a descriptor of misaligned strides)."""
    from longattn.backends.device import Device
    from longattn.backends.triton import decode_launch as D
    if not _descriptors():
        pytest.skip("this Triton has no device-side tensor descriptors")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(9, 1, 4, 32, generator=g, dtype=torch.float16)
    lens = torch.tensor([0, 1, 17, 64, 99, 100, 50, 3, 77], dtype=torch.int32)
    outs = []
    D.PLANS.clear()
    with longattn.routing(device=Device(capability=(9, 0))):
        for width in (40, 36):  # row strides of 80 and 72 bytes, the same class (not a multiple of 16 elements)
            kc, vc = (torch.randn(9, 101, 1, width, generator=g, dtype=torch.float16)[..., :32] for _ in range(2))
            want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens)
            out = longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="triton")
            outs.append([p.tma for p in D.PLANS.plans()])
            torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    assert outs == [[True], [False]]


def _poison_past_lengths(cache, seqlens, table):
    """NaN in every cache row that is no key of the call: rows at or past each sequence's length (the call's new
    rows are written over them) and pages no sequence uses, as an uninitialised cache or a reused page holds."""
    cache = cache.clone()
    if table is None:
        for b, n in enumerate(seqlens.tolist()):
            cache[b, n:] = float("nan")
        return cache
    used = set(table.flatten().tolist())
    for p in range(cache.shape[0]):
        if p not in used:
            cache[p] = float("nan")
    page = cache.shape[1]
    for b, n in enumerate(seqlens.tolist()):
        for r in range(n, table.shape[1] * page):
            cache[table[b, r // page], r % page] = float("nan")
    return cache


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("kw", [{}, {"window": (20, 0)}, {"softcap": 5.0}, "dilated"])
def test_garbage_past_the_lengths_never_reaches_the_output(backend, page, append, kw):
    """Rows of the caches past each sequence's length (NaN here) are not keys of the call: the output and
    log-sum-exp are the reference's on the valid rows (the PyTorch backend once multiplied their values by a 0
    probability: 0 x NaN made whole sequences NaN)."""
    q, k, v, kc, vc, seqlens, table = _case(page=page, lens=(5, 37, 61))
    kc, vc = (_poison_past_lengths(c, seqlens, table) for c in (kc, vc))
    new = (k, v) if append else ()
    if kw == "dilated":
        fn, rfn, opts = (longattn.dilated_attention_with_kvcache, ref.dilated_attention_with_kvcache,
                         dict(segment_lengths=(8, 32), dilation_rates=(1, 2)))
    else:
        fn, rfn, opts = longattn.flash_attention_with_kvcache, ref.flash_attention_with_kvcache, kw
    want, want_lse = rfn(q, kc.clone(), vc.clone(), *new, cache_seqlens=seqlens, block_table=table,
                         return_lse=True, **opts)
    got, lse = fn(q, kc, vc, *new, cache_seqlens=seqlens, block_table=table, return_lse=True, backend=backend,
                  **opts)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("kw", [{}, {"softcap": 5.0}])
def test_garbage_past_the_lengths_never_reaches_the_triton_decode(page, kw):
    q, k, v, kc, vc, seqlens, table = _case(page=page, lens=(5, 37, 61), dtype=torch.float32)
    kc, vc = (_poison_past_lengths(c, seqlens, table) for c in (kc, vc))
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                            cache_seqlens=seqlens, block_table=table, **kw)
    got = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                backend="triton", **kw)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fields", [{"tma": True}, {"tma": False}])
@pytest.mark.parametrize("page,splits,kw", [
    (None, 1, {}), (None, 3, {"softcap": 5.0, "window": (30, 0)}), (None, 1, {"alibi_slopes": True, "queries": 3}),
    (None, 2, {"sinks": True}), (16, 1, {}), (16, 3, {"window": (30, 0)})])
def test_decode_loop_variants_stay_exact(fields, page, splits, kw):
    """The split kernel's K and V by tensor descriptors or by pointer (``DecodeTiles.tma`` set in every row, as
    tools/tune_decode.py --set A/Bs it) on caches holding NaN past each sequence's length (descriptors' rows end at
    the length): the reference's output and log-sum-exp, with a window, soft-capping, ALiBi, sinks, several new
    queries, and one or several splits. Paged caches take no descriptors (``tma`` reaches contiguous ones only)."""
    from longattn.backends.triton import decode_launch as D
    kw = dict(kw)
    lens = (0, 1, 45, 125, 63, 100)  # with the new queries: one key, partial and full tiles, a full cache (3 queries)
    q, k, v, kc, vc, seqlens, table = _case(B=len(lens), n_q=kw.pop("queries", 1), hq=6, hk=3, d=32, cap=128,
                                            page=page, dtype=torch.float32, lens=lens)
    kc, vc = (_poison_past_lengths(c, seqlens, table) for c in (kc, vc))
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(len(lens), 6) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(6)
    want, want_lse = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                                      cache_seqlens=seqlens, block_table=table, return_lse=True, **kw)
    with D.tiles_set(**fields):
        got, lse = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                         return_lse=True, backend="triton", num_splits=splits, **kw)
        (plan,) = D.PLANS.plans()
        consts = plan.split.kwargs
        assert consts.get("TMA", False) == plan.tma == (fields["tma"] and page is None and _descriptors())
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_one_tensor_as_both_caches_with_new_tokens_is_refused(paged):
    """The same memory as k_cache and v_cache: the appended values would overwrite the keys (a silently wrong
    answer); refused by name. Views of a fused cache that do not overlap are still taken."""
    q, k, v, kc, vc, seqlens, table = _case(page=16 if paged else None)
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        longattn.flash_attention_with_kvcache(q, kc, kc, k, v, cache_seqlens=seqlens, block_table=table)
    fused = torch.stack([kc, vc], dim=2)  # (..., 2, Hk, D): k and v interleaved, no element shared
    want = ref.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=seqlens, block_table=table)
    got = longattn.flash_attention_with_kvcache(q, fused[:, :, 0], fused[:, :, 1], k, v, cache_seqlens=seqlens,
                                                block_table=table)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("paged", [False, True])
def test_caches_that_partly_overlap_are_refused_with_new_tokens_also_after_a_warm_call(paged):
    """k_cache and v_cache as two views of one buffer, one row apart: appended keys would land on cached values (a
    silently wrong answer). Refused by name, also after a call of the same shapes and strides on disjoint caches
    (whose checks a signature would otherwise reuse); reading such caches without appending is fine."""
    q, k, v, kc, vc, seqlens, table = _case(page=16 if paged else None)
    call = dict(cache_seqlens=seqlens, block_table=table)
    buf = torch.zeros(kc.shape[0], kc.shape[1] + 1, *kc.shape[2:], dtype=kc.dtype)
    disjoint = torch.zeros(2, *buf.shape, dtype=kc.dtype)
    longattn.flash_attention_with_kvcache(q, disjoint[0, :, 1:], disjoint[1, :, :-1], k, v, **call)  # (warm)
    buf[:, 1:].copy_(kc)
    kc_view, vc_view = buf[:, 1:], buf[:, :-1]  # keys from row 1, values from row 0: each row holds both
    with pytest.raises(ValueError, match="k_cache and v_cache overlap in memory"):
        longattn.flash_attention_with_kvcache(q, kc_view, vc_view, k, v, **call)
    got = longattn.flash_attention_with_kvcache(q, kc_view, vc_view, **call)
    want = ref.flash_attention_with_kvcache(q, kc_view.clone(), vc_view.clone(), **call)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("paged", [False, True])
def test_an_out_that_overlaps_an_input_is_refused_also_after_a_warm_call(paged):
    """An out that shares memory with q (shifted by a row), a cache, or the new k: the kernels would write output
    rows over rows they still read (a race: a silently wrong answer). Refused by name, also after a call of the same
    shapes whose out was its own; out exactly q (an in-place call) is taken and gives the reference's answer."""
    q, k, v, kc, vc, seqlens, table = _case(page=16 if paged else None, dtype=torch.float32)
    call = dict(cache_seqlens=seqlens, block_table=table, backend="triton")
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens,
                                            block_table=table)
    longattn.flash_attention_with_kvcache(q, kc, vc, out=torch.empty_like(q), **call)  # (warm)
    rows = torch.cat([q, q[:, :1]], dim=1)  # q's rows and one more: out one row further on
    new_rows = torch.cat([k, k], dim=2)  # (B, Nq, Hq, D): out, with the new keys its first heads
    for name, out, args in (("q", rows[:, 1:], (rows[:, :-1], kc, vc)),
                            ("k_cache", kc.view(-1)[:q.numel()].view(q.shape), (q, kc, vc)),
                            ("k", new_rows, (q, kc, vc, new_rows[:, :, :k.shape[2]], v))):
        with pytest.raises(ValueError, match=f"out overlaps {name} in memory"):
            longattn.flash_attention_with_kvcache(*args, out=out, **call)
    inplace = q.clone()
    got = longattn.flash_attention_with_kvcache(inplace, kc, vc, out=inplace, **call)
    assert got.data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_the_overlap_check_tells_interleaved_views_from_meeting_ones():
    """The exact rule on views of one storage with the same strides, against a brute-force set of addresses."""
    from longattn.kvcache import _caches_meet
    base = torch.zeros(2 * 5 * 3 * 4)
    for shape, strides in (((2, 5, 3), (30, 6, 1)), ((2, 5, 3), (60, 12, 4)), ((3, 4), (1, 3)), ((2, 3), (3, 2)),
                           ((3, 4), (0, 1))):
        span = sum((n - 1) * st for n, st in zip(shape, strides))
        for off_a in range(0, min(6, base.numel() - span)):
            for off_b in range(0, base.numel() - span):
                a, b = base.as_strided(shape, strides, off_a), base.as_strided(shape, strides, off_b)
                addresses = lambda t: {t.storage_offset() + sum(i * st for i, st in zip(idx, t.stride()))  # noqa
                                       for idx in itertools.product(*(range(n) for n in t.shape))}
                assert _caches_meet(a, b) == bool(addresses(a) & addresses(b)), (shape, strides, off_a, off_b)
    assert not _caches_meet(base[:10], torch.zeros(10))


def test_the_overlap_check_tells_interleaved_views_of_different_shapes_apart():
    """Views of one storage with the same strides but different shapes (a fused projection's query heads and its
    fewer key heads) are told apart exactly too, against a brute-force set of addresses."""
    from longattn.kvcache import _caches_meet
    base = torch.zeros(2 * 8 * 4)
    addresses = lambda t: {t.storage_offset() + sum(i * st for i, st in zip(idx, t.stride()))  # noqa: E731
                           for idx in itertools.product(*(range(n) for n in t.shape))}
    for strides, shape_a, shape_b in (((32, 4, 1), (2, 4, 4), (2, 2, 4)), ((32, 4, 1), (2, 2, 3), (2, 3, 4)),
                                      ((8, 1), (3, 2), (3, 5)), ((5, 1), (3, 2), (2, 4))):
        for shape, other in ((shape_a, shape_b), (shape_b, shape_a)):
            for off_a in range(base.numel()):
                for off_b in range(base.numel()):
                    try:
                        a, b = base.as_strided(shape, strides, off_a), base.as_strided(other, strides, off_b)
                    except RuntimeError:
                        continue  # (a view past either end of the storage)
                    if min(addresses(a)) < 0 or min(addresses(b)) < 0:
                        continue
                    case = (strides, shape, other, off_a, off_b)
                    assert _caches_meet(a, b) == bool(addresses(a) & addresses(b)), case


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_as_q_of_a_fused_grouped_query_projection_is_taken(backend):
    """q, k and v cut from one fused projection ``(B, Nq, Hq + 2 Hk, D)`` with Hq != Hk, and out=q: the query
    heads share no element with the key or value heads (their address ranges only interleave), so the in-place call
    runs and gives the reference's answer (it was refused as "out overlaps k in memory")."""
    dtype = torch.float32 if backend == "triton" else torch.float64
    q0, k0, v0, kc, vc, seqlens, _ = _case(dtype=dtype)
    hq, hk = q0.shape[2], k0.shape[2]
    fused = torch.cat([q0, k0, v0], dim=2)
    q, k, v = fused[:, :, :hq], fused[:, :, hq:hq + hk], fused[:, :, hq + hk:]
    want = ref.flash_attention_with_kvcache(q0.double(), kc.double(), vc.double(), k0.double(), v0.double(),
                                            cache_seqlens=seqlens)
    got = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, out=q, backend=backend)
    assert got.data_ptr() == fused.data_ptr()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(fused[:, :, hq:], torch.cat([k0, v0], dim=2))  # (the key and value heads untouched)


def test_expanded_caches_appended_to_are_refused_by_name():
    """Caches expanded over the batch (stride 0) from one tensor: appending is refused as writing one row over
    another, by name (the signature's overlap test of the two caches must not divide by the zero stride)."""
    q, k, v, kc, _, seqlens, _ = _case(B=2)
    shared = kc[:1].expand(kc.shape)
    with pytest.raises(ValueError, match="k_cache has elements that share memory"):
        longattn.flash_attention_with_kvcache(q, shared, shared, k, v, cache_seqlens=seqlens)


def test_meta_caches_with_new_tokens_and_out_give_shapes():
    """Meta tensors have no memory (every storage at address 0): appending to meta caches, or a meta out, meets no
    other input and gives the output's shape, as without them."""
    q, k, v = (torch.empty(2, 1, 4, 8, device="meta") for _ in range(3))
    kc, vc = (torch.empty(2, 16, 4, 8, device="meta") for _ in range(2))
    out = torch.empty_like(q)
    for new, o in (((k, v), None), ((), out), ((k, v), out)):
        got = longattn.flash_attention_with_kvcache(q, kc, vc, *new, cache_seqlens=3, out=o)
        assert got.device.type == "meta" and got.shape == q.shape


@pytest.mark.parametrize("page", [None, 16])
def test_one_split_writes_the_output_without_the_merge_kernel(page):
    """With one key split and no sinks the split kernel writes the output and log-sum-exp itself (one kernel fewer
    a step); more splits, or sinks, go through the merge. All three match the reference."""
    q, k, v, kc, vc, seqlens, table = _case(B=3, n_q=2, page=page, dtype=torch.float32)
    want, want_lse = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens,
                                                      block_table=table, return_lse=True)
    sinks = torch.randn(q.shape[2])
    want_s = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens,
                                              block_table=table, sinks=sinks.double())
    for splits, kw, merge, w in ((1, {}, False, want), (2, {}, True, want), (1, dict(sinks=sinks), True, want_s)):
        call = dict(cache_seqlens=seqlens, block_table=table, num_splits=splits, backend="triton", **kw)
        plan = longattn.explain(longattn.flash_attention_with_kvcache, q, kc, vc, **call).pass_("decode").chosen
        assert (plan.option("splits"), plan.option("merge")) == (splits, merge)
        out, lse = longattn.flash_attention_with_kvcache(q, kc, vc, return_lse=True, **call)
        torch.testing.assert_close(out.double(), w, atol=2e-5, rtol=2e-5)
        if not kw:
            torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


_HUGE_HEAD_STRIDE = r"""
import sys, torch, longattn
from longattn import reference as ref
# An HF-layout (B, Hk, M, D) float8 cache seen as (B, M, Hk, D): head stride M * D = 2**28, so head 8 starts 2**31
# elements in. torch.empty backs only the pages written (the first rows of each head): 2.4 GB of address space.
B, Hk, D, M, n = 1, 9, 16, 2 ** 24, 5
hf = torch.empty(B * Hk * M * D, dtype=torch.float8_e4m3fn).view(B, Hk, M, D)
g = torch.Generator().manual_seed(0)
hf[0, :, :n] = torch.randn(Hk, n, D, generator=g).to(torch.float8_e4m3fn)
cache = hf.transpose(1, 2)
q = torch.randn(B, 2, 2 * Hk, D, generator=g).half()
small = cache[:, :n].float()
kw = dict(segment_lengths=(2, 4), dilation_rates=(1, 2)) if sys.argv[1] == "dilated" else {}
fn = longattn.dilated_attention_with_kvcache if kw else longattn.flash_attention_with_kvcache
want = (ref.dilated_attention_with_kvcache if kw else ref.flash_attention_with_kvcache)(
    q.float(), small, small, cache_seqlens=n, **kw)
got = fn(q, cache, cache, cache_seqlens=torch.tensor([n], dtype=torch.int32), backend="triton", **kw)
torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
print("exact")
"""


@pytest.mark.parametrize("fn", ["flash", "dilated"])
def test_triton_decode_addresses_a_head_past_2_31_elements(fn):
    """A head's offset (its index times the head stride) in 64-bit arithmetic: an HF-layout cache of a long context
    puts a KV head 2**31 elements or more from the start while the stride itself fits in 32 bits. In 32 bits the
    offset wrapped negative: reads (and the append's writes) before the cache (a crash in the interpreter). Run in
    a subprocess, so that such a crash fails this test rather than ending the session."""
    import os
    import subprocess
    import sys
    from longattn.backends.device import interpret_mode
    if not interpret_mode():
        pytest.skip("runs the decode kernels in the Triton interpreter (TRITON_INTERPRET=1)")
    r = subprocess.run([sys.executable, "-c", _HUGE_HEAD_STRIDE, fn], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0 and "exact" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def test_a_float8_cache_of_another_kind_is_refused_naming_the_one_taken():
    q = torch.randn(1, 1, 2, 16)
    cache = torch.zeros(1, 8, 2, 16).to(torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"flash_attention_with_kvcache: k_cache has dtype torch.float8_e5m2; "
                                        r"allowed: .*float8_e4m3fn"):
        longattn.flash_attention_with_kvcache(q, cache, cache, cache_seqlens=3)


@pytest.mark.parametrize("fn", ["flash_attention_with_kvcache", "dilated_attention_with_kvcache"])
def test_a_cache_without_unit_head_dim_stride_names_the_function_and_falls_back_under_auto(fn):
    """The Triton decode kernels read and write caches in place with unit stride along head_dim: backend='triton'
    refuses another cache naming the function called, and 'auto' gives the result of a contiguous cache
    (auto runs the PyTorch backend, which computes such caches)."""
    q = torch.randn(1, 1, 2, 16)
    kc, vc = (torch.randn(1, 8, 2, 32)[..., ::2] for _ in range(2))
    kw = dict(segment_lengths=(4,), dilation_rates=(1,)) if fn.startswith("dilated") else {}
    call = getattr(longattn, fn)
    with pytest.raises(ValueError, match=rf"{fn}: backend='triton' cannot run: k_cache without unit stride"):
        call(q, kc, vc, cache_seqlens=torch.tensor([5], dtype=torch.int32), backend="triton", **kw)
    got = call(q, kc, vc, cache_seqlens=torch.tensor([5], dtype=torch.int32), **kw)
    want = call(q, kc.contiguous(), vc.contiguous(), cache_seqlens=torch.tensor([5], dtype=torch.int32), **kw)
    torch.testing.assert_close(got, want)


# (case, block table, cache_seqlens, new tokens): page size 4. Two sequences sharing a 5-token prefix whose last
# page is partly filled, both appending into it; one sequence whose table names a page twice (its position 4 is
# physical row 0, its position 0); a sequence appending at a row another sequence reads.
_CLASHING_TABLES = [("shared last page", [[0, 1], [0, 1]], [5, 5], 1),
                    ("page twice in a row", [[0, 0]], [2], 3),
                    ("a row another reads", [[0, 1], [0, 1]], [4, 6], 1)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case,table,lens,n_q", _CLASHING_TABLES, ids=[c[0] for c in _CLASHING_TABLES])
def test_paged_appends_into_a_row_the_call_also_uses_are_refused(backend, case, table, lens, n_q):
    """A paged call's new keys and values go into rows no other position of the call reads or writes: otherwise one
    new key overwrote another (on a GPU a race) or a key a sequence reads, and the outputs were silently wrong (by
    0.3 to 1.6 here). Refused, naming both positions, before any row is written."""
    g = torch.Generator().manual_seed(0)
    table, lens = torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    B = table.shape[0]
    q = torch.randn(B, n_q, 2, 16, generator=g)
    k, v = (torch.randn(B, n_q, 1, 16, generator=g) for _ in range(2))
    kc, vc = (torch.randn(4, 4, 1, 16, generator=g) for _ in range(2))
    kc0 = kc.clone()
    with pytest.raises(ValueError, match=r"block_table maps the row that sequence \d appends at position \d+ \(page "
                                         r"\d, row \d\) to a row that the call also reads or writes as"):
        longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                              backend=backend)
    assert torch.equal(kc, kc0)
    with pytest.raises(ValueError, match="block_table maps the row"):
        longattn.dilated_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                segment_lengths=(4,), dilation_rates=(1,), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_sequences_share_the_pages_they_only_read(backend):
    """A common prefix in shared pages (read by both sequences), each appending into a page of its own, and unused
    table entries padded with a shared page: as the reference; no page is refused."""
    g = torch.Generator().manual_seed(1)
    table = torch.tensor([[0, 1, 2, 0], [0, 1, 3, 0]], dtype=torch.int32)  # prefix of 8 rows in pages 0 and 1
    lens = torch.tensor([9, 8], dtype=torch.int32)
    q = torch.randn(2, 3, 2, 16, generator=g)
    k, v = (torch.randn(2, 3, 1, 16, generator=g) for _ in range(2))
    kc, vc = (torch.randn(4, 4, 1, 16, generator=g) for _ in range(2))
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                           cache_seqlens=lens, block_table=table)
    got = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                backend=backend)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc[2, 1:4], k[0])
    torch.testing.assert_close(kc[3, 0:3], k[1])


@pytest.mark.parametrize("backend,n_lens", [("torch", torch.tensor([3, 7])), ("triton", torch.tensor([3, 7])),
                                            ("auto", 5)])  # (auto with an int length and one token: SDPA's route)
@pytest.mark.parametrize("paged", [False, True])
def test_caches_and_out_made_under_inference_mode_are_written_outside_it(backend, n_lens, paged):
    """Caches (and an out) allocated under torch.inference_mode() and written by later calls outside it: the
    Triton kernels write them, as FlashAttention's do; the PyTorch backend and SDPA's route raised PyTorch's
    "Inplace update to inference tensor outside InferenceMode". Every backend now writes them and gives the
    reference's result; the output of a call without out= is an ordinary tensor."""
    if paged and backend == "auto":
        pytest.skip("SDPA's route takes contiguous caches")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 16, generator=g)
    k, v = (torch.randn(2, 1, 2, 16, generator=g) for _ in range(2))
    table = torch.arange(8, dtype=torch.int32).view(2, 4) if paged else None
    with torch.inference_mode():
        kc, vc = (torch.randn(8, 4, 2, 16) if paged else torch.randn(2, 16, 2, 16) for _ in range(2))
        out = torch.empty(2, 1, 4, 16)
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), k.double(), v.double(),
                                           cache_seqlens=n_lens, block_table=table)
    got = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n_lens, block_table=table,
                                                backend=backend)
    assert not got.is_inference()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    for b in range(2):
        at = int(n_lens[b]) if isinstance(n_lens, torch.Tensor) else n_lens
        torch.testing.assert_close(ref.cache_rows(kc, b, at + 1, table)[at], k[b, 0])
    got = longattn.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n_lens, block_table=table, out=out,
                                                backend=backend)  # (the same rows written again)
    assert got is out
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_new_tokens_or_queries_that_overlap_a_cache_are_refused_also_after_a_warm_call(paged):
    """New keys (or queries) passed as a view of the cache's rows: the call appends k, v before it reads them, so a
    k overlapping the rows written gave a silently wrong answer (and cache) before; q alike. Refused by name, also
    after a call of the same shapes and strides with inputs of their own memory."""
    q, k, v, kc, vc, seqlens, table = _case(page=16 if paged else None, hq=2, dtype=torch.float32)
    call = dict(cache_seqlens=seqlens, block_table=table)
    n = q.shape[1]
    rows = lambda c: c[:, :n] if table is None else c[:1, :n].expand(q.shape[0], -1, -1, -1)  # noqa: E731
    kc_rows, vc_rows = rows(kc), rows(vc)
    longattn.flash_attention_with_kvcache(q, kc, vc, kc_rows.clone(), vc_rows.clone(), **call)  # (warm)
    with pytest.raises(ValueError, match="k overlaps k_cache in memory"):
        longattn.flash_attention_with_kvcache(q, kc, vc, kc_rows, vc_rows.clone(), **call)
    with pytest.raises(ValueError, match="q overlaps k_cache in memory"):
        longattn.flash_attention_with_kvcache(kc_rows, kc, vc, k, v, **call)
    got = longattn.flash_attention_with_kvcache(q, kc, vc, **call)  # (reading only: taken)
    want = ref.flash_attention_with_kvcache(q.double(), kc.double(), vc.double(), **call)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
