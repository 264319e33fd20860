"""The Triton backend's entry: one autograd Function over the passes, and the custom ops ``torch.compile`` sees.

:func:`attention` runs an :class:`~longattn.call.AttentionCall` with autograd; :func:`forward` and
:func:`backward` run it without (the ring code's building blocks). Each pass (``fwd``, ``dkdv``, ``dq``) is looked
planned by :mod:`longattn.backends.triton.planner` (the kernel and tiles of each launch, kept by the call's
signature) and the launcher it names runs, once per branch of the call. Eagerly the Function
calls the passes directly; under ``torch.compile`` its forward and backward call the custom ops
``longattn::attention_fwd`` / ``longattn::attention_bwd`` (fake implementations give the shapes), so the compiled
graph holds one node each. The ops take the call as named, defaulted parameters (:func:`_op_args`). KV-cache calls
run through :func:`decode`, the ``decode`` pass.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from longattn._autograd import refuse_batched_gradients, refuse_second_derivative
from longattn._validation import tensor_key
from longattn.backends import routing
from longattn.backends.gluon import launch as gluon_launch
from longattn.backends.kernel_args import ensure_allocator
from longattn.backends.plan import Kept, PassPlan
from longattn.backends.replay import Replay, aliasing, recording
from longattn.backends.triton import decode_launch, fp8_layout as layout, launch, planner
from longattn.backends.triton import sinks as sink_pass
from longattn.backends.triton.lists import BlockLists
from longattn.call import AttentionCall, BlockSparse, Branch, Descale, KVCache, SeqLens


def _unit_stride(x: Tensor) -> Tensor:
    """The kernels need unit stride along the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _views(call: AttentionCall, q: Tensor, k: Tensor) -> Tuple[List[launch.SeqView], launch.Packed]:
    """The kernel views of ``call``, and the cumulative lengths of a packed batch (None otherwise)."""
    return planner.kernel_views(call, q, k)


def _mods(call: AttentionCall) -> dict:
    """The score modifications as keyword arguments of the passes (none when the call has none; ``alibi_offset`` only
    with ALiBi). Every forward launcher takes them."""
    if not call.softcap and call.alibi is None:
        return {}
    if call.alibi is None:
        return dict(softcap=call.softcap, slopes=None)
    return dict(softcap=call.softcap, slopes=call.alibi.float().contiguous(), alibi_offset=call.alibi_offset)


def _mod_tensors(mods: dict) -> Tuple[Tensor, ...]:
    """The tensors among :func:`_mods`' arguments (the ALiBi slopes as the kernels read them: a contiguous copy of
    the call's ``(B, Hq)`` view where that is not contiguous, made per call), named in a replay's slots."""
    slopes = mods.get("slopes")
    return () if slopes is None else (slopes,)


def _lists(call: AttentionCall) -> Tuple[Optional[BlockLists], Optional[Tuple[int, int]]]:
    if call.blocks is None:
        return None, None
    return call.blocks.lists, call.blocks.block_size


def _forward_inputs(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor, Tensor]:
    """The forward kernels' inputs: unit stride along the head dim; float8 values as given (:func:`_planned`)."""
    if call.descale is not None:
        return _unit_stride(q), _unit_stride(k), v
    return tuple(_unit_stride(x) for x in (q, k, v))


def _planned(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, sequence_major=layout.seq_major,
             key: Optional[tuple] = None):
    """``(passes, views, band, v)`` of the forward's launches (:func:`planner.forward_launches`). Float8 values are
    copied sequence-major (``sequence_major``: :func:`layout.seq_major`, or for a plan that runs nothing
    :func:`layout.seq_major_like`) only where a Triton launch reads them: the Gluon forward makes
    its own copy, the keys permuted, from any layout, so one copy of V where it takes the call (two where it takes
    one launch of several, a dilated call's first branch: the Triton ones read the sequence-major copy). ``key``:
    :func:`planner.forward_key` of the arguments where the caller has it."""
    passes, views, band = planner.forward_launches(q, k, v, call, key)
    if call.descale is not None and any(p.chosen.kernel != planner.GLUON_FWD for p in passes):
        v = sequence_major(v)
        passes, views, band = planner.forward_launches(q, k, v, call)
    return passes, views, band, v


def plan(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, needs_grad: bool) -> Tuple[PassPlan, ...]:
    """The passes that would run ``call`` (its forward, and where ``needs_grad`` its backward, for a contiguous
    output gradient in the inputs' dtype; a KV-cache call's decode), without running them. A call that returns its
    log-sum-exp (``call.need_lse``) runs another backward where the loss reads that log-sum-exp too (an upstream
    gradient ``dlse``): where that backward's kernel differs, the plan names it as pass ``"bwd+dlse"``."""
    if call.cache is not None:
        return planner.decode(q, call)
    passes = ()
    if q.shape[1] and k.shape[1]:
        passes = _planned(*_forward_inputs(q, k, v, call), call, layout.seq_major_like)[0]
        if needs_grad and call.descale is None:
            q, k, v = (_unit_stride(x) for x in (q, k, v))
            do = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            bwd = planner.backward(q, k, v, do, call)
            passes += bwd
            if call.need_lse:
                with_dlse = planner.backward(q, k, v, do, call, None, True)
                if with_dlse[0].chosen != bwd[0].chosen:
                    passes += tuple(replace(p, name=p.name + "+dlse") for p in with_dlse)
    return passes


def plan_backward(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, do: Tensor,
                  grad_dtype: Optional[torch.dtype], has_dlse: bool) -> Tuple[PassPlan, ...]:
    """The passes :func:`backward` would run for these arguments (gradients in ``grad_dtype``, an upstream
    gradient of the log-sum-exp where ``has_dlse``), without running them."""
    if not (q.shape[1] and k.shape[1]):
        return ()
    q, k, v = (_unit_stride(x) for x in (q, k, v))
    return planner.backward(q, k, v, do.contiguous(), call, grad_dtype, has_dlse)


def _run_forward(p: PassPlan, i: int, q, k, v, o, lse, view, band, call, merge, lists, list_block, packed,
                 descale, mods, counter: Optional[Tensor] = None, query_blocks: Optional[Tensor] = None) -> None:
    """One launch of the forward, on the kernel the plan ``p`` names (``counter``: the Gluon forward's zeroed tile
    counter; ``query_blocks``: its table of a packed batch)."""
    if p.chosen.kernel == planner.GLUON_FWD:
        try:  # (float8 values: the Gluon forward's own layout, the keys permuted, copied from v as given)
            gluon_launch.forward(q, k, v if descale is None else layout.seq_major(v, permuted=True), o, lse, view,
                                 band, call.scale, packed=packed, descale=descale, tiles=p.chosen.option("tiles"),
                                 counter=counter, query_blocks=query_blocks, **mods)
            return
        except gluon_launch.Unavailable:  # (recorded: the new plan runs the Triton forward)
            if descale is not None:
                v = layout.seq_major(v)
            p = planner.forward(q, k, v, call)[i]
    launch.forward(q, k, v, o, lse, view, band, call.scale, merge=merge, lists=lists, list_block=list_block,
                   packed=packed, descale=descale, tiles=p.chosen.option("tiles"), **mods)


class _ForwardReplay(NamedTuple):
    """The forward launches of one signature, recorded (:mod:`longattn.backends.replay`): the output's dtype,
    whether the first launch covers every head (else the output starts zeroed and the log-sum-exp at -inf), the
    Gluon forward's tile counters (zeroed ones), the tiles of its launches on a packed batch (each reads a table of
    the batch, made anew), and the launches."""
    replay: Replay
    out_dtype: torch.dtype
    covers: bool
    counters: int
    table_tiles: tuple

    def run(self, slots: tuple, q: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
        B, N, H, _ = q.shape
        o = (torch.empty if self.covers else torch.zeros)(q.shape, dtype=self.out_dtype, device=q.device)
        lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
        if not self.covers:
            lse.fill_(float("-inf"))
        counters = [torch.zeros(1, dtype=torch.int32, device=q.device) for _ in range(self.counters)]
        tables = [gluon_launch.query_block_table(planner.packed_of(call), t) for t in self.table_tiles]
        ensure_allocator()  # (device-side descriptors' scratch, in this thread)
        self.replay.run((*slots, o, lse, *counters, *tables))
        return o, lse


# Replays of forwards by (the forward plan's key, the slots' aliasing); False where they cannot be replayed.
_FORWARD = Kept(256)


def forward(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
    """Run ``call``'s forward passes: ``(out (B, N, Hq, D) contiguous, lse (B, Hq, N) float32)``; no autograd.
    Attention sinks (``call.sinks``) are added to the result (:func:`longattn.backends.triton.sinks.add_sinks`):
    the backward then needs only the returned log-sum-exp, and the sinks' gradient is :func:`sink_grad`. A
    signature met before (no float8 values, no sinks) replays its recorded launches
    (:mod:`longattn.backends.replay`)."""
    if call.cache is not None:
        raise ValueError("a KV-cache call runs through decode(), not forward()")
    q, k, v = _forward_inputs(q, k, v, call)
    B, N, H, _ = q.shape
    planned = N and k.shape[1]
    key = replay_key = None
    slots: tuple = ()
    mods = _mods(call)
    if planned and call.descale is None and call.sinks is None and routing.current().replay:
        key = planner.forward_key(q, k, v, call)
        slots = (q, k, v, *_call_tensors(call), *_mod_tensors(mods))
        replay_key = (key, aliasing(slots))
        kept = _FORWARD.find(replay_key)
        if kept:
            with launch.on_device(q):
                return kept.run(slots, q, call)
        if kept is False:  # (its launches cannot be replayed)
            replay_key = None
    if planned:  # the plan keeps the views and band arguments of its launches
        passes, views, band, v = _planned(q, k, v, call, key=key)
        packed = planner.packed_of(call)
    else:
        views, packed = _views(call, q, k)
        band = launch.BandArgs.of(call.band)
    lists, list_block = _lists(call)
    first_covers = views[0].covers(H)
    alloc = torch.empty if first_covers else torch.zeros
    descale = call.descale.scales if call.descale is not None else None
    o = alloc(q.shape, dtype=call.out_dtype or q.dtype, device=q.device)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    if not first_covers:
        lse.fill_(float("-inf"))
    if N == 0:
        return o, lse
    counters, tables, table_tiles = [], [], []
    with launch.on_device(q), recording() as rec:
        if k.shape[1] == 0:
            o.zero_()
            lse.fill_(float("-inf"))
        else:
            for i, (view, p) in enumerate(zip(views, passes)):
                counter = table = None
                if p.chosen.kernel == planner.GLUON_FWD:
                    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
                    counters.append(counter)
                    if packed is not None:
                        table_tiles.append(p.chosen.option("tiles"))
                        table = gluon_launch.query_block_table(packed, table_tiles[-1])
                        tables.append(table)
                _run_forward(p, i, q, k, v, o, lse, view, band, call, not (i == 0 and first_covers), lists,
                             list_block, packed, descale, mods, counter, table)
        if call.sinks is not None:
            lse = sink_pass.add_sinks(o, lse, call.sinks)
    if replay_key is not None:
        replay = Replay.of(rec, (*slots, o, lse, *counters, *tables))
        _FORWARD.get(replay_key, lambda: _ForwardReplay(replay, o.dtype, first_covers, len(counters),
                                                        tuple(table_tiles)) if replay is not None else False)
    return o, lse


def sink_grad(do: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor], sinks: Tensor) -> Tensor:
    """The gradient of the attention sinks ``(Hq,)`` of a call whose :func:`forward` gave ``o`` and ``lse`` (the
    sinks included), for the output gradient ``do`` and an optional ``dlse``."""
    with launch.on_device(o):  # (autograd's dO may be anything: expanded, for a loss out.sum())
        return sink_pass.sink_grad(_unit_stride(do), _unit_stride(o), lse.contiguous(), dlse, sinks)


def _call_tensors(call: AttentionCall) -> Tuple[Tensor, ...]:
    """The tensors of ``call`` that the backward's launches may read (those it has: which ones, its key says): ALiBi's
    slopes, a packed batch's bounds, a block-sparse call's block lists."""
    s, b = call.seqlens, call.blocks
    lists = b.lists if b is not None else None
    found = (call.alibi, *((s.cu_q, s.cu_k) if s is not None else ()),
             *((lists.kv_num, lists.kv_idx, lists.q_num, lists.q_idx) if lists is not None else ()))
    return tuple(t for t in found if t is not None)


class _TwoPassReplay(NamedTuple):
    """The two Triton passes of one backward signature, recorded (:mod:`longattn.backends.replay`): the gradients'
    allocation (zeroed where the first view covers not every head), the statistics' shape, and the launches."""
    replay: Replay
    zeroed: bool
    stats_shape: tuple

    def run(self, slots: tuple, q: Tensor, k: Tensor, v: Tensor, grad_dtype: Optional[torch.dtype],
            call: AttentionCall):
        alloc = torch.zeros if self.zeroed else torch.empty
        dq, dk, dv = (alloc(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v))
        stats = torch.empty(self.stats_shape, device=q.device, dtype=torch.float32)
        ensure_allocator()  # (device-side descriptors' scratch, in this thread)
        self.replay.run((*slots, dq, dk, dv, stats))
        return dq, dk, dv


class _GluonReplay(NamedTuple):
    """A Gluon backward's launches of one signature (the fused one, or the 128 x 128 one where ``wide``), recorded:
    fresh buffers and tables for them (:func:`longattn.backends.gluon.launch.fused_workspace`, ``wide_workspace``)
    each run, then dQ rounded from its float32 sum."""
    replay: Replay
    wide: bool

    def run(self, slots: tuple, q: Tensor, k: Tensor, v: Tensor, grad_dtype: Optional[torch.dtype],
            call: AttentionCall):
        ws = _gluon_workspace(self.wide, q, k, v, call, grad_dtype)
        ensure_allocator()  # (device-side descriptors' scratch, in this thread)
        self.replay.run((*slots, *ws.tensors()))
        return ws.dq.to(grad_dtype or q.dtype), ws.dk, ws.dv


def _gluon_workspace(wide: bool, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall,
                     grad_dtype: Optional[torch.dtype]):
    """Fresh buffers (and a packed batch's tables) for the fused Gluon backward, or the 128 x 128 one where
    ``wide``."""
    return (gluon_launch.wide_workspace if wide else gluon_launch.fused_workspace)(q, k, v, call, grad_dtype)


# Replays of backwards (the two Triton passes, or a Gluon backward) by (the backward plan's key, o's and lse's,
# the slots' aliasing); False where a signature's launches cannot be replayed.
_BACKWARD = Kept(256)


def _gluon_backward(choice, do, q, k, v, o, lse, call, dlse, grad_dtype, key,
                    mods) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """The Gluon backward the plan's ``choice`` names (the fused one, or the 128 x 128 one, with its options; None
    where it declines the call: the two passes then), its launches recorded on a signature's first call (``key``:
    the plan's key, None for no replay) and replayed on the next ones. ``mods``: :func:`_mods` of the call (its
    slopes as the kernels read them)."""
    slopes = mods.get("slopes")
    wide = choice.kernel == planner.GLUON_WIDE_BWD
    host = choice.option("host_descriptors", False)

    def run(ws):
        if wide:
            return gluon_launch.wide_backward(do, q, k, v, o, lse, call, grad_dtype, workspace=ws,
                                              host_descriptors=host)
        return gluon_launch.fused_backward(do, q, k, v, o, lse, call, dlse, grad_dtype, workspace=ws, slopes=slopes,
                                           host_descriptors=host)
    if key is None or dlse is not None:
        return run(None)
    slots = (q, k, v, do, o, lse, *_call_tensors(call), *_mod_tensors(mods))
    key = (key, tensor_key(o), tensor_key(lse), aliasing(slots))
    kept = _BACKWARD.find(key)
    if kept:
        return kept.run(slots, q, k, v, grad_dtype, call)
    ws = _gluon_workspace(wide, q, k, v, call, grad_dtype) if kept is None else None
    with recording() as rec:
        grads = run(ws)
    if ws is not None and grads is not None:
        replay = Replay.of(rec, (*slots, *ws.tensors()))
        _BACKWARD.get(key, lambda: _GluonReplay(replay, wide) if replay is not None else False)
    return grads


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall,
             dlse: Optional[Tensor] = None, grad_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``call`` from its (final) output ``o`` and log-sum-exp ``lse``, and optionally an upstream
    gradient ``dlse`` on the log-sum-exp; ``(dq, dk, dv)`` contiguous, in the inputs' dtypes or ``grad_dtype``.
    ``o`` may be any view (an explicit backward's caller passes its own): the row statistics read its head dim with
    unit stride. The two Triton passes of a signature met before replay its recorded launches
    (:mod:`longattn.backends.replay`: the host's cost of a short call)."""
    q, k, v, o = (_unit_stride(x) for x in (q, k, v, o))
    do = do.contiguous()
    lse = lse.contiguous()  # row_stats reads it by (batch, head, row)
    passes: dict = {}
    key = None
    mods = _mods(call)
    if q.shape[1] and k.shape[1]:
        key = planner.backward_key(q, k, v, do, call, grad_dtype, dlse is not None)
        passes = {p.name: p for p in planner.backward(q, k, v, do, call, grad_dtype, dlse is not None, key=key)}
        if not routing.current().replay:
            key = None  # (from here on the key names replays)
        # A Gluon kernel that fails is recorded, and the new plan names the next candidate: at most four failures
        # (the 128 x 128 backward's host-descriptor form, that kernel, the fused one's host form, the fused one)
        for _ in range(5):
            kernel = passes["bwd"].chosen.kernel
            if kernel not in (planner.GLUON_WIDE_BWD, planner.GLUON_FUSED_BWD):
                break
            try:
                with launch.on_device(q):  # (GLUON_WIDE_BWD: the 128 x 128 backward of dense calls at D=64)
                    grads = _gluon_backward(passes["bwd"].chosen, do, q, k, v, o, lse, call, dlse, grad_dtype,
                                            key, mods)
                if grads is not None:
                    return grads
                break
            except gluon_launch.Unavailable:
                key = None
                passes = {p.name: p for p in planner.backward(q, k, v, do, call, grad_dtype, dlse is not None)}
    slots = ()
    if key is not None and dlse is None:
        slots = (q, k, v, do, o, lse, *_call_tensors(call), *_mod_tensors(mods))
        key = (key, tensor_key(o), tensor_key(lse), aliasing(slots))
        kept = _BACKWARD.find(key)
        if kept:
            with launch.on_device(q):
                return kept.run(slots, q, k, v, grad_dtype, call)
        if kept is False:  # (its launches cannot be replayed)
            key = None
    else:
        key = None
    H = q.shape[2]
    views, packed = _views(call, q, k)
    lists, list_block = _lists(call)
    if lists is not None and lists.q_num is None:
        raise RuntimeError("the block lists were converted for a forward only (backward=False)")
    band = launch.BandArgs.of(call.band)
    first_covers = views[0].covers(H)
    alloc = torch.empty if first_covers else torch.zeros
    dq, dk, dv = (alloc(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v))
    if q.shape[1] == 0 or k.shape[1] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    with launch.on_device(q), recording() as rec:
        # Interleaved where a program's rows may start anywhere: packed sequences, dilated views.
        stats = launch.row_stats(o, do, lse, paired=packed is not None or any(w.dilation > 1 for w in views))
        if dlse is not None:
            # d lse / d s = P, so an upstream gradient on lse folds into delta: dS = P * (dP - (delta - dlse)).
            stats.delta.sub_(dlse.float())
        for i, view in enumerate(views):
            kw = dict(accumulate=not (i == 0 and first_covers), lists=lists, list_block=list_block, packed=packed,
                      **mods)
            tiles = {name: passes[planner.pass_name(name, i)].chosen.option("tiles") if planner.pass_name(name, i) in passes
                     else None for name in ("dkdv", "dq")}  # (none planned: the table's)
            launch.backward_dkdv(do, q, k, v, lse, stats, dk, dv, view, band, call.scale, tiles=tiles["dkdv"], **kw)
            launch.backward_dq(do, q, k, v, lse, stats, dq, view, band, call.scale, tiles=tiles["dq"], **kw)
    if key is not None:
        replay = Replay.of(rec, (*slots, dq, dk, dv, stats.values))
        _BACKWARD.get(key, lambda: _TwoPassReplay(replay, not first_covers, tuple(stats.values.shape))
                      if replay is not None else False)
    return dq, dk, dv


# --- custom ops: the call as named parameters ------------------------------------------------------------------

def _op_args(call: AttentionCall) -> Tuple[tuple, dict]:
    """The positional tensors and named parameters of the ops for ``call`` (see :func:`_call_of`)."""
    lists = call.blocks.lists if call.blocks is not None else None
    tensors = (lists.kv_num, lists.kv_idx, lists.q_num, lists.q_idx) if lists is not None else (None,) * 4
    s = call.seqlens
    tensors += (s.cu_q, s.cu_k) if s is not None else (None, None)
    tensors += (call.descale.scales,) if call.descale is not None else (None,)
    tensors += (call.alibi,)
    br = call.branches
    kwargs = dict(scale=call.scale, causal=call.causal, window_left=call.window[0], window_right=call.window[1],
                  segments=[b.segment for b in br], dilations=[b.dilation for b in br],
                  head_starts=[b.head_start for b in br], head_counts=[b.n_heads for b in br],
                  offsets=[-1 if b.offset is None else b.offset for b in br],
                  block_q=call.blocks.block_size[0] if call.blocks is not None else 0,
                  block_k=call.blocks.block_size[1] if call.blocks is not None else 0,
                  max_q=s.max_q if s is not None else 0, max_k=s.max_k if s is not None else 0, softcap=call.softcap,
                  alibi_offset=call.alibi_offset)
    kwargs["deterministic"] = call.deterministic
    if call.out_dtype is not None:
        kwargs["out_dtype"] = call.out_dtype
    return tensors, kwargs


def _call_of(kv_num, kv_idx, q_num, q_idx, cu_q, cu_k, descale, alibi, scale, causal, window_left, window_right,
             segments, dilations, head_starts, head_counts, offsets, block_q, block_k, max_q, max_k, softcap=0.0,
             out_dtype=None, deterministic=False, alibi_offset=0) -> AttentionCall:
    branches = tuple(Branch(s, r, h0, nh, None if o < 0 else o)
                     for s, r, h0, nh, o in zip(segments or (), dilations or (), head_starts or (), head_counts or (),
                                                offsets or ()))
    blocks = None
    if kv_num is not None:
        blocks = BlockSparse(mask=None, block_size=(block_q, block_k),
                             lists=BlockLists(kv_num, kv_idx, q_num, q_idx))
    seqlens = SeqLens(cu_q, cu_k, max_q, max_k) if cu_q is not None else None
    return AttentionCall(scale=scale, causal=causal, window=(window_left, window_right), branches=branches,
                         blocks=blocks, seqlens=seqlens,
                         descale=Descale(descale) if descale is not None else None, out_dtype=out_dtype,
                         softcap=softcap, alibi=alibi, deterministic=deterministic, alibi_offset=alibi_offset)


@torch.library.custom_op("longattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, kv_num: Optional[Tensor] = None, kv_idx: Optional[Tensor] = None,
    q_num: Optional[Tensor] = None, q_idx: Optional[Tensor] = None, cu_q: Optional[Tensor] = None,
    cu_k: Optional[Tensor] = None, descale: Optional[Tensor] = None, alibi: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, *, scale: float,
    causal: bool = False, window_left: int = -1, window_right: int = -1, segments: Optional[List[int]] = None,
    dilations: Optional[List[int]] = None, head_starts: Optional[List[int]] = None,
    head_counts: Optional[List[int]] = None, offsets: Optional[List[int]] = None, block_q: int = 0, block_k: int = 0,
    max_q: int = 0, max_k: int = 0, softcap: float = 0.0, out_dtype: Optional[torch.dtype] = None,
    deterministic: bool = False, alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    call = _call_of(kv_num, kv_idx, q_num, q_idx, cu_q, cu_k, descale, alibi, scale, causal, window_left,
                    window_right, segments, dilations, head_starts, head_counts, offsets, block_q, block_k, max_q,
                    max_k, softcap, out_dtype, deterministic, alibi_offset)
    return forward(q, k, v, replace(call, sinks=sinks))


@attention_fwd.register_fake
def _(q, k, v, *args, out_dtype=None, **kwargs):
    B, N, H, _ = q.shape
    return q.new_empty(q.shape, dtype=out_dtype or q.dtype), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("longattn::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor] = None,
    kv_num: Optional[Tensor] = None, kv_idx: Optional[Tensor] = None, q_num: Optional[Tensor] = None,
    q_idx: Optional[Tensor] = None, cu_q: Optional[Tensor] = None, cu_k: Optional[Tensor] = None,
    alibi: Optional[Tensor] = None, *, scale: float, causal: bool = False, window_left: int = -1,
    window_right: int = -1, segments: Optional[List[int]] = None, dilations: Optional[List[int]] = None,
    head_starts: Optional[List[int]] = None, head_counts: Optional[List[int]] = None,
    offsets: Optional[List[int]] = None, block_q: int = 0, block_k: int = 0, max_q: int = 0, max_k: int = 0,
    softcap: float = 0.0, deterministic: bool = False, alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    call = _call_of(kv_num, kv_idx, q_num, q_idx, cu_q, cu_k, None, alibi, scale, causal, window_left, window_right,
                    segments, dilations, head_starts, head_counts, offsets, block_q, block_k, max_q, max_k, softcap,
                    deterministic=deterministic, alibi_offset=alibi_offset)
    return backward(do, q, k, v, o, lse, call, dlse)


@attention_bwd.register_fake
def _(do, q, k, v, *args, **kwargs):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("longattn::attention_sink_grad", mutates_args=())
def attention_sink_grad(do: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor], sinks: Tensor) -> Tensor:
    return sink_grad(do, o, lse, dlse, sinks)


@attention_sink_grad.register_fake
def _(do, o, lse, dlse, sinks):
    return sinks.new_empty(sinks.shape)


class _Attention(torch.autograd.Function):
    """Forward and backward of one call. Eagerly the passes run directly (the custom ops' dispatch costs hundreds of
    microseconds a call, which dominates short sequences); under ``torch.compile`` through the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        if sinks is not None:  # (dataclasses.replace costs microseconds: none where the call has no sinks)
            call = replace(call, sinks=sinks)
        if torch.compiler.is_compiling():
            tensors, kwargs = _op_args(call)
            o, lse = attention_fwd(q, k, v, *tensors, sinks, **kwargs)
        else:
            o, lse = forward(q, k, v, call)
        ctx.call = call
        ctx.routing = None if torch.compiler.is_compiling() else routing.current()  # the backward plans under it
        # The call's own tensors the backward reads (a packed batch's cu_seqlens, ALiBi's slopes, block lists) are
        # saved too, so that one modified in place before the backward raises PyTorch's error instead of changing
        # the gradients.
        ctx.save_for_backward(q, k, v, o, lse, sinks, *_call_tensors(call))
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        refuse_second_derivative("longattn (backend 'triton')", "; backend='torch' (the PyTorch backend) computes them")
        refuse_batched_gradients("longattn (backend 'triton')", do, dlse,
                                 alternative="; backend='torch' (the PyTorch backend) computes them")
        q, k, v, o, lse, sinks, *_ = ctx.saved_tensors  # (unpacking checks every saved tensor's version)
        if do is None:
            do = torch.zeros_like(o)
        if not ctx.call.need_lse:  # (its caller never reads it: a gradient is zeros torch.compile materialised,
            dlse = None            # which would cost a replay and the 128 x 128 backward)
        compiling = torch.compiler.is_compiling()
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):  # (else only the sinks need one: float8 inputs, or frozen q, k, v)
            if compiling:
                tensors, kwargs = _op_args(ctx.call)  # tensors[6] is the (absent) descale: FP8 is forward only
                dq, dk, dv = attention_bwd(do, q, k, v, o, lse, dlse, *tensors[:6], tensors[7], **kwargs)
            else:
                with routing.use(ctx.routing):  # autograd's device thread has none of the caller's context
                    dq, dk, dv = backward(do, q, k, v, o, lse, ctx.call, dlse)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = (attention_sink_grad if compiling else sink_grad)(do, o, lse, dlse, sinks)
        return dq, dk, dv, dsinks, None


ATTENTION_SINKS = True  # attention() and forward() add the call's sinks themselves (attention() their gradient too)


def attention(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Tensor]:
    """``call`` on the Triton kernels with autograd: ``(out (B, N, Hq, D), lse (B, Hq, N) float32)``, attention
    sinks included (differentiable in them too). A call that builds no autograd graph runs :func:`forward` directly
    (the autograd Function's own cost weighs on short calls), except under ``torch.compile``."""
    sinks = call.sinks
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (sinks is not None and sinks.requires_grad))) \
            and not torch.compiler.is_compiling():
        return forward(q, k, v, call)
    return _Attention.apply(q, k, v, sinks, call if sinks is None else replace(call, sinks=None))


DECODE_SINKS = True  # the decode pass adds attention sinks itself (at the splits' merge)


def decode(q: Tensor, call: AttentionCall, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """A KV-cache call (``call.cache``), no autograd: the decode kernels through the call's launch plan
    (:func:`longattn.backends.triton.decode_launch.decode`), attention sinks included.
    ``(out (B, Nq, Hq, D), lse (B, Hq, Nq) or None)``. Under ``torch.compile`` through the custom op
    ``longattn::decode`` (``longattn::decode_append`` where new keys and values are appended): one node."""
    if not torch.compiler.is_compiling():
        return decode_launch.decode(q, call, return_lse)
    c = call.cache
    out = c.out if c.out is not None else q.new_empty(q.shape)  # (the op writes its output into a given tensor)
    br = call.branches
    op = decode_append_op if c.k_new is not None else decode_op
    descales = c.descales if c.descales is not None else (None, None)
    lse = op(q, c.k_cache, c.v_cache, c.k_new, c.v_new, c.seqlens, c.block_table, out, *descales, call.alibi,
             call.sinks, scale=call.scale, causal=call.causal, window_left=call.window[0],
             window_right=call.window[1], segments=[b.segment for b in br], dilations=[b.dilation for b in br],
             head_starts=[b.head_start for b in br], head_counts=[b.n_heads for b in br],
             offsets=[-1 if b.offset is None else b.offset for b in br], page_size=c.page_size,
             capacity=c.capacity, num_splits=c.num_splits, softcap=call.softcap, return_lse=return_lse)
    return out, (lse if return_lse else None)


def _decode_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor], seqlens: Tensor,
    block_table: Optional[Tensor], out: Tensor, k_descale: Optional[Tensor], v_descale: Optional[Tensor],
    alibi: Optional[Tensor], sinks: Optional[Tensor], *, scale: float, causal: bool, window_left: int,
    window_right: int, segments: List[int], dilations: List[int], head_starts: List[int], head_counts: List[int],
    offsets: List[int], page_size: int, capacity: int, num_splits: int, softcap: float, return_lse: bool,
) -> Tensor:
    """The decode pass as a custom op: ``call``'s parts as arguments (as :func:`decode` gives them), the output
    written into ``out``; returns the log-sum-exp ``(B, Hq, Nq)`` float32 where ``return_lse`` (a copy: the plan's
    is a view into its workspace, and an op's output is a tensor of its own), else an empty ``(0,)`` one. The launch
    plan is kept under a signature of the arguments (shapes, strides, dtypes, alignment, the named parameters)."""
    tensors = (q, k_cache, v_cache, k, v, seqlens, block_table, out, k_descale, v_descale, alibi, sinks)
    named = (scale, causal, window_left, window_right, tuple(segments), tuple(dilations), tuple(head_starts),
             tuple(head_counts), tuple(offsets), page_size, capacity, num_splits, softcap)
    branches = tuple(Branch(s, r, h0, nh, None if o < 0 else o)
                     for s, r, h0, nh, o in zip(segments, dilations, head_starts, head_counts, offsets))
    cache = KVCache(k_cache, v_cache, k, v, seqlens, None, block_table, page_size, capacity,
                    None if k_descale is None else (k_descale, v_descale), num_splits, out,
                    ("op", *(tensor_key(t) for t in tensors), *named))
    call = AttentionCall(scale=scale, causal=causal, window=(window_left, window_right), branches=branches,
                         cache=cache, sinks=sinks, softcap=softcap, alibi=alibi)
    lse = decode_launch.decode(q, call, return_lse)[1]
    return lse.clone() if return_lse else q.new_empty((0,), dtype=torch.float32)


def _decode_op_fake(q: Tensor, *args, return_lse: bool, **kwargs) -> Tensor:
    B, n_q, hq, _ = q.shape
    return q.new_empty((B, hq, n_q) if return_lse else (0,), dtype=torch.float32)


# The decode pass's two ops, one function: each names exactly the arguments it writes ("!"). Defined on a library
# (not torch.library.custom_op, whose Python autograd wrapper made each run of a compiled graph's node 36-59 us
# against 9 us on a 2-core CPU: a decode step's host time, where no CUDA graph replays it).
_LIB = torch.library.Library("longattn", "FRAGMENT")
_DECODE_ARGS = ("Tensor? k, Tensor? v, Tensor seqlens, Tensor? block_table, Tensor(c!) out, Tensor? k_descale, "
                "Tensor? v_descale, Tensor? alibi, Tensor? sinks, *, float scale, bool causal, int window_left, "
                "int window_right, int[] segments, int[] dilations, int[] head_starts, int[] head_counts, "
                "int[] offsets, int page_size, int capacity, int num_splits, float softcap, bool return_lse) -> Tensor")
_LIB.define("decode(Tensor q, Tensor k_cache, Tensor v_cache, " + _DECODE_ARGS)
_LIB.define("decode_append(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, " + _DECODE_ARGS)
for _name in ("decode", "decode_append"):
    _LIB.impl(_name, _decode_op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"longattn::{_name}", _decode_op_fake, lib=_LIB)
decode_op = torch.ops.longattn.decode.default
decode_append_op = torch.ops.longattn.decode_append.default
