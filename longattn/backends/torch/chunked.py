"""Attention calls on PyTorch operations (the PyTorch backend's ``attention``), on any device, differentiable.

Memory stays bounded: the work is cut into chunks of query rows (and, where needed, of the batch) so that no chunk
holds more than the routing's ``torch_score_budget`` attention scores, and each chunk only looks at the keys its
rows can reach (a causal or sliding-window chunk skips the keys outside its band). Under autograd every chunk is checkpointed:
the backward recomputes a chunk's scores instead of keeping them (from the same ALiBi slopes and block mask: one
modified in place before the backward is an error), except under ``torch.func``'s ``grad``/``vjp``/``jacrev``,
which allow no checkpoint (the scores are kept there). Grouped-query heads are attended without
repeating k and v. Half-precision inputs are computed in float32.

Every function returns ``(out, lse)``: out shaped and typed like q, lse ``(B, Hq, N)`` in float32 (float64 for
float64 inputs). A query with no allowed key has output 0 and lse ``-inf``; its gradients are 0, never NaN.
The semantics are those of :mod:`longattn.reference`, which this module is tested against; it shares no code with
it on purpose.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longattn._empty import empty_attention
from longattn._tracing import export_flag
from longattn._validation import host_values
from longattn.backends import routing
from longattn.call import AttentionCall, Band, Branch, accumulator_dtype, dequantize, merge_partial, modify_scores

# keys(a, b) -> the key range [lo, hi) that query rows [a, b) can reach
KeyRange = Callable[[int, int], Tuple[int, int]]
# allowed(batch, a, b, lo, hi) -> bool mask broadcastable to (batch rows, Hq, b - a, hi - lo), or None (all allowed)
ChunkMask = Callable[[slice, int, int, int, int], Optional[Tensor]]
# modify(s, batch, a, b, lo, hi) -> the scores of rows [a, b) over keys [lo, hi) after soft-capping and ALiBi
ScoreMod = Callable[[Tensor, slice, int, int, int, int], Tensor]


def _score_budget() -> int:
    """The routing's ``torch_score_budget`` (:class:`longattn.backends.routing.Routing`). Dynamo reads no
    ContextVar, so a strict ``torch.export``, which traces the chunk loops, takes it as a constant: the budget in
    force at the export, kept by the program (it sizes the chunks, not the results)."""
    return routing.current().torch_score_budget


# what torch.compiler.assume_constant_result marks, set without importing torch._dynamo for eager calls
_score_budget._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _band_sides(causal: bool, window: Tuple[int, int] = (-1, -1)) -> Tuple[Optional[int], Optional[int]]:
    """``(left, right)`` of :meth:`longattn.call.Band.of` (read field by field: Dynamo before PyTorch 2.13 cannot
    trace ``dataclasses.astuple`` of it, which a strict ``torch.export`` needs)."""
    band = Band.of(causal, window)
    return band.left, band.right


def _chunks(batch: int, n: int, m: int, heads: int, keys: KeyRange) -> Iterator[Tuple[slice, int, int, int, int]]:
    """Cut ``batch x n`` query rows into chunks of at most ``torch_score_budget`` scores (a field of the routing in
    force, :class:`longattn.backends.routing.Routing`; one row still counts as one chunk if it alone exceeds the
    budget). Yields ``(batch slice, a, b, lo, hi)``: rows ``[a, b)`` over keys ``[lo, hi)``."""
    budget = _score_budget()
    per_batch = max(1, heads * n * m)
    step = max(1, min(batch, budget // per_batch))  # whole sequences per chunk while they fit
    # (one chunk for a batch that fits: no loop over a batch that torch.export keeps symbolic, dilated segments)
    for b0 in ((0,) if 0 < batch and batch * per_batch <= budget else range(0, batch, step)):
        bs = slice(b0, min(batch, b0 + step))
        rows_heads = (bs.stop - bs.start) * heads
        a = 0
        while a < n:
            b = n
            lo, hi = keys(a, b)
            while b - a > 1 and rows_heads * (b - a) * max(hi - lo, 1) > budget:
                b = a + (b - a + 1) // 2
                lo, hi = keys(a, b)
            yield bs, a, b, lo, max(lo, hi)
            a = b


def _heads_major(x: Tensor, hk: int) -> Tensor:
    """``(B, n, Hq, D)`` -> ``(B, Hk, G * n, D)``: the ``G = Hq // Hk`` query heads that share a key/value head
    stacked along the rows, so that one matrix product per key/value head serves the whole group."""
    b, n, hq, d = x.shape
    return x.reshape(b, n, hk, hq // hk, d).permute(0, 2, 3, 1, 4).reshape(b, hk, -1, d)


def _seq_major(x: Tensor, n: int) -> Tensor:
    """Inverse of :func:`_heads_major`: ``(B, Hk, G * n, D)`` -> ``(B, n, Hk * G, D)``."""
    b, hk, gn, d = x.shape
    return x.reshape(b, hk, gn // n, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, -1, d)


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``scale * q k^T`` for grouped-query heads: q ``(B, n, Hq, D)``, k ``(B, m, Hk, D)`` -> ``(B, Hq, n, m)``."""
    b, n, hq, _ = q.shape
    s = torch.matmul(_heads_major(q * scale, k.shape[2]), k.permute(0, 2, 3, 1))
    return s.view(b, hq, n, k.shape[1])


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: float,
            modify: Optional[Callable[[Tensor], Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention of q over (k, v) restricted to ``allowed``: out ``(B, n, Hq, D)``, lse ``(B, Hq, n)``;
    ``modify`` changes the scaled scores before the mask (soft-capping, ALiBi).

    A row with no allowed key gets output 0 and lse ``-inf``, with zero gradients.
    """
    b, n, hq, _ = q.shape
    hk, m = k.shape[2], k.shape[1]
    s = _scores(q, k, scale)
    if modify is not None:
        s = modify(s)
    if allowed is not None:
        s = s.masked_fill_(~allowed, float("-inf"))
    shift = s.detach().amax(-1, keepdim=True) if m > 0 else s.new_zeros(b, hq, n, 1)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # rows without keys: any shift
    p = s.sub_(shift).exp_()  # masked entries: exp(-inf) = 0
    total = p.sum(-1, keepdim=True)
    live = total != 0  # a NaN total (a NaN or +inf score) gives NaN output and lse, not a row without keys
    total = torch.where(live, total, torch.ones_like(total))
    lse = torch.where(live, shift + torch.log(total), torch.full_like(total, float("-inf"))).squeeze(-1)
    pv = torch.matmul(p.view(b, hk, hq // hk * n, m), v.transpose(1, 2))  # (B, Hk, G * n, Dv)
    out = pv.view(b, hq, n, -1) / total
    return out.transpose(1, 2), lse


def _chunked(q: Tensor, k: Tensor, v: Tensor, scale: float, keys: KeyRange,
             allowed: ChunkMask, modify: Optional[ScoreMod] = None,
             reads: Tuple[Tuple[str, Optional[Tensor]], ...] = ()) -> Tuple[Tensor, Tensor]:
    """Attention of q over (k, v) chunk by chunk (see :func:`_chunks`); inputs in any float dtype. ``reads``: the
    ``(argument name, tensor)`` pairs besides q, k, v that ``allowed`` and ``modify`` read (ALiBi's slopes, a block
    mask), which a checkpointed chunk reads again in the backward (:func:`_check_unchanged`)."""
    ct = accumulator_dtype(q.dtype)
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
    b, n, hq, d = q.shape
    if b == 0 or n == 0:
        return q.new_zeros(q.shape), q.new_zeros((b, hq, n), dtype=ct)
    track = torch.is_grad_enabled() and (qc.requires_grad or kc.requires_grad or vc.requires_grad)
    track = track and _saved_tensors_hooks_enabled()  # (torch.func.grad: no checkpoint, the scores are kept)
    read = [(name, t) for name, t in reads if t is not None and not t.is_inference()] if track else []  # (no
    # version counter on an inference tensor)
    versions = [t._version for _, t in read]
    batch_outs: List[Tensor] = []
    batch_lses: List[Tensor] = []
    row_outs: List[Tensor] = []
    row_lses: List[Tensor] = []
    current = None
    for bs, a, e, lo, hi in _chunks(b, n, k.shape[1], hq, keys):
        if current is not None and bs != current:
            batch_outs.append(torch.cat(row_outs, 1))
            batch_lses.append(torch.cat(row_lses, 2))
            row_outs, row_lses = [], []
        current = bs

        def run(qs, ks, vs, bs=bs, a=a, e=e, lo=lo, hi=hi):
            _check_unchanged(read, versions)
            mod = None if modify is None else (lambda s: modify(s, bs, a, e, lo, hi))
            return _attend(qs, ks, vs, allowed(bs, a, e, lo, hi), scale, mod)

        args = (qc[bs, a:e], kc[bs, lo:hi], vc[bs, lo:hi])
        o, lse = checkpoint(run, *args, use_reentrant=False) if track else run(*args)
        row_outs.append(o)
        row_lses.append(lse)
    batch_outs.append(torch.cat(row_outs, 1))
    batch_lses.append(torch.cat(row_lses, 2))
    out = torch.cat(batch_outs, 0)
    lse = torch.cat(batch_lses, 0)
    return out.to(q.dtype), lse


def _check_unchanged(reads: List[Tuple[str, Tensor]], versions: List[int]) -> None:
    """``RuntimeError`` naming the argument when a tensor a checkpointed chunk reads besides q, k and v was modified
    in place since the forward: the backward recomputes the chunk from it, so its gradients would silently belong
    to the new values (PyTorch's own operations raise for a saved tensor modified so; the Triton backend saves
    these tensors and raises too)."""
    for (name, t), version in zip(reads, versions):
        if t._version != version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: {name} is at version {t._version}; expected version {version} "
                               f"instead (the PyTorch backend recomputes its attention from {name} in the backward: "
                               f"modify a copy, or call backward first)")


def _saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks, which the chunks' checkpoints install, may be used here. ``torch.func``'s
    ``grad``, ``vjp``, ``jacrev`` and ``hessian`` disable them (PyTorch's error then says "don't yet support saved
    tensor hooks", naming nothing the caller wrote): there the chunks run without checkpoints, the same values and
    gradients with each chunk's scores kept for the backward."""
    if export_flag():  # (a strict torch.export, whose trace cannot call the query below)
        return False
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if enabled is None else bool(enabled())


# ---------------------------------------------------------------------------------------------------------- flash


def _band_keys(n: int, m: int, left: Optional[int], right: Optional[int]) -> KeyRange:
    def keys(a: int, b: int) -> Tuple[int, int]:
        lo = 0 if left is None else max(0, a + m - n - left)
        hi = m if right is None else min(m, b - 1 + m - n + right + 1)
        return lo, hi

    return keys


def _band_mask(n: int, m: int, left: Optional[int], right: Optional[int], a: int, b: int, lo: int, hi: int,
               device) -> Optional[Tensor]:
    """Bool ``(b - a, hi - lo)``: which keys ``[lo, hi)`` rows ``[a, b)`` may see, or None if all of them."""
    if left is None and right is None:
        return None
    pos = torch.arange(a, b, device=device)[:, None] + (m - n)
    j = torch.arange(lo, hi, device=device)[None, :]
    ok = torch.ones(b - a, hi - lo, dtype=torch.bool, device=device)
    if left is not None:
        ok &= j >= pos - left
    if right is not None:
        ok &= j <= pos + right
    return ok


def _score_mod(n: int, m: int, softcap: float, alibi: Optional[Tensor], device,
               alibi_offset: int = 0) -> Optional[ScoreMod]:
    """Soft-capping and ALiBi (``alibi`` ``(B, Hq)`` slopes, distances ``|i + M - N + alibi_offset - j|``) of a
    chunk's scores (:func:`longattn.call.modify_scores`), or None without them."""
    if not softcap and alibi is None:
        return None

    def modify(s: Tensor, bs: slice, a: int, b: int, lo: int, hi: int) -> Tensor:
        distance = None
        if alibi is not None:
            distance = (torch.arange(a, b, device=device)[:, None] + (m - n + alibi_offset)
                        - torch.arange(lo, hi, device=device)[None, :]).abs()
        return modify_scores(s, softcap, None if alibi is None else alibi[bs][:, :, None, None], distance)

    return modify


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: Tuple[int, int],
                    scale: float, softcap: float = 0.0, alibi: Optional[Tensor] = None,
                    alibi_offset: int = 0) -> Tuple[Tensor, Tensor]:
    """Dense, causal or sliding-window attention (see :func:`longattn.flash_attention`), soft-capped and with ALiBi
    slopes ``(B, Hq)`` when given (``alibi_offset``: see :class:`longattn.call.AttentionCall`): ``(out, lse)``."""
    n, m = q.shape[1], k.shape[1]
    left, right = _band_sides(causal, window)
    return _chunked(q, k, v, scale, _band_keys(n, m, left, right),
                    lambda bs, a, b, lo, hi: _band_mask(n, m, left, right, a, b, lo, hi, q.device),
                    _score_mod(n, m, softcap, alibi, q.device, alibi_offset), reads=(("alibi_slopes", alibi),))


# --------------------------------------------------------------------------------------------------- block-sparse


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, *, block_mask: Tensor, block_size: Tuple[int, int],
                           causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """Attention restricted to the allowed block pairs of ``block_mask`` (see
    :func:`longattn.block_sparse_attention`), optionally causal: ``(out, lse)``. A block longer than the sequence
    is the sequence (its one block, the same mask): no temporary grows with the block size."""
    n, m = q.shape[1], k.shape[1]
    # (comparisons, not min: torch.export makes min of a dynamic length symbolic)
    bq, bk = (size if size <= length else max(length, 1) for size, length in zip(block_size, (n, m)))
    mask = block_mask.to(q.device)
    left, right = _band_sides(causal)

    def allowed(bs: slice, a: int, b: int, lo: int, hi: int) -> Tensor:
        blocks = mask[bs] if mask.shape[0] > 1 else mask
        # each row's and column's block, gathered (no slice of a repeated mask: a dynamic length under
        # torch.export would make its contiguity, and so the program, depend on the length)
        rows = blocks.index_select(2, torch.arange(a, b, device=mask.device) // bq)
        cols = rows.index_select(3, torch.arange(lo, hi, device=mask.device) // bk)
        band = _band_mask(n, m, left, right, a, b, lo, hi, q.device)
        return cols if band is None else cols & band

    return _chunked(q, k, v, scale, _band_keys(n, m, left, right), allowed, reads=(("block_mask", mask),))


# -------------------------------------------------------------------------------------------------------- dilated


def _kv_heads(q_heads: slice, hq: int, group: int):
    """Key/value heads for the query heads ``q_heads``: a slice when the query heads form runs of equal length over
    an arithmetic progression of key/value heads (the attention then stays grouped), else an index tensor (one
    key/value head per query head)."""
    kv = [h // group for h in range(hq)[q_heads]]
    run = kv.count(kv[0])
    uniq = kv[::run]
    steps = {b - a for a, b in zip(uniq, uniq[1:])}
    if kv == [u for u in uniq for _ in range(run)] and (len(uniq) == 1 or (len(steps) == 1 and min(steps) >= 1)):
        return slice(uniq[0], uniq[-1] + 1, steps.pop() if steps else 1)
    return torch.tensor(kv)


def _segment_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """Attention inside each segment: ``(B, S, L, H, D)`` -> out ``(B, S, L, H, D)``, lse ``(B, S, H, L)``."""
    b, s, L = q.shape[:3]
    flat = [x.reshape(b * s, L, *x.shape[3:]) for x in (q, k, v)]
    out, lse = flash_attention(*flat, causal=causal, window=(-1, -1), scale=scale)
    return out.reshape(q.shape), lse.reshape(b, s, q.shape[3], L)


def _dilated_branch(q: Tensor, k: Tensor, v: Tensor, w: int, r: int, offsets: Dict[int, slice], causal: bool,
                    scale: float) -> Tuple[Tensor, Tensor]:
    """One branch: out ``(B, N, Hq, D)`` (0 where not selected) and lse ``(B, Hq, N)`` (``-inf`` there).

    ``offsets`` maps an offset ``o`` to the slice of query heads that use it. The full segments, and then the
    shorter last one, are viewed as ``(B, S, w, H, D)``; rows ``o, o + r, ...`` of each are attended and written
    back through the same strided views.
    """
    b, n, hq, d = q.shape
    group = hq // k.shape[2]
    out = q.new_zeros((b, n, hq, d))
    lse = q.new_full((b, hq, n), float("-inf"))
    full = (n // w) * w
    for o, q_heads in offsets.items():
        kv_heads = _kv_heads(q_heads, hq, group)
        if isinstance(kv_heads, Tensor):
            kv_heads = kv_heads.to(q.device)
        for start, stop, seg in ((0, full, w), (full, n, n - full)):
            if stop <= start or o >= seg:
                continue
            count = (stop - start) // seg

            def rows(x: Tensor) -> Tensor:  # (B, S, L, H, D): rows o, o + r, ... of each segment
                return x[:, start:stop].unflatten(1, (count, seg))[:, :, o::r]

            o_s, l_s = _segment_attention(rows(q)[:, :, :, q_heads], rows(k)[:, :, :, kv_heads],
                                          rows(v)[:, :, :, kv_heads], causal, scale)
            rows(out)[:, :, :, q_heads] = o_s
            lse[:, q_heads, start:stop].unflatten(2, (count, seg))[..., o::r] = l_s.transpose(1, 2)
    return out, lse


def _branch_offsets(branch: Branch) -> Dict[int, slice]:
    """Offset -> the query heads of ``branch`` that use it (every ``dilation``-th head when the offset is per head).

    O(heads), whatever the rate: the first ``min(rate, heads)`` heads each start the run of their offset
    ``h % rate`` (a rate past the heads gives every head its own offset)."""
    start, stop, r = branch.head_start, branch.head_start + branch.n_heads, branch.dilation
    if branch.offset is not None:
        return {branch.offset: slice(start, stop)}
    return {h % r: slice(h, stop, r) for h in range(start, min(stop, start + r))}


def dilated_attention(q: Tensor, k: Tensor, v: Tensor, *, branches: Sequence[Branch], causal: bool,
                      scale: float) -> Tuple[Tensor, Tensor]:
    """LongNet dilated attention (see :func:`longattn.dilated_attention`) over ``branches``
    (:func:`longattn.call.dilated_branches`): ``(out, lse)``.

    Each branch runs on strided views of its segments; the branches merge by the softmax of their lse
    (:func:`longattn.call.merge_partial`).
    """
    b, n, hq, d = q.shape
    ct = accumulator_dtype(q.dtype)
    out = q.new_zeros((b, n, hq, d), dtype=ct)
    lse = q.new_full((b, hq, n), float("-inf"), dtype=ct)
    if b == 0 or n == 0:
        return out.to(q.dtype), lse
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)  # half inputs: branch outputs stay float32 until the merge
    for branch in branches:
        out_i, lse_i = _dilated_branch(qc, kc, vc, branch.segment, branch.dilation, _branch_offsets(branch),
                                       causal, scale)
        out, lse_t = merge_partial(out, lse.transpose(1, 2), out_i, lse_i.transpose(1, 2))
        lse = lse_t.transpose(1, 2)
    return out.to(q.dtype), lse


def _eager_under_compile(fn: Callable) -> Callable:
    """``fn``, run eagerly where ``torch.compile`` traces a call of it (a graph break): traced, the chunk loops'
    slices and masks become nested symbolic sizes once a dimension turns dynamic (a second compiled call of another
    kind or shape is enough), which Inductor spent over ten minutes simplifying. Eager calls never import
    ``torch._dynamo`` for it (``torch._disable_dynamo`` imports it on its first call, which only a trace makes).
    ``torch.export`` traces ``fn`` (a strict export allows no graph break; its program meets no Inductor): it reads
    the flag the export sets (:func:`longattn._tracing.export_flag`)."""
    disable = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
    eager = disable(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling() and not export_flag():
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


@_eager_under_compile
def attention(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
    """The call (:class:`longattn.call.AttentionCall`) on PyTorch operations, differentiable: ``(out, lse)``. Under
    ``torch.compile``, run eagerly (:func:`_eager_under_compile`)."""
    if call.cache is not None:
        raise NotImplementedError("the PyTorch backend has no KV-cache path in attention calls")
    if call.descale is not None:
        return _fp8_attention(q, k, v, call)
    if call.out_dtype is not None and call.out_dtype != q.dtype:  # the same arithmetic, rounded once to out_dtype
        ct = accumulator_dtype(q.dtype)
        out, lse = attention(q.to(ct), k.to(ct), v.to(ct), replace(call, out_dtype=None))
        return out.to(call.out_dtype), lse
    if call.seqlens is not None:
        return _packed_attention(q, k, v, call)
    if call.branches:
        return dilated_attention(q, k, v, branches=call.branches, causal=call.causal, scale=call.scale)
    if call.blocks is not None:
        return block_sparse_attention(q, k, v, block_mask=call.blocks.mask, block_size=call.blocks.block_size,
                                      causal=call.causal, scale=call.scale)
    return flash_attention(q, k, v, causal=call.causal, window=call.window, scale=call.scale, softcap=call.softcap,
                           alibi=call.alibi, alibi_offset=call.alibi_offset)


def _fp8_attention(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
    """FP8 inputs (``call.descale``): the call in float32 on the dequantised values, the output in its dtype."""
    cu = call.seqlens.cu_q if call.seqlens is not None else None
    cu_k = call.seqlens.cu_k if call.seqlens is not None else None
    scales = call.descale.scales
    q, k, v = dequantize(q, scales[0], cu), dequantize(k, scales[1], cu_k), dequantize(v, scales[2], cu_k)
    out, lse = attention(q, k, v, replace(call, descale=None, out_dtype=None))
    return out.to(call.out_dtype), lse


def _packed_attention(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
    """A packed batch (``call.seqlens``, tensors of one batch row): each sequence as its own call, concatenated.
    Reads the boundaries on the host (copied once per tensor, :func:`longattn._validation.host_values`); a dilated
    segment longer than a sequence is that sequence."""
    cu_q, cu_k = host_values(call.seqlens.cu_q), host_values(call.seqlens.cu_k)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        if q1 == q0:
            continue
        qs, ks, vs = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1]
        if k1 == k0:  # no keys: zeros and -inf that keep q, k and v in the graph (zero gradients, as on the GPU)
            out, lse = empty_attention(qs, ks, vs)
            outs.append(out)
            lses.append(lse)
            continue
        branches = tuple(replace(br, segment=min(br.segment, q1 - q0)) for br in call.branches)
        alibi = None if call.alibi is None else call.alibi[b:b + 1]  # a row of slopes per sequence
        out, lse = attention(qs, ks, vs, replace(call, seqlens=None, branches=branches, alibi=alibi))
        outs.append(out)
        lses.append(lse)
    if not outs:  # no queries at all
        return empty_attention(q, k[:, :0], v[:, :0])
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


# ---------------------------------------------------------------------------------- explicit forward and backward


def forward(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
    """:func:`attention` without autograd: ``(out, lse)``."""
    with torch.no_grad():
        return attention(q, k, v, call)


@_eager_under_compile
def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall,
             dlse: Optional[Tensor] = None, grad_dtype: Optional[torch.dtype] = None,
             delta: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of a flash call (band only; packed or not) from the GIVEN output ``o`` and log-sum-exp ``lse``, no
    autograd.

    With ``P = exp(s - lse)`` (0 where masked or where ``lse`` is ``-inf``), ``s`` the call's scores
    ``scale * q k^T`` after its soft-capping and ALiBi, and ``delta = rowsum(do * o) - dlse`` (``(B, Hq, N)``,
    computed unless given): ``dv = P^T do``, ``dS = P * (do v^T - delta)`` (times ``1 - tanh**2`` of the
    soft-cap), ``dq = scale * dS k``, ``dk = scale * dS^T q``. When ``o``/``lse`` are the final results merged over
    several key blocks, this is the share of the gradients that belongs to (k, v).
    Returns ``(dq, dk, dv)`` shaped like ``(q, k, v)``, typed like them or as ``grad_dtype`` when given.
    """
    if call.kind != "flash":
        raise NotImplementedError("the PyTorch backend's explicit backward takes flash calls (a band) only")
    if call.seqlens is not None:
        return _packed_backward(do, q, k, v, o, lse, call, dlse, grad_dtype, delta)
    causal, window, scale = call.causal, call.window, call.scale
    ct = accumulator_dtype(q.dtype)
    b, n, hq, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    with torch.no_grad():
        qc, kc, vc, doc = (x.to(ct) for x in (q, k, v, do))
        if delta is None:
            delta = (doc * o.to(ct)).sum(-1).transpose(1, 2)  # (B, Hq, N)
            if dlse is not None:
                delta = delta - dlse.to(ct)
        delta = delta.to(ct)
        lse_c = lse.to(ct)
        lse_c = torch.where(torch.isneginf(lse_c), torch.full_like(lse_c, float("inf")), lse_c)  # P = 0 there
        dq = torch.zeros_like(qc)
        dk = torch.zeros_like(kc)
        dv = torch.zeros_like(vc)
        left, right = _band_sides(causal, window)
        modify = _score_mod(n, m, call.softcap, call.alibi, q.device, call.alibi_offset)
        for bs, a, e, lo, hi in _chunks(b, n, m, hq, _band_keys(n, m, left, right)):
            q_c, do_c = qc[bs, a:e], doc[bs, a:e]
            k_c, v_c = kc[bs, lo:hi], vc[bs, lo:hi]
            s = _scores(q_c, k_c, scale)
            tanh_s = torch.tanh(s / call.softcap) if call.softcap else None  # for the soft-cap's derivative
            p = (s if modify is None else modify(s, bs, a, e, lo, hi)).sub_(lse_c[bs, :, a:e, None]).exp_()
            band = _band_mask(n, m, left, right, a, e, lo, hi, q.device)
            if band is not None:
                p.masked_fill_(~band, 0.0)  # never exp(masked score) * 0: that can be inf * 0
            dp = _scores(do_c, v_c, 1.0)
            ds = p * dp.sub_(delta[bs, :, a:e, None])  # (B, Hq, r, mk)
            if tanh_s is not None:
                ds *= 1 - tanh_s * tanh_s
            rows = (hq // hk) * (e - a)
            p, ds = p.view(p.shape[0], hk, rows, hi - lo), ds.view(ds.shape[0], hk, rows, hi - lo)
            dv[bs, lo:hi] += torch.matmul(p.transpose(-1, -2), _heads_major(do_c, hk)).transpose(1, 2)
            dq[bs, a:e] = _seq_major(torch.matmul(ds, k_c.transpose(1, 2)), e - a) * scale
            dk[bs, lo:hi] += torch.matmul(ds.transpose(-1, -2), _heads_major(q_c, hk)).transpose(1, 2) * scale
    if grad_dtype is not None:
        return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _packed_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall,
                     dlse: Optional[Tensor], grad_dtype: Optional[torch.dtype],
                     delta: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`backward` of a packed batch (``call.seqlens``, tensors of one batch row): each sequence on its own, as
    :func:`_packed_attention` computes it (a row of ALiBi slopes per sequence); rows of sequences without queries or
    keys get zero gradients. Reads the boundaries on the host, as :func:`_packed_attention` does."""
    cu_q, cu_k = host_values(call.seqlens.cu_q), host_values(call.seqlens.cu_k)
    grads = [torch.zeros(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v)]
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        if q1 == q0 or k1 == k0:
            continue
        rows, keys = slice(q0, q1), slice(k0, k1)
        alibi = None if call.alibi is None else call.alibi[b:b + 1]
        part = backward(do[:, rows], q[:, rows], k[:, keys], v[:, keys], o[:, rows], lse[:, :, rows],
                        replace(call, seqlens=None, alibi=alibi), None if dlse is None else dlse[:, :, rows],
                        grad_dtype, None if delta is None else delta[:, :, rows])
        for grad, g, at in zip(grads, part, (rows, keys, keys)):
            grad[:, at] = g
    return grads[0], grads[1], grads[2]
