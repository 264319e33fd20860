"""Block-sparse patterns: each builder against a loop definition written here from the documented semantics,
adaptive selection against explicit scores, attention with each pattern against the reference (float64), the
cached block lists, the modules, and argument errors."""
import copy
import math
import os
import pickle

import pytest
import torch

import longattn
from longattn import patterns as P
from longattn import reference as ref
from longattn.nn import BlockSparseAttention, MultiheadBlockSparseAttention


def lists_spec(mask, block_size=None, seq_lens=None, causal=False):
    """The block lists, stated in plain PyTorch: per row, the allowed block indices the causal band does not hide
    entirely, ascending, partial ones (cut by the band or the sequence end) first; counts ``(partial, full)``.
    Without lengths every allowed block is partial."""
    nq, nk = mask.shape[-2:]
    a = torch.arange(nq)[:, None]
    b = torch.arange(nk)[None, :]
    if block_size is None:
        full = torch.zeros(nq, nk, dtype=torch.bool)
        visible = torch.ones(nq, nk, dtype=torch.bool)
    else:
        (bq, bk), (n, m) = block_size, seq_lens
        full = ((b + 1) * bk <= m).expand(nq, nk)
        visible = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            full = full & ((b + 1) * bk - 1 <= a * bq + m - n)
            visible = b * bk <= torch.clamp((a + 1) * bq, max=n) - 1 + m - n
    kind = torch.where(mask & visible, full.to(torch.uint8), 2)  # 0 partial, 1 full, 2 not visited

    def rows(kind):
        num = torch.stack([(kind == 0).sum(-1, dtype=torch.int32), (kind == 1).sum(-1, dtype=torch.int32)], -1)
        order = torch.sort(kind, dim=-1, stable=True).indices.to(torch.int32)
        valid = torch.arange(kind.shape[-1]) < num.sum(-1)[..., None]
        return num, torch.where(valid, order, torch.zeros_like(order))

    return (*rows(kind), *rows(kind.transpose(-1, -2)))


def assert_lists_equal(lists, want):
    """Counts equal; each index row equal over its first ``count`` entries (the kernels read no further)."""
    for num_name, idx_name, num, idx in (("kv_num", "kv_idx", want[0], want[1]), ("q_num", "q_idx", *want[2:])):
        got_num, got_idx = getattr(lists, num_name), getattr(lists, idx_name)
        assert torch.equal(got_num, num), num_name
        valid = torch.arange(idx.shape[-1]) < num.sum(-1, keepdim=True)
        assert got_idx.shape == idx.shape and torch.equal(got_idx[valid], idx[valid]), idx_name

F64 = torch.float64
# (n, m, block_size): ragged ends, n != m both ways, block_q != block_k
GRIDS = [(10, 10, 2), (7, 12, (2, 3)), (13, 5, (3, 2)), (9, 9, (4, 2)), (11, 11, (2, 4))]


def pair(bs):
    return (bs, bs) if isinstance(bs, int) else bs


def grid_sizes(n, m, bs):
    bq, bk = pair(bs)
    return math.ceil(n / bq), math.ceil(m / bk)


def queries(a, n, bq):
    return range(a * bq, min((a + 1) * bq, n))


def keys(b, m, bk):
    return range(b * bk, min((b + 1) * bk, m))


def aligned_blocks(a, n, m, bq, bk):
    """Key-block indices (possibly negative) of the aligned positions i + M - N of query block a."""
    return {(i + m - n) // bk for i in queries(a, n, bq)}


def block_distance(a, b, n, m, bq, bk):
    return min(abs(b - x) for x in aligned_blocks(a, n, m, bq, bk))


def loop_mask(n, m, bs, allowed, heads=1):
    """(1, heads, nq, nk) from allowed(h, a, b)."""
    bq, bk = pair(bs)
    nq, nk = grid_sizes(n, m, bs)
    out = torch.zeros(1, heads, nq, nk, dtype=torch.bool)
    for h in range(heads):
        for a in range(nq):
            for b in range(nk):
                out[0, h, a, b] = bool(allowed(h, a, b))
    return out


def loop_dilated(n, m, bs, segs, rates, heads):
    """Enumerate segments of key blocks; head h selects every r-th block from offset h % r; a query block belongs
    to the segment of the key block holding its last query's aligned position."""
    bq, bk = pair(bs)
    nq, nk = grid_sizes(n, m, bs)
    out = torch.zeros(1, heads, nq, nk, dtype=torch.bool)
    for w, r in zip(segs, rates):
        for start in range(0, nk, w):
            for h in range(heads):
                picked = list(range(start, min(start + w, nk)))[h % r::r]
                for a in range(nq):
                    last = (min((a + 1) * bq, n) - 1 + m - n) // bk
                    if last in picked:
                        for b in picked:
                            out[0, h, a, b] = True
    return out


# ---- builders against loop definitions -------------------------------------------------------------------------

@pytest.mark.parametrize("n,m,bs", GRIDS)
def test_causal_matches_token_definition(n, m, bs):
    bq, bk = pair(bs)
    want = loop_mask(n, m, bs, lambda h, a, b: any(j <= i + m - n for i in queries(a, n, bq)
                                                   for j in keys(b, m, bk)))
    assert torch.equal(P.causal(n=n, m=m, block_size=bs), want)
    assert torch.equal(P.Causal().mask(n, m, block_size=bs), want)


@pytest.mark.parametrize("n,m,bs", GRIDS)
@pytest.mark.parametrize("window", [0, 1, 3])
def test_local_matches_loop(n, m, bs, window):
    bq, bk = pair(bs)
    want = loop_mask(n, m, bs, lambda h, a, b: block_distance(a, b, n, m, bq, bk) <= window)
    assert torch.equal(P.local(window, n=n, m=m, block_size=bs), want)


def test_local_square_grid_is_band():
    got = P.local(2, n=40, block_size=4)[0, 0]
    a = torch.arange(10)
    assert torch.equal(got, (a[:, None] - a[None, :]).abs() <= 2)


@pytest.mark.parametrize("n,m,bs", GRIDS)
@pytest.mark.parametrize("n_global", [0, 1, 2])
def test_global_tokens_matches_loop(n, m, bs, n_global):
    want = loop_mask(n, m, bs, lambda h, a, b: a < n_global or b < n_global)
    assert torch.equal(P.global_tokens(n_global, n=n, m=m, block_size=bs), want)


@pytest.mark.parametrize("n,m,bs", GRIDS + [(40, 40, 2)])
@pytest.mark.parametrize("levels,base", [(1, 1), (3, 1), (3, 2), (2, 3)])
def test_hierarchical_matches_loop(n, m, bs, levels, base):
    bq, bk = pair(bs)

    def allowed(h, a, b):
        d = block_distance(a, b, n, m, bq, bk)
        return any(d <= base * 2 ** lvl and d % 2 ** lvl == 0 for lvl in range(levels))

    assert torch.equal(P.hierarchical(levels, base, n=n, m=m, block_size=bs), loop_mask(n, m, bs, allowed))


@pytest.mark.parametrize("n,m,bs", GRIDS + [(37, 37, 2), (30, 44, (3, 2))])
@pytest.mark.parametrize("segs,rates", [([4], [1]), ([4], [2]), ([3, 6], [1, 3]), ([5, 8], [2, 4])])
@pytest.mark.parametrize("heads", [1, 4])
def test_dilated_matches_loop(n, m, bs, segs, rates, heads):
    got = P.dilated(segs, rates, n=n, m=m, block_size=bs, heads=heads)
    assert torch.equal(got, loop_dilated(n, m, bs, segs, rates, heads))


@pytest.mark.parametrize("n,m,bs", GRIDS)
def test_random_rows_reproducible_and_dense_as_asked(n, m, bs):
    nq, nk = grid_sizes(n, m, bs)
    for density in (0.0, 0.3, 0.5, 1.0):
        mask = P.random(density, 7, n=n, m=m, block_size=bs, heads=3)
        want_per_row = max(round(density * nk), 1) if density > 0 else 0
        assert (mask.sum(-1) == want_per_row).all()
        assert torch.equal(mask, P.Random(density, seed=7).mask(n, m, block_size=bs, heads=3, device="cpu"))
        assert torch.equal(mask[:, :1], P.random(density, 7, n=n, m=m, block_size=bs))


def test_random_seeds_and_density_at_scale():
    a = P.random(0.1, 1, n=64 * 200, block_size=64)
    b = P.random(0.1, 2, n=64 * 200, block_size=64)
    assert not torch.equal(a, b)
    assert (a.sum(-1) == 20).all()  # 20 of 200 blocks in every row
    assert P.BlockSparsePattern(a, 64).density == pytest.approx(0.1)
    # the blocks are spread: every key block is chosen by some row, no column is favoured much
    cols = a[0, 0].sum(0).float()
    assert cols.min() > 0 and cols.max() < 3 * cols.mean()


@pytest.mark.parametrize("n,m,bs", GRIDS)
def test_union_intersection_and_operators(n, m, bs):
    a = P.local(1, n=n, m=m, block_size=bs)
    b = P.random(0.4, 3, n=n, m=m, block_size=bs, heads=2)
    c = P.global_tokens(1, n=n, m=m, block_size=bs)
    u, i = P.union(a, b, c), P.intersection(a, b, c)
    assert u.shape == i.shape == (1, 2) + a.shape[2:]
    want_u = loop_mask(n, m, bs, lambda h, x, y: a[0, 0, x, y] or b[0, h, x, y] or c[0, 0, x, y], heads=2)
    want_i = loop_mask(n, m, bs, lambda h, x, y: a[0, 0, x, y] and b[0, h, x, y] and c[0, 0, x, y], heads=2)
    assert torch.equal(u, want_u) and torch.equal(i, want_i)
    pat_u = P.Local(1) | P.Random(0.4, 3) | P.GlobalTokens(1)
    pat_i = P.Local(1) & P.Random(0.4, 3) & P.GlobalTokens(1)
    assert torch.equal(pat_u.mask(n, m, block_size=bs, heads=2), want_u)
    assert torch.equal(pat_i.mask(n, m, block_size=bs, heads=2), want_i)
    assert torch.equal(P.Union(P.Local(1), P.Causal()).mask(n, m, block_size=bs),
                       P.union(a, P.causal(n=n, m=m, block_size=bs)))


def test_masks_have_documented_shape_device_and_heads():
    for pat in (P.Dense(), P.Causal(), P.Local(1), P.GlobalTokens(1), P.Dilated([2], [2]), P.Hierarchical(2),
                P.Random(0.5)):
        mask = pat.mask(10, 7, block_size=(3, 2), heads=2, device="cpu")
        assert mask.dtype == torch.bool and mask.shape == (1, 2, 4, 4) and mask.is_contiguous()
        assert pat.mask(10, 7, block_size=(3, 2)).shape == (1, 1, 4, 4)
    assert P.dense(n=10, block_size=3).all()


# ---- adaptive -------------------------------------------------------------------------------------------------

def loop_scores(q, k, bs):
    """Scores (B, Hq, nq, nk) from block means written as loops over real rows."""
    bq, bk = pair(bs)
    b, n, hq, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    nq, nk = math.ceil(n / bq), math.ceil(m / bk)
    out = torch.zeros(b, hq, nq, nk, dtype=F64)
    for bb in range(b):
        for h in range(hq):
            for a in range(nq):
                rows = list(queries(a, n, bq))
                mq = sum(q[bb, i, h] for i in rows) / len(rows)
                for c in range(nk):
                    cols = list(keys(c, m, bk))
                    mk = sum(k[bb, j, h // (hq // hk)] for j in cols) / len(cols)
                    out[bb, h, a, c] = mq @ mk
    return out


@pytest.mark.parametrize("n,m,bs", [(10, 10, 2), (7, 12, (2, 3)), (13, 5, (3, 2)), (17, 17, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keep", [0, 1, 2, 0.5])
def test_adaptive_picks_the_best_blocks(n, m, bs, causal, keep):
    bq, bk = pair(bs)
    g = torch.Generator().manual_seed(n * 100 + m)
    q = torch.randn(2, n, 4, 5, generator=g, dtype=F64)
    k = torch.randn(2, m, 2, 5, generator=g, dtype=F64)
    got = P.adaptive(q, k, keep, block_size=bs, causal=causal)
    nq, nk = grid_sizes(n, m, bs)
    assert got.shape == (2, 4, nq, nk) and got.dtype == torch.bool
    scores = loop_scores(q, k, bs)
    count = keep if isinstance(keep, int) else math.ceil(keep * nk)
    for bb in range(2):
        for h in range(4):
            for a in range(nq):
                diag = {c for c in aligned_blocks(a, n, m, bq, bk) if 0 <= c < nk}
                cand = [c for c in range(nk) if c not in diag and (not causal or c * bk <= min((a + 1) * bq, n) - 1
                                                                       + m - n)]
                best = sorted(cand, key=lambda c: -scores[bb, h, a, c].item())[:count]
                want = diag | set(best)
                assert set(got[bb, h, a].nonzero().flatten().tolist()) == want, (bb, h, a)


def test_adaptive_ragged_last_block_is_mean_of_real_rows():
    # key blocks 0..2 hold 0.5, 0.6, 0.7 times e0; the ragged last block one row of 1.0 * e0: with the mean over
    # real rows it scores highest; averaging over the padded block size would rank it last
    d, bs = 3, 4
    k = torch.zeros(1, 13, 1, d)
    for c, val in enumerate((0.5, 0.6, 0.7)):
        k[0, c * bs:(c + 1) * bs, 0, 0] = val
    k[0, 12, 0, 0] = 1.0
    q = torch.zeros(1, 13, 1, d)
    q[..., 0] = 1.0
    got = P.adaptive(q, k, 1, block_size=bs)[0, 0]
    assert got[0].tolist() == [True, False, False, True]  # diagonal 0, best other: the ragged block 3
    assert got[1].tolist() == [False, True, False, True]
    assert got[3].tolist() == [False, False, True, True]  # diagonal 3, best other: block 2
    torch.testing.assert_close(P.block_means(k, bs)[0, 0, :, 0], torch.tensor([0.5, 0.6, 0.7, 1.0]))


def test_adaptive_no_gradient_and_half_precision():
    q = torch.randn(1, 20, 2, 8, requires_grad=True)
    k = torch.randn(1, 20, 2, 8, requires_grad=True)
    mask = P.adaptive(q, k, 2, block_size=4)
    assert not mask.requires_grad and mask.grad_fn is None
    half = P.adaptive(q.detach().bfloat16(), k.detach().bfloat16(), 2, block_size=4)
    assert half.shape == mask.shape and (half.sum(-1) == 3).all()


# ---- attention with each pattern against the reference --------------------------------------------------------

def qkv(b, n, m, hq, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, L, h, d, generator=g, dtype=F64, requires_grad=True)
            for L, h in ((n, hq), (m, hk), (m, hk))]


def check_against_reference(q, k, v, mask, bs, causal):
    out = longattn.block_sparse_attention(q, k, v, block_mask=mask, block_size=bs, causal=causal, backend="torch")
    want = ref.block_sparse_attention(q, k, v, block_mask=mask, block_size=bs, causal=causal)
    torch.testing.assert_close(out, want)
    do = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), do)
    want_grads = torch.autograd.grad(want, (q, k, v), do)
    for g1, g2 in zip(got_grads, want_grads):
        torch.testing.assert_close(g1, g2)
    return out, got_grads


PATTERNS = [P.Local(1), P.Dilated([2, 4], [1, 2]), P.GlobalTokens(1), P.Random(0.4, seed=5), P.Hierarchical(2, 1),
            P.Causal(), P.Local(0) | P.GlobalTokens(1), (P.Local(2) | P.Random(0.3)) & P.Hierarchical(3, 1)]


@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
@pytest.mark.parametrize("n,m,bs", [(19, 19, 4), (13, 22, (4, 3))])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_pattern_matches_reference(pattern, n, m, bs, causal):
    q, k, v = qkv(2, n, m, 4, 2, 8, seed=n + m)
    check_against_reference(q, k, v, pattern.mask(n, m, block_size=bs, heads=4), bs, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_adaptive_mask_matches_reference(causal):
    q, k, v = qkv(2, 21, 21, 4, 2, 8, seed=3)
    mask = P.adaptive(q, k, 2, block_size=4, causal=causal)
    check_against_reference(q, k, v, mask, 4, causal)


def test_empty_rows_give_zeros():
    n, bs = 20, 4
    mask = P.dilated([4], [2], n=n, block_size=bs)  # query blocks 1 and 3 are selected by no branch
    empty = ~mask[0, 0].any(-1)
    assert empty.tolist() == [False, True, False, True, False]
    q, k, v = qkv(1, n, n, 2, 2, 8, seed=9)
    out, (dq, _, _) = check_against_reference(q, k, v, mask, bs, causal=False)
    rows = empty.repeat_interleave(bs)[:n]
    assert (out[:, rows] == 0).all() and (dq[:, rows] == 0).all() and out[:, ~rows].abs().sum() > 0


# ---- BlockSparsePattern ------------------------------------------------------------------------------------------

def test_block_sparse_pattern_caches_lists_and_copies():
    _require_interpreter()
    pat = (P.Local(1) | P.GlobalTokens(1)).build(30, 26, block_size=(4, 3), heads=2)
    assert pat.seq_lens == (30, 26) and pat.block_size == (4, 3) and pat.mask.shape == (1, 2, 8, 9)
    for causal in (False, True):
        lists = pat.block_lists("cpu", causal=causal)
        assert pat.block_lists(torch.device("cpu"), causal=causal) is lists  # computed once
        assert_lists_equal(lists, lists_spec(pat.mask, (4, 3), (30, 26), causal))
    assert pat.to("cpu") is pat
    assert torch.equal(P.BlockSparsePattern(pat.mask, (4, 3)).block_lists().kv_num.sum(-1),
                       pat.mask.sum(-1, dtype=torch.int32))  # without lengths: every allowed block, as partial


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_pattern_whose_mask_was_edited_in_place_is_refused(backend):
    """The Triton backend ran on the block lists cached from the mask as it was at the first call (1.47 off the
    reference after one block was switched off in place), the PyTorch backend on the edited mask: two answers, one
    silently stale. Every use after an in-place write to the mask (or to a device copy's) is now an error, on
    every backend; a new pattern for the new mask runs."""
    if backend == "triton":
        _require_interpreter()
    q, k, v = qkv(1, 32, 32, 2, 2, 16, seed=6)
    q, k, v = (x.float() for x in (q, k, v))
    pat = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, seq_lens=(32, 32))
    longattn.block_sparse_attention(q, k, v, block_mask=pat, causal=False, backend=backend)
    pat.mask[0, 0, 1, 0] = False
    with pytest.raises(RuntimeError, match="modified in place"):
        longattn.block_sparse_attention(q, k, v, block_mask=pat, backend=backend)
    with pytest.raises(RuntimeError, match="modified in place"):
        pat.to("cpu")
    with pytest.raises(RuntimeError, match="modified in place"):
        BlockSparseAttention(pat, backend=backend)(q, k, v)
    fresh = P.BlockSparsePattern(pat.mask, 16, seq_lens=(32, 32))
    want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=pat.mask, block_size=16)
    got = longattn.block_sparse_attention(q, k, v, block_mask=fresh, backend=backend)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # a module holding patterns (their masks written in place while built) copies and pickles as it was; a write
    # to a copy's mask is seen too
    mod = BlockSparseAttention(P.Local(1).builder(block_size=16), backend=backend)
    mod(q, k, v)
    for clone in (copy.deepcopy(mod), pickle.loads(pickle.dumps(mod))):
        torch.testing.assert_close(clone(q, k, v), mod(q, k, v))
    clone.pattern_for(32, 32, q.device).mask.logical_not_()
    with pytest.raises(RuntimeError, match="modified in place"):
        clone(q, k, v)


def test_block_lists_written_in_place_before_the_backward_are_an_error():
    """The Triton backward reads the call's block lists (public through ``BlockSparsePattern.block_lists``): written
    in place between the forward and the backward they gave the gradients of another mask silently. They are saved
    for the backward now, as a packed batch's bounds and ALiBi's slopes are, so PyTorch refuses that backward; left
    alone, the gradients are the reference's."""
    _require_interpreter()
    q, k, v = (x.float().requires_grad_() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    pat = P.BlockSparsePattern(torch.tensor([[True, False], [True, True]])[None, None], 16, seq_lens=(32, 32))
    out = longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton")
    lists = pat.block_lists("cpu", causal=False)
    assert lists.q_idx is not None
    for t in (lists.kv_idx, lists.q_idx):
        t.add_(0)  # (a write: its version moves; the values stay)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
        out = longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton")
    got = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(ref.block_sparse_attention(q64, k64, v64, block_mask=pat.mask, block_size=16).sum(),
                               (q64, k64, v64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_a_copy_of_a_pattern_whose_mask_was_edited_in_place_is_refused_too():
    """A copy or pickle took the written mask's version anew (a new tensor's counter starts afresh), so the copy ran
    on the block lists cached from the old mask (1.47 off the reference on the Triton backend); copy.copy, which
    shares the version list, cleared the original's refusal as well."""
    _require_interpreter()
    q, k, v = (x.float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    pat = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, seq_lens=(32, 32))
    longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton")
    pat.mask[0, 0, 1, 0] = False
    for made in (copy.copy(pat), copy.deepcopy(pat), pickle.loads(pickle.dumps(pat)), pat):
        with pytest.raises(RuntimeError, match="modified in place"):
            longattn.block_sparse_attention(q, k, v, block_mask=made, backend="triton")
    fine = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, seq_lens=(32, 32))
    for made in (copy.copy(fine), copy.deepcopy(fine), pickle.loads(pickle.dumps(fine)), fine):  # (unchanged: run)
        longattn.block_sparse_attention(q, k, v, block_mask=made, backend="triton")


def test_a_pattern_of_an_inference_mask_keeps_the_mask_as_given():
    """A mask made under torch.inference_mode() has no version counter, so a write into it went unseen: the
    Triton backend kept the block lists of the mask as it was (1.56 off the reference of the written mask), the
    PyTorch backend read the written one. The pattern now keeps a copy of such a mask (the same answer on every
    backend, the mask as given), and a write into that copy is refused as for any pattern."""
    _require_interpreter()
    q, k, v = (x.float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    with torch.inference_mode():
        mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
        mask[0, 0, 1, 0] = False
        pat = P.BlockSparsePattern(mask, 16)
        want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=mask.clone(), block_size=16)
        for backend in ("triton", "torch"):
            got = longattn.block_sparse_attention(q, k, v, block_mask=pat, backend=backend)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        mask[0, 0, 1, 0] = True  # (the tensor given: not the pattern's)
        mask[0, 0, 0, 1] = False
        for backend in ("triton", "torch"):
            got = longattn.block_sparse_attention(q, k, v, block_mask=pat, backend=backend)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        pat.mask[0, 0, 0, 0] = False
        for backend in ("triton", "torch"):
            with pytest.raises(RuntimeError, match="modified in place"):
                longattn.block_sparse_attention(q, k, v, block_mask=pat, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_compiled_call_refuses_a_pattern_whose_mask_was_edited_in_place(backend):
    """Under ``torch.compile`` the pattern's version check was skipped (tracing reads no version counter) and the
    graph kept the block lists cached when it was traced: after an in-place write to the mask the compiled Triton
    call still ran the old mask (0.48 off the reference for the new one) while the PyTorch backend, which runs
    eagerly inside the graph, read the new one. The check is now a node of the graph, run on every call: a compiled
    call refuses as an eager one does, and the Triton route still compiles as one graph."""
    if backend == "triton":
        _require_interpreter()
    q, k, v = (x.detach().float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    pat = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool).tril(), 16, seq_lens=(32, 32))
    longattn.block_sparse_attention(q, k, v, block_mask=pat, backend=backend)  # (lists and is_full cached)
    mod = BlockSparseAttention(pat, backend=backend)
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=backend == "triton")
    want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=pat.mask, block_size=16)
    torch.testing.assert_close(compiled(q, k, v).double(), want, atol=1e-5, rtol=1e-5)
    pat.mask[0, 0, 1, 0] = False
    with pytest.raises(RuntimeError, match="modified in place"):
        compiled(q, k, v)


def test_the_compiled_mask_check_reads_the_export_flag(monkeypatch):
    """Dynamo up to PyTorch 2.11 traced ``torch.compiler.is_exporting()`` as a constant True inside
    ``torch.compile`` too, so every compiled call left its mask check out (on the GPU machine's torch 2.11 an edited
    mask was served silently). Whether a trace is an export is read from the flag ``torch.export`` sets, whatever
    ``is_exporting()`` answers."""
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert P.pattern._compiling_not_exporting() is (not torch.compiler._is_exporting_flag)
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)
    assert P.pattern._compiling_not_exporting() is False


def test_a_compiled_call_keeps_nothing_on_the_pattern():
    """Block lists (and device copies) made inside a ``torch.compile`` graph were kept on the pattern, as graph
    outputs: under CUDA graphs (``mode="reduce-overhead"``) the next replay writes over them, and the first compiled
    block-sparse call on an H200 raised "accessing tensor output of CUDAGraphs that has been overwritten". A traced
    call now keeps nothing there (it converts the mask in its graph); an eager call still fills the cache."""
    _require_interpreter()
    q, k, v = (x.detach().float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    pat = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool).tril(), 16, seq_lens=(32, 32))
    compiled = torch.compile(lambda q, k, v: longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton"),
                             backend="aot_eager", fullgraph=True)
    want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=pat.mask, block_size=16)
    copies = dict(pat._copies)  # (the pattern itself, on its mask's device)
    for _ in range(2):
        torch.testing.assert_close(compiled(q, k, v).double(), want, atol=1e-5, rtol=1e-5)
    assert not pat._lists and pat._copies == copies
    longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton")
    assert pat._lists


def test_a_compiled_block_sparse_call_checks_its_mask_once():
    """Under ``torch.compile`` the mask check is a node of the graph, run on every call: a Triton call made three
    (the device copy, the dense-kernel choice, the block lists), 11 us each on a 2-core CPU where the eager checks
    take a microsecond. One node a call, and the call's result unchanged."""
    _require_interpreter()
    q, k, v = (x.detach().float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    pat = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool).tril(), 16, seq_lens=(32, 32))
    want = longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton")  # (is_full and lists cached)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda q, k, v: longattn.block_sparse_attention(q, k, v, block_mask=pat, backend="triton"),
                             backend=keep_graph, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), want)
    checks = [n for g in graphs for n in g.graph.nodes if "masks_unchanged" in str(n.target)]
    assert len(checks) == 1, [str(n.target) for n in checks]


def test_block_sparse_modules_compile_as_one_graph():
    """``torch.compile(fullgraph=True)`` refused a pattern's first use on the Triton route ("Could not guard on
    data-dependent expression"): choosing the dense kernels read whether the mask allows every block pair, a host
    read that breaks the graph. Traced, a pattern whose answer is not known yet now runs its block lists, which
    serve any mask: one graph, with the reference's output and gradients (a pattern of every block pair too)."""
    _require_interpreter()
    q, k, v = (x.detach().float().requires_grad_() for x in qkv(1, 40, 40, 2, 2, 16, seed=7))
    for pattern, mask in ((P.Local(1).builder(block_size=16), P.Local(1).mask(40, block_size=16)),
                          (P.Dense().build(40, block_size=16), P.Dense().mask(40, block_size=16))):
        compiled = torch.compile(BlockSparseAttention(pattern, causal=True, backend="triton"), backend="aot_eager",
                                 fullgraph=True)
        out = compiled(q, k, v)
        x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        want = ref.block_sparse_attention(*x64, block_mask=mask, block_size=16, causal=True)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        for got, exact in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), x64)):
            torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


def test_an_exported_pattern_call_keeps_its_mask_as_exported(tmp_path):
    """``torch.export`` keeps the mask and block lists as constants, as it keeps parameters: the in-graph check of a
    compiled call is left out of the exported program, which runs, saved and loaded too (the loaded constants are
    new tensors, whose version counters are not the mask's)."""
    q, k, v = (x.detach().float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    mod = BlockSparseAttention(P.Local(0).builder(block_size=16), backend="torch")
    want = mod(q, k, v)  # (the pattern built and its version taken before the export)
    program = torch.export.export(mod, (q, k, v), strict=False)
    torch.export.save(program, tmp_path / "program.pt2")
    for made in (program, torch.export.load(tmp_path / "program.pt2")):
        torch.testing.assert_close(made.module()(q, k, v), want)


def test_a_pattern_exported_before_any_eager_call_still_runs_eagerly():
    """A non-strict ``torch.export`` traces with fake tensors: the block lists and device copies it made were kept on
    the pattern, and the next eager call on the Triton route raised "Cannot access data pointer of Tensor (e.g.
    FakeTensor...)". A traced call keeps nothing on the pattern: the exported program and a later eager call both
    give the reference's output."""
    _require_interpreter()
    q, k, v = (x.detach().float() for x in qkv(1, 32, 32, 2, 2, 16, seed=6))
    pat = P.BlockSparsePattern(torch.ones(1, 1, 2, 2, dtype=torch.bool).tril(), 16, seq_lens=(32, 32))
    mod = BlockSparseAttention(pat, backend="triton")
    program = torch.export.export(mod, (q, k, v), strict=False)
    assert not pat._lists
    want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=pat.mask, block_size=16)
    for run in (program.module(), mod):
        torch.testing.assert_close(run(q, k, v).double(), want, atol=1e-5, rtol=1e-5)


def test_density_and_causal_density():
    mask = P.local(1, n=40, block_size=4)
    pat = P.BlockSparsePattern(mask, 4, seq_lens=(40, 40))
    assert pat.density == pytest.approx(mask.sum().item() / 100)
    assert pat.causal_density == pytest.approx(19 / 55)  # lower band (10 + 9) of the 55 causal blocks
    assert P.Dense().build(40, block_size=4).causal_density == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        P.BlockSparsePattern(mask, 4).causal_density


def _require_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by the conftest without a GPU)")


@pytest.mark.parametrize("causal", [False, True])
def test_mask_conversion_matches_the_spec(causal):
    """The one-launch converter (interpreter) against the lists stated in PyTorch: random masks with broadcast
    leading dims, ragged ends, N != M both ways, rows longer than one chunk of the converter."""
    _require_interpreter()
    from longattn.backends.triton import lists as L

    g = torch.Generator().manual_seed(3)
    for shape, bs, lens in (((2, 3, 5, 7), (16, 8), (70, 50)), ((1, 2, 9, 4), (4, 16), (33, 64)),
                            ((1, 1, 3, 40), (32, 2), (90, 79)), ((2, 1, 1, 1), (16, 16), (5, 3))):
        mask = torch.rand(shape, generator=g) < 0.4
        assert_lists_equal(L.block_lists_from_mask(mask, bs, lens, causal), lists_spec(mask, bs, lens, causal))
        assert_lists_equal(L.block_lists_from_mask(mask.transpose(-1, -2).contiguous().transpose(-1, -2), bs, lens,
                                                   causal), lists_spec(mask, bs, lens, causal))  # any strides
        assert_lists_equal(L.block_lists_from_mask(mask), lists_spec(mask))
        forward_only = L.block_lists_from_mask(mask, bs, lens, causal, backward=False)
        assert forward_only.q_num is None and forward_only.q_idx is None
        want = lists_spec(mask, bs, lens, causal)
        assert torch.equal(forward_only.kv_num, want[0])
    monkey = L._MAX_CHUNK
    try:
        L._MAX_CHUNK = 16  # rows of 40 blocks in three chunks
        mask = torch.rand(1, 2, 40, 37, generator=g) < 0.5
        assert_lists_equal(L.block_lists_from_mask(mask, (4, 4), (160, 148), causal),
                           lists_spec(mask, (4, 4), (160, 148), causal))
    finally:
        L._MAX_CHUNK = monkey


def test_block_lists_need_the_kernels_device(monkeypatch):
    pat = P.Local(1).build(32, block_size=16)
    monkeypatch.setattr("longattn.patterns.pattern.interpret_mode", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        pat.block_lists("cpu")


def test_cached_lists_drive_the_kernel():
    """The cached lists given to the Triton kernels (interpreter on CPU) give the reference's result."""
    _require_interpreter()
    from longattn.backends.triton import entry as ops
    from longattn.call import AttentionCall, BlockSparse

    n, bs = 48, 16
    pat = (P.Local(0) | P.GlobalTokens(1)).build(n, block_size=bs)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 1, 16, generator=g).to(torch.float16) for _ in range(3))
    blocks = BlockSparse(pat.mask, (bs, bs), pat.block_lists(q.device, causal=True))
    out, _ = ops.attention(q, k, v, AttentionCall(scale=0.25, causal=True, blocks=blocks))
    want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=pat.mask, block_size=bs,
                                      causal=True, scale=0.25)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)


def test_functional_takes_a_pattern_and_reuses_its_lists():
    """``block_mask=pattern`` gives what the raw mask gives, converts once, and checks block size and lengths."""
    _require_interpreter()
    n, m, bs = 30, 26, (4, 3)
    q, k, v = qkv(1, n, m, 2, 2, 8, seed=11)
    for seq_lens in ((n, m), None):
        pat = P.BlockSparsePattern((P.Local(1) | P.Random(0.3, seed=2)).mask(n, m, block_size=bs, heads=2), bs,
                                   seq_lens=seq_lens)
        for causal in (False, True):
            got = longattn.block_sparse_attention(q, k, v, block_mask=pat, causal=causal, backend="torch")
            want = ref.block_sparse_attention(q, k, v, block_mask=pat.mask, block_size=bs, causal=causal)
            torch.testing.assert_close(got, want)
        lists = pat.block_lists("cpu", causal=True, seq_lens=(n, m))
        assert pat.block_lists("cpu", causal=True, seq_lens=(n, m)) is lists
        assert_lists_equal(lists, lists_spec(pat.mask, bs, (n, m), True))
    with pytest.raises(ValueError, match="block_size"):
        longattn.block_sparse_attention(q, k, v, block_mask=pat, block_size=4, backend="torch")
    built = P.Local(1).build(n, m, block_size=bs)
    with pytest.raises(ValueError, match="built for"):
        longattn.block_sparse_attention(q[:, :-4], k, v, block_mask=built, backend="torch")
    with pytest.raises(ValueError, match="seq_lens"):
        built.block_lists("cpu", seq_lens=(n, m + 1))


def test_functional_pattern_drives_the_kernel():
    _require_interpreter()
    n, bs = 40, 16
    pat = (P.Local(0) | P.GlobalTokens(1)).build(n, block_size=bs)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g).to(torch.float16) for _ in range(3))
    out = longattn.block_sparse_attention(q, k, v, block_mask=pat, causal=True, backend="triton")
    want = ref.block_sparse_attention(q.double(), k.double(), v.double(), block_mask=pat.mask, block_size=bs,
                                      causal=True)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    assert (pat.block_lists(q.device, causal=True, seq_lens=(n, n)).kv_num.sum() > 0)


def test_full_pattern_runs_the_dense_kernels():
    """A pattern that allows every block pair is dense attention: the kernels' range path runs (no block lists are
    made), with the same result as the reference, causal or not, with gradients."""
    _require_interpreter()
    n, m, bs = 37, 29, 16
    pat = P.Dense().build(n, m, block_size=bs)
    assert pat.is_full and not P.Local(0).build(n, m, block_size=bs).is_full
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, n, 2, 16, generator=g).to(torch.float16).requires_grad_()
    k, v = (torch.randn(1, m, 2, 16, generator=g).to(torch.float16).requires_grad_() for _ in range(2))
    do = torch.randn(1, n, 2, 16, generator=g).to(torch.float16)
    for causal in (False, True):
        out = longattn.block_sparse_attention(q, k, v, block_mask=pat, causal=causal, backend="triton")
        got = torch.autograd.grad(out, (q, k, v), do)
        qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
        want = ref.block_sparse_attention(qd, kd, vd, block_mask=pat.mask, block_size=bs, causal=causal)
        grads = torch.autograd.grad(want, (qd, kd, vd), do.double())
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
        for a, b in zip(got, grads):
            torch.testing.assert_close(a.double(), b, atol=5e-3, rtol=5e-3)
    assert not pat._lists  # the dense path needs no block lists


# ---- modules -----------------------------------------------------------------------------------------------------

def test_block_sparse_attention_module_equals_functional():
    q, k, v = qkv(2, 19, 19, 4, 2, 8, seed=4)
    pat = (P.Local(1) | P.Random(0.3, seed=1)).build(19, block_size=4, heads=4)
    mod = BlockSparseAttention(pat, causal=True, scale=0.3, backend="torch")
    want = longattn.block_sparse_attention(q, k, v, block_mask=pat.mask, block_size=4, causal=True, scale=0.3,
                                           backend="torch")
    torch.testing.assert_close(mod(q, k, v), want)


def test_module_builds_and_caches_pattern_per_length():
    calls = []
    build = P.Local(1).builder(block_size=(4, 3))

    def counting(n, m, device):
        calls.append((n, m))
        return build(n, m, device)

    mod = BlockSparseAttention(counting, backend="torch")
    for n, m in ((11, 11), (11, 11), (9, 14), (11, 11)):
        q, k, v = qkv(1, n, m, 2, 1, 8, seed=n)
        want = longattn.block_sparse_attention(q, k, v, block_mask=P.local(1, n=n, m=m, block_size=(4, 3)),
                                               block_size=(4, 3), backend="torch")
        torch.testing.assert_close(mod(q, k, v), want)
    assert calls == [(11, 11), (9, 14)]
    with pytest.raises(TypeError, match="BlockSparsePattern"):
        BlockSparseAttention(lambda n, m, d: P.local(1, n=n, m=m), backend="torch")(*qkv(1, 4, 4, 1, 1, 4, 0))


def test_module_pattern_assigned_anew_drops_the_patterns_built_before():
    """Assigning a module another pattern builder (a wider window during training) kept serving the patterns the
    first builder had made for the lengths already seen: the new pattern was silently ignored for them."""
    q, k, v = qkv(1, 64, 64, 2, 2, 8, seed=7)
    mod = BlockSparseAttention(P.Local(0).builder(block_size=16), backend="torch")
    mod(q, k, v)
    mod.pattern = P.Local(2).builder(block_size=16)
    want = ref.block_sparse_attention(q, k, v, block_mask=P.local(2, n=64, block_size=16), block_size=16)
    torch.testing.assert_close(mod(q, k, v), want)
    layer = MultiheadBlockSparseAttention(16, 2, P.Local(0).builder(block_size=16), backend="torch")
    with pytest.raises(TypeError, match="pattern must be"):
        layer.attention.pattern = P.Local(1)


class _LocalBuilder(torch.nn.Module):
    """A pattern builder that is an ``nn.Module`` (a callable ``(N, M, device) -> BlockSparsePattern``)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, n, m, device):
        return P.Local(self.width).build(n, m, block_size=16, device=device)


def test_module_pattern_builder_that_is_a_module():
    """A builder that is an nn.Module is registered as a submodule by nn.Module's __setattr__, past a property's
    setter: the pattern's cache was then never made (AttributeError '_built' on the first call). It runs, and
    assigning another one drops the patterns built before."""
    q, k, v = qkv(1, 64, 64, 2, 2, 8, seed=7)
    mod = BlockSparseAttention(_LocalBuilder(0), backend="torch")
    want = ref.block_sparse_attention(q, k, v, block_mask=P.local(0, n=64, block_size=16), block_size=16)
    torch.testing.assert_close(mod(q, k, v), want)
    mod.pattern = _LocalBuilder(2)
    want = ref.block_sparse_attention(q, k, v, block_mask=P.local(2, n=64, block_size=16), block_size=16)
    torch.testing.assert_close(mod(q, k, v), want)
    assert isinstance(mod.pattern, _LocalBuilder) and mod.pattern.width == 2


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_multihead_module_equals_functional(kv_heads):
    torch.manual_seed(0)
    e, h, n = 32, 4, 23
    pattern = (P.Local(1) | P.GlobalTokens(1)).builder(block_size=8)
    mod = MultiheadBlockSparseAttention(e, h, pattern, num_kv_heads=kv_heads, causal=True, backend="torch",
                                        dtype=F64)
    x = torch.randn(2, n, e, dtype=F64, requires_grad=True)
    got = mod(x)
    q = mod.q_proj(x).view(2, n, h, e // h)
    k = mod.k_proj(x).view(2, n, kv_heads, e // h)
    v = mod.v_proj(x).view(2, n, kv_heads, e // h)
    att = longattn.block_sparse_attention(q, k, v, block_mask=pattern(n, n).mask, block_size=8, causal=True,
                                          backend="torch")
    want = mod.out_proj(att.reshape(2, n, e))
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert x.grad is not None and mod.q_proj.weight.grad is not None


# ---- argument errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,name", [
    (lambda: P.Local(-1), "window"),
    (lambda: P.GlobalTokens(-2), "n_global"),
    (lambda: P.Random(1.5), "density"),
    (lambda: P.Random(0.5, seed=-1), "seed"),
    (lambda: P.Hierarchical(0), "levels"),
    (lambda: P.Hierarchical(2, base=0), "base"),
    (lambda: P.Dilated([0], [1]), "segment_lengths"),
    (lambda: P.Dilated([4, 8], [1]), "dilation_rates"),
    (lambda: P.local(1, n=0), "n"),
    (lambda: P.local(1, n=8, m=-3), "m"),
    (lambda: P.local(1, n=8, block_size=0), "block_size"),
    (lambda: P.local(1, n=8, heads=0), "heads"),
    (lambda: P.Local(1).builder(block_size=(4, 0)), "block_size"),
    (lambda: P.union(P.local(1, n=8, block_size=2), P.local(1, n=8, block_size=4)), "masks"),
    (lambda: P.adaptive(torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4), -1, block_size=4), "keep"),
    (lambda: P.adaptive(torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4), 1.5, block_size=4), "keep"),
    (lambda: P.adaptive(torch.randn(1, 8, 3, 4), torch.randn(1, 8, 2, 4), 1, block_size=4), "heads"),
    (lambda: P.BlockSparsePattern(torch.ones(1, 1, 3, 3, dtype=torch.bool), 4, seq_lens=(20, 12)), "seq_lens"),
    (lambda: P.BlockSparsePattern(torch.ones(3, 3, dtype=torch.bool), 4), "mask"),
    (lambda: BlockSparseAttention(P.Dense().build(8, block_size=4), backend="cuda"), "backend"),
    (lambda: MultiheadBlockSparseAttention(30, 4, P.Dense().builder()), "embed_dim"),
    (lambda: MultiheadBlockSparseAttention(32, 4, P.Dense().builder(), num_kv_heads=3), "num_kv_heads"),
    (lambda: MultiheadBlockSparseAttention(32, 4, P.Dense().builder(), dropout=1.0), "dropout"),
])
def test_bad_arguments_raise_value_error_naming_them(make, name):
    with pytest.raises(ValueError, match=name):
        make()


@pytest.mark.parametrize("make,name", [
    (lambda: P.Local(1.5), "window"),
    (lambda: P.Random("dense"), "density"),
    (lambda: P.adaptive(torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4), "all", block_size=4), "keep"),
    (lambda: P.union(P.local(1, n=8), torch.ones(1, 1, 1, 1)), "masks"),
    (lambda: P.BlockSparsePattern(torch.ones(1, 1, 2, 2), 4), "mask"),
    (lambda: BlockSparseAttention("local"), "pattern"),
    (lambda: P.Local(1) | "causal", "unsupported operand"),
])
def test_wrong_kinds_raise_type_error(make, name):
    with pytest.raises(TypeError, match=name):
        make()


@pytest.mark.parametrize("flag", ["False", 1, None])
def test_adaptive_refuses_a_non_bool_causal(flag):
    """Flags are bools (README): ``adaptive`` read ``"False"`` as true and returned the causal selection."""
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(TypeError, match="adaptive: causal"):
        longattn.patterns.adaptive(q, q, 2, block_size=4, causal=flag)


@pytest.mark.parametrize("n,m", [(0, 12), (12, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_on_zero_length_sequences(n, m, causal):
    """No queries or no keys: an empty block grid (as block_sparse_attention takes), not an IndexError."""
    q, k = torch.randn(2, n, 4, 8), torch.randn(2, m, 2, 8)
    mask = P.adaptive(q, k, 1, block_size=4, causal=causal)
    assert mask.shape == (2, 4, -(-n // 4), -(-m // 4)) and mask.dtype == torch.bool
    out = longattn.block_sparse_attention(q, k, k, block_mask=mask, block_size=4, causal=causal, backend="torch")
    assert out.shape == q.shape and not out.any()
    assert P.block_means(q, 4).shape == (2, 4, -(-n // 4), 8)


def test_a_pattern_whose_block_is_longer_than_the_sequence_runs_as_the_same_raw_mask():
    """A block longer than the sequence is the sequence (one block), for a pattern as for a raw mask: the Triton
    kernels take both, with the same answer."""
    from longattn.backends.device import interpret_mode
    if not interpret_mode():
        pytest.skip("runs the Triton kernels in the interpreter")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16) for _ in range(3))
    m = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    want = longattn.block_sparse_attention(q, k, v, block_mask=m, block_size=10 ** 12, causal=True,
                                           backend="triton")
    got = longattn.block_sparse_attention(q, k, v, block_mask=P.BlockSparsePattern(m, 10 ** 12), causal=True,
                                          backend="triton")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, longattn.flash_attention(q, k, v, causal=True, backend="torch"))


@pytest.mark.parametrize("combine", [P.union, P.intersection])
def test_union_and_intersection_refuse_masks_of_another_grid(combine):
    """Only the leading (B, H) dims broadcast: a mask with one query or key block (a shorter sequence) was
    broadcast over the other mask's grid and combined silently."""
    a = P.local(0, n=48, block_size=16)  # (1, 1, 3, 3)
    for other in (P.local(0, n=48, m=16, block_size=16), P.local(0, n=16, m=48, block_size=16)):
        with pytest.raises(ValueError, match=r"same block grid .*mask 1 has \("):
            combine(a, other)
    assert combine(a, P.random(0.5, n=48, block_size=16, heads=2)).shape == (1, 2, 3, 3)  # heads still broadcast


def test_adaptive_fraction_is_not_lifted_by_float_error():
    """``keep=0.07`` of 100 key blocks is 7 blocks: ``0.07 * 100 == 7.000000000000001`` took 8."""
    q = torch.randn(1, 100, 1, 4, generator=torch.Generator().manual_seed(0))
    mask = P.adaptive(q, q, 0.07, block_size=1)
    assert (mask.sum(-1) == 1 + 7).all()  # the diagonal and 7 others
    assert (P.adaptive(q, q, 0.075, block_size=1).sum(-1) == 1 + 8).all()  # a true fraction still rounds up


def test_block_lists_refuse_lengths_of_another_grid():
    """Lists for lengths whose grid is not the mask's would be silently wrong (all blocks full, or cut): refused
    before any conversion, naming the argument; so are a non-pair and a non-bool causal."""
    pat = P.BlockSparsePattern(torch.ones(1, 1, 3, 3, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match=r"block_lists: seq_lens=\(400, 400\) .* needs a \(25, 25\) block grid"):
        pat.block_lists("cpu", seq_lens=(400, 400))
    with pytest.raises(TypeError, match="block_lists: seq_lens"):
        pat.block_lists("cpu", seq_lens=5)
    with pytest.raises(TypeError, match="block_lists: seq_lens"):
        pat.block_lists("cpu", seq_lens=("33", 33))
    with pytest.raises(TypeError, match="block_lists: causal"):
        pat.block_lists("cpu", causal="yes")


def test_modules_name_a_pattern_of_the_wrong_kind_or_heads():
    """A builder for other heads is refused at construction (it failed at the first call, as a mask shape); a
    Pattern object, which is not callable, gets the way to make one."""
    with pytest.raises(ValueError, match="heads=3; it must be 1 .* num_heads=4"):
        MultiheadBlockSparseAttention(32, 4, P.Local(1).builder(block_size=16, heads=3))
    MultiheadBlockSparseAttention(32, 4, P.Local(1).builder(block_size=16, heads=4))
    with pytest.raises(TypeError, match=r"Local\(1\)\.builder\(block_size=\.\.\.\)"):
        BlockSparseAttention(P.Local(1))


def test_repr_of_a_pattern_on_the_meta_device():
    """``repr`` read the density of a meta mask, which holds no values ("Tensor.item() cannot be called on meta
    tensors"): the density is left out there."""
    pat = P.Local(1).build(64, block_size=16, device="meta")
    assert repr(pat) == "BlockSparsePattern(shape=(1, 1, 4, 4), block_size=(16, 16), seq_lens=(64, 64), device=meta)"
    assert "density=0.625" in repr(P.Local(1).build(64, block_size=16))
