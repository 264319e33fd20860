"""The Triton backend's planner: which kernel runs each pass of a call, with which tiles, and why the others do not.

One ordered candidate table per pass (:data:`FORWARD`, :data:`BACKWARD`, :data:`DECODE`); the first candidate whose
``why_not`` is None runs the pass, and every one before it is listed in the plan with its reason. The predicates
read the call, the tensors' shapes, dtypes and alignment, the device facts (:class:`~longattn.backends.device.Device`,
or made-up ones from the routing) and the routing settings (:mod:`longattn.backends.routing`), never module globals.
Plans are kept by a signature of all of these (:func:`signature`): a training loop plans once per shape.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from longattn.backends.device import Device, env, facts as device_facts
from longattn.backends.gluon import launch as gluon
from longattn.backends.gluon.tma import aligned as _aligned
from longattn.backends.plan import Choice, PassPlan, Rejected, Kept
from longattn.backends.routing import Routing, current
from longattn.backends.triton import decode_launch, fp8_layout
from longattn.backends.triton.launch import MAX_GRID_YZ, BandArgs, Packed, SeqView, fit_tiles, tiles_for, views
from longattn.call import AttentionCall

GLUON_FWD, TRITON_FWD = "gluon_fwd_sm90", "triton_fwd"
GLUON_FUSED_BWD, TRITON_TWO_PASS = "gluon_fused_bwd_sm90", "triton_two_pass"
GLUON_WIDE_BWD = "gluon_wide_bwd_sm90"
TRITON_DECODE = "triton_decode"


class Launch(NamedTuple):
    """What a forward candidate judges: one launch of the forward (one view of the call)."""

    q: Tensor
    k: Tensor
    v: Tensor
    call: AttentionCall
    view: SeqView
    band: BandArgs
    merge: bool
    packed: Packed
    device: Device
    routing: Routing


class Backward(NamedTuple):
    """What a backward candidate judges: the whole backward of a call."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    call: AttentionCall
    grad_dtype: Optional[torch.dtype]
    device: Device
    routing: Routing
    has_dlse: bool = False  # an upstream gradient of the log-sum-exp comes with dO


@dataclass(frozen=True)
class Candidate:
    """A kernel that may run a pass: ``why_not(facts)`` (None where it takes them)."""

    kernel: str
    why_not: Callable[[tuple], Optional[str]]


# --- the Gluon forward ------------------------------------------------------------------------------------------

def _visible(i: int, n: int, m: int, left: Optional[int], right: Optional[int]) -> int:
    """How many of ``m`` keys query ``i`` of ``n`` sees: keys ``p - left .. p + right`` around its diagonal key
    ``p = i + m - n`` (bottom-right aligned; None: that side unbounded)."""
    p = i + m - n
    hi = min(m - 1, p + right) if right is not None else m - 1
    lo = max(0, p - left) if left is not None else 0
    return max(hi - lo + 1, 0)


def _keys_seen(n: int, m: int, left: Optional[int] = None, right: Optional[int] = None) -> int:
    """About how many keys the middle query of ``n`` sees among ``m`` (the band as :func:`_visible`'s)."""
    return _visible(n // 2, n, m, left, right)


@functools.lru_cache(maxsize=256)  # a training loop asks for the same shapes every step
def _rows_per_key(n: int, m: int, left: Optional[int] = None, right: Optional[int] = None) -> float:
    """About how many of ``n`` queries see a key, on average over the ``m`` keys (the band as :func:`_visible`'s):
    the keys seen by 257 evenly spaced queries, averaged, times ``n / m``."""
    if n == 0 or m == 0:
        return 0.0
    rows = [round(j * (n - 1) / 256) for j in range(257)]
    return sum(_visible(i, n, m, left, right) for i in rows) / len(rows) * n / m


def _band_sides(band: Optional[BandArgs]):
    """``(left, right)`` of the kernels' band arguments (None: unbounded)."""
    if band is None:
        return None, None
    return (band.left if band.has_left else None), (band.right if band.has_right else None)


def _on_hopper(device: Device) -> bool:
    return device.cuda and device.capability[0] == 9


def _gluon_unavailable(device: Device, fused: bool) -> bool:
    """Whether the Gluon kernels (the forward's module, or with ``fused`` the fused backward's) fail to import;
    made-up device facts may say."""
    if device.gluon is not None:
        return not device.gluon
    return (gluon.fused_module() if fused else gluon.kernel_module()) is None


def _softcap_reason(call: AttentionCall, r: Routing) -> Optional[str]:
    """Why the Gluon kernels (forward and fused backward) do not take this call's soft-cap (None when they do)."""
    if call.softcap > r.gluon_max_softcap:
        return f"a soft-cap above {r.gluon_max_softcap:g} (the Gluon tanh's error grows with the cap)"
    return None


def packed_schedule(d: int, r: Routing) -> int:
    """How the Gluon forward schedules a packed batch's tiles at head dim ``d`` (16-bit inputs): the routing's
    ``packed_schedule`` where it sets one, else the tiles' own (``gluon.TILES``)."""
    return r.packed_schedule if r.packed_schedule is not None else gluon.TILES[d].packed_schedule


def why_not_gluon_forward(f: Launch) -> Optional[str]:
    """Why the Gluon forward does not take this launch (None when it does). It covers one dense view (dense, causal,
    window, grouped-query heads) on an sm_90 GPU of float16/bfloat16 inputs with a head dim in ``gluon.HEAD_DIMS``, or
    float8 ones (values in any layout: the launcher copies them) with a head dim in the routing's ``fp8_head_dims`` and
    the kernel's ``FP8_KERNEL_HEAD_DIMS`` (while its float8 path has not failed to compile), values given sequence-major
    only from ``fp8_min_keys`` keys, whose tensors meet TMA's alignment, where a query sees enough keys under the band
    at the head dims of the routing's ``min_keys``; packed batches of whole sequences too (not at those head dims),
    except float8 ones and, on the persistent schedule that sets each tile up after the last one (packed schedule 0),
    those of short sequences (``packed_min_mean_rows``). Soft-capping (up to
    ``gluon_max_softcap``) or ALiBi where ``modified_scores``, one at a time, not with float8 inputs; ALiBi not at the
    head dims of ``min_keys`` (D=64: 0.64-0.99x the Triton forward, where soft-capping is 1.6-1.9x it)."""
    q, k, v, call, view, r = f.q, f.k, f.v, f.call, f.view, f.routing
    descale = call.descale
    d = q.shape[-1]
    min_keys = r.get(r.min_keys, d)
    if call.softcap or call.alibi is not None:
        if descale is not None:
            return "soft-capping or ALiBi with float8 inputs"
        if call.softcap and call.alibi is not None:
            return "soft-capping and ALiBi together"
        if not r.modified_scores:
            return "soft-capping or ALiBi (routing modified_scores=False)"
        if (why := _softcap_reason(call, r)) is not None:
            return why
        if call.alibi is not None and min_keys is not None:
            return f"ALiBi at head dim {d}"
    if not r.gluon_on():
        return "LONGATTN_GLUON=0" if r.gluon is None else "routing gluon=False"
    if not _on_hopper(f.device):
        return "not a Hopper (sm_90) GPU"
    if descale is not None:
        if d not in r.fp8_head_dims or d not in gluon.FP8_KERNEL_HEAD_DIMS:
            return f"float8 head dim {d}"
        if d in gluon._fp8_failed:
            return gluon._fp8_failed[d]
        if k.shape[1] < r.fp8_min_keys and fp8_layout.is_seq_major(v):
            return f"fewer than {r.fp8_min_keys} keys of sequence-major float8 values"
        v = k  # the remaining checks (alignment of q and k) as for the other dtypes
    elif q.dtype not in gluon.DTYPES:
        return f"dtype {q.dtype}"
    elif d not in gluon.HEAD_DIMS:
        return f"head dim {d}"
    elif min_keys is not None:
        if f.packed is not None:
            return f"a packed batch at head dim {d}"
        if _keys_seen(q.shape[1], k.shape[1], *_band_sides(f.band)) < min_keys:
            return f"fewer than {min_keys} keys a query at head dim {d}"
    if f.merge or (call.blocks is not None and call.blocks.lists is not None):
        return "merged or block-list launch"
    if f.packed is not None:
        if descale is not None:
            return "a packed batch of float8 inputs"
        if packed_schedule(d, r) == 0 and q.shape[1] < r.packed_min_mean_rows * (f.packed[0].shape[0] - 1):
            return f"packed sequences of fewer than {r.packed_min_mean_rows} query rows on average"
        # One view of whole sequences (a segment at least as long as the longest one is a whole sequence).
        if view.n_seg != 1 or not view.covers(q.shape[2]) or view.offset or view.per_head_offset:
            return "a segmented or dilated view"
    elif view.n_seg != 1 or not view.covers(q.shape[2]) or view.seg_q != q.shape[1] or view.seg_k != k.shape[1]:
        return "a segmented or dilated view"
    if q.shape[0] > MAX_GRID_YZ or q.shape[2] > MAX_GRID_YZ:
        return "batch or heads beyond the grid's limit"
    if not all(_aligned(t) for t in (q, k, v)):
        return "inputs not aligned for TMA"
    if _gluon_unavailable(f.device, fused=False):
        return "Gluon unavailable"
    return None


# The Gluon backwards fold the log-sum-exp into the S product's first accumulator as -lse2 / (scale * log2 e); with
# lse2 up to about log2 of the keys (a tiny scale flattens the scores), that stays finite in float32 for scales far
# above this. (The two Triton passes subtract lse2 after the product: any positive scale.)
MIN_FUSED_BWD_SCALE = 1e-30


def why_not_fused_backward(f: Backward, min_rows: Optional[int] = None) -> Optional[str]:
    """Why the fused Gluon backward does not take this call (None when it does): a dense call, a packed batch or
    block lists the kernel's tiles fit (:func:`longattn.backends.gluon.bwd_fused.why_not_lists`) (no branches,
    cache or float8 scales; soft-capping up to the routing's ``gluon_max_softcap``, ALiBi, any band of at least the
    routing's ``fused_bwd_min_band`` keys)
    on an sm_90 GPU, float16/bfloat16 inputs of a head dim in ``gluon.FUSED_BWD_HEAD_DIMS``, gradients in the
    inputs' dtype or float32, TMA-aligned q, k, v and dO, dense calls whose keys are seen by enough query rows
    (``fused_bwd_min_rows``), a softmax scale of at least :data:`MIN_FUSED_BWD_SCALE`, and sizes the kernel's 32-bit
    offsets and grid cover. A deterministic call only at the routing's ``deterministic_bwd_head_dims``, dense
    (its dQ then added in a fixed order); elsewhere the kernel's float32 reduce-adds of dQ sum in the order the
    programs reach them, which varies run to run, and the two Triton passes, which sum in a fixed order, run it.
    ``min_rows``: the query rows a key needs instead of ``fused_bwd_min_rows``' (the 128 x 128 backward's)."""
    q, k, v, do, call, r = f.q, f.k, f.v, f.do, f.call, f.routing
    d = q.shape[-1]
    if call.deterministic and (d not in r.deterministic_bwd_head_dims or d not in gluon.DETERMINISTIC_BWD_HEAD_DIMS):
        return (f"deterministic=True at head dim {d} (the fused backward's dQ reduce-adds sum in no fixed order; "
                "the routing's deterministic_bwd_head_dims order them)")
    if call.deterministic and (call.seqlens is not None or call.blocks is not None):
        return "deterministic=True with a packed batch or block lists (the fused backward orders dQ for dense calls)"
    if call.deterministic and -(-k.shape[1] // (2 * gluon.FUSED_BWD_TILES[d][1])) > MAX_GRID_YZ:
        return "deterministic=True with more key blocks than the grid's third axis holds"
    if call.scale < MIN_FUSED_BWD_SCALE:
        return (f"a softmax scale below {MIN_FUSED_BWD_SCALE:g} (the Gluon backwards start S from -lse2 / (scale * "
                f"log2 e), which overflows float32 there)")
    if (why := _softcap_reason(call, r)) is not None:
        return why
    if not r.gluon_on():
        return "LONGATTN_GLUON=0" if r.gluon is None else "routing gluon=False"
    if not _on_hopper(f.device):
        return "not a Hopper (sm_90) GPU"
    if call.branches or call.cache is not None:
        return "not a dense, block-sparse or packed call"
    if call.descale is not None:
        return "float8 inputs"
    band = call.band
    if (d in r.fused_bwd_min_band_head_dims and band.left is not None and band.right is not None
            and band.left + band.right + 1 < r.fused_bwd_min_band):
        return f"a band narrower than {r.fused_bwd_min_band} keys"
    if q.dtype not in gluon.DTYPES:
        return f"dtype {q.dtype}"
    if f.grad_dtype not in gluon.FUSED_BWD_GRAD_DTYPES:
        return f"gradients in {f.grad_dtype}"
    if d not in gluon.FUSED_BWD_HEAD_DIMS:
        return f"head dim {d}"
    least = r.get(r.fused_bwd_min_rows, d, 0) if min_rows is None else min_rows
    if (call.seqlens is None and call.blocks is None and band.left is None  # (windows: fused_bwd_min_band)
            and _rows_per_key(q.shape[1], k.shape[1], band.left, band.right) < least):
        return f"fewer than {least} query rows a key at head dim {d}"
    if d in gluon._fused_failed:
        return gluon._fused_failed[d]
    if max(q.numel(), k.numel()) >= 2 ** 31 or k.shape[2] > MAX_GRID_YZ or q.shape[0] > MAX_GRID_YZ:
        return "sizes beyond the kernel's 32-bit offsets or grid"  # (key blocks, Hk, B): the last two at most 65535
    if not all(_aligned(t) for t in (q, k, v, do)):
        return "inputs not aligned for TMA"
    if _gluon_unavailable(f.device, fused=True):
        return "Gluon unavailable"
    if call.blocks is not None:
        lists = call.blocks.lists
        if lists is None or lists.q_num is None:
            return "no block lists for a backward"
        from longattn.backends.gluon import bwd_fused  # (imports on CPU too; the kernels need a GPU)
        why = bwd_fused.why_not_lists((lists.q_num, lists.q_idx), call.blocks.block_size, q.shape[0], q.shape[2],
                                      k.shape[2], call.seqlens is not None, d)
        if why is not None:
            return why
    return None


def why_not_wide_backward(f: Backward) -> Optional[str]:
    """Why the 128 x 128 backward (:mod:`longattn.backends.gluon.bwd_wide_tile`) does not take this call (None
    when it does): a call the fused backward takes (:func:`why_not_fused_backward`, its reason first; enough query rows
    a key by the routing's ``wide_bwd_min_rows``, or its ``fused_bwd_min_rows`` where lower), of a head dim in the
    routing's ``wide_bwd_head_dims``, dense (no packed batch or block lists), with no band but causal's, no
    soft-capping, ALiBi or sinks, no upstream gradient of the log-sum-exp, gradients in the inputs' dtype: the calls it
    was checked on against float64 on the GPU."""
    r = f.routing
    why = why_not_fused_backward(f, min_rows=min(r.get(r.fused_bwd_min_rows, f.q.shape[-1], 0), r.wide_bwd_min_rows))
    if why is not None:
        return why
    q, call = f.q, f.call
    d = q.shape[-1]
    if d not in f.routing.wide_bwd_head_dims or d not in gluon.WIDE_BWD_HEAD_DIMS:
        return f"head dim {d}" + ("" if d in gluon.WIDE_BWD_HEAD_DIMS else " (the kernel takes 64)")
    if call.seqlens is not None or call.blocks is not None:
        return "a packed batch or block lists (dense calls only)"
    if call.deterministic:
        return "deterministic=True (its dQ reduce-adds sum in no fixed order; the fused backward orders them)"
    band = call.band
    if band.left is not None or band.right not in (None, 0):
        return "a band other than causal's"
    if call.softcap or call.alibi is not None or call.sinks is not None:
        return "soft-capping, ALiBi or sinks"
    if f.has_dlse:
        return "an upstream gradient of the log-sum-exp"
    if f.grad_dtype not in (None, q.dtype):
        return f"gradients in {f.grad_dtype}"
    if d in gluon._wide_failed:
        return gluon._wide_failed[d]
    return None


FORWARD = (Candidate(GLUON_FWD, why_not_gluon_forward), Candidate(TRITON_FWD, lambda f: None))
BACKWARD = (Candidate(GLUON_WIDE_BWD, why_not_wide_backward), Candidate(GLUON_FUSED_BWD, why_not_fused_backward),
            Candidate(TRITON_TWO_PASS, lambda f: None))
DECODE = (Candidate(TRITON_DECODE, lambda f: None),)


def _first(table, facts) -> Tuple[str, Tuple[Rejected, ...]]:
    rejected = []
    for c in table:
        why = c.why_not(facts)
        if why is None:
            return c.kernel, tuple(rejected)
        rejected.append(Rejected(c.kernel, why))
    raise AssertionError("the last candidate of a table takes every call")  # pragma: no cover


# --- plans --------------------------------------------------------------------------------------------------------

_getenv = env


def _tensor_key(t: Optional[Tensor]):
    """What planning reads of a tensor: its shape, strides, dtype, device and 16-byte alignment (None: absent)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _blocks_key(b) -> tuple:
    lists = b.lists
    return (_tensor_key(b.mask), b.block_size,
            None if lists is None else tuple(_tensor_key(t) for t in (lists.kv_num, lists.kv_idx, lists.q_num,
                                                                      lists.q_idx)))


def _cache_key(c) -> tuple:
    return (_tensor_key(c.k_cache), _tensor_key(c.v_cache), _tensor_key(c.k_new), _tensor_key(c.v_new),
            _tensor_key(c.seqlens), c.length, _tensor_key(c.block_table), c.page_size, c.capacity,
            None if c.descales is None else tuple(_tensor_key(t) for t in c.descales), c.num_splits,
            _tensor_key(c.out), c.signature)


def call_key(c: AttentionCall) -> tuple:
    """A hashable stand-in for every field of ``c`` (one entry each, in the order of its fields): plain values as
    they are, tensors as :func:`_tensor_key`, the nested descriptions (block lists, packed lengths, a KV cache,
    float8 scales) field by field. Written out, not walked: a plan lookup builds one per call."""
    s = c.seqlens
    return (c.scale, c.causal, c.window, c.branches,
            None if c.blocks is None else _blocks_key(c.blocks),
            None if s is None else (_tensor_key(s.cu_q), _tensor_key(s.cu_k), s.max_q, s.max_k),
            None if c.cache is None else _cache_key(c.cache),
            None if c.descale is None else _tensor_key(c.descale.scales),
            c.out_dtype, c.deterministic, _tensor_key(c.sinks), c.softcap, _tensor_key(c.alibi), c.alibi_offset,
            c.need_lse)


def _state() -> tuple:
    """What the Gluon launchers learned at run time (a kernel that failed), which the predicates read."""
    failed, wide, fp8, host = gluon._fused_failed, gluon._wide_failed, gluon._fp8_failed, gluon._host_failed
    return (gluon._unavailable, tuple(sorted(failed)) if failed else (), tuple(sorted(wide)) if wide else (),
            tuple(sorted(fp8)) if fp8 else (), tuple(sorted(host)) if host else ())


def _env(r: Routing) -> tuple:
    """The environment planning and the launches read: ``TRITON_INTERPRET`` (device facts) and, where the routing
    leaves them to it, ``LONGATTN_GLUON`` (the Gluon kernels) and ``LONGATTN_TMA`` (the Triton kernels' descriptor
    loads: a replay keyed without it would keep the recorded choice)."""
    return (_getenv("TRITON_INTERPRET"), _getenv("LONGATTN_GLUON") if r.gluon is None else None,
            _getenv("LONGATTN_TMA") if r.tma is None else None)


def _device(t: Tensor, routing: Routing) -> Device:
    return routing.device or device_facts(t.device)


PLANS = Kept(1024)  # plans by signature


def kernel_views(call: AttentionCall, q: Tensor, k: Tensor) -> Tuple[List[SeqView], Packed]:
    """The kernel views of ``call``, and the cumulative lengths of a packed batch (None otherwise)."""
    if call.seqlens is None:
        return views(call, q.shape[1], k.shape[1], q.shape[2]), None
    s = call.seqlens
    return views(call, s.max_q, s.max_k, q.shape[2]), packed_of(call)


def packed_of(call: AttentionCall) -> Packed:
    """The cumulative lengths of a packed batch, ``(cu_q, cu_k)`` (None for a call of whole sequences)."""
    return None if call.seqlens is None else (call.seqlens.cu_q, call.seqlens.cu_k)


def _triton_tiles(pass_name: str, q: Tensor, call: AttentionCall, band: BandArgs, view: SeqView, device: Device):
    list_block = call.blocks.block_size if call.blocks is not None else None
    t = tiles_for(pass_name, q.shape[-1], q.device, band.banded, listed=list_block is not None, rows=view.rows,
                  facts=device)
    return t if list_block is None else fit_tiles(t, *list_block)


def pass_name(pass_: str, i: int) -> str:
    """The name of pass ``pass_`` of view ``i`` in a plan: ``"fwd"``, ``"fwd[1]"``, ..."""
    return pass_ if i == 0 else f"{pass_}[{i}]"


class ForwardLaunches(NamedTuple):
    """A planned forward: its passes (one per view) and what their launches share, kept with them (the kernel
    views and band arguments are made from the call's fields and the tensors' shapes alone)."""

    passes: Tuple[PassPlan, ...]
    views: Tuple[SeqView, ...]
    band: BandArgs


def forward(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[PassPlan, ...]:
    """The forward's plan, one pass per launch (view) of ``call`` on the kernels' inputs (unit stride along the
    head dim; float8 values as the Triton forward reads them, sequence-major, or as given where only the Gluon
    forward reads them: ``entry._planned``)."""
    return forward_launches(q, k, v, call).passes


def forward_key(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> tuple:
    """What :func:`forward_launches`' plan is made from (its key among the kept plans)."""
    r = current()
    return ("fwd", _tensor_key(q), _tensor_key(k), _tensor_key(v), call_key(call), r, _env(r), _state())


def forward_launches(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall,
                     key: Optional[tuple] = None) -> ForwardLaunches:
    """:func:`forward`'s plan with the kernel views and band arguments of its launches (``key``:
    :func:`forward_key` of these arguments where the caller has it)."""
    r = current()
    return PLANS.get(key or forward_key(q, k, v, call), lambda: _forward(q, k, v, call, _device(q, r), r))


def _forward(q, k, v, call, dev, r) -> ForwardLaunches:
    vs, packed = kernel_views(call, q, k)
    band = BandArgs.of(call.band)
    first_covers = vs[0].covers(q.shape[2])
    plans = []
    for i, view in enumerate(vs):
        merge = not (i == 0 and first_covers)
        kernel, rejected = _first(FORWARD, Launch(q, k, v, call, view, band, merge, packed, dev, r))
        if kernel == GLUON_FWD:
            d = q.shape[-1]
            masked = band.has_left or band.has_right or packed is not None
            causal = band.has_right and not band.has_left and packed is None
            if call.descale is not None:
                tiles = gluon.fp8_tiles(d, masked, view.rows if causal else 0)
            else:
                banded = (band.has_left or band.has_right) and packed is None
                tiles = gluon.band_tiles(d, _keys_seen(q.shape[1], k.shape[1], *_band_sides(band)) if banded else 0)
            schedule = packed_schedule(d, r) if packed is not None else tiles.packed_schedule
            if schedule != tiles.packed_schedule:
                tiles = replace(tiles, packed_schedule=schedule)
        else:
            tiles = _triton_tiles("fwd_fp8" if call.descale is not None else "fwd", q, call, band, view, dev)
        plans.append(PassPlan(pass_name("fwd", i), Choice(kernel, (("tiles", tiles),)), rejected))
    return ForwardLaunches(tuple(plans), tuple(vs), band)


def backward_key(q: Tensor, k: Tensor, v: Tensor, do: Tensor, call: AttentionCall,
                 grad_dtype: Optional[torch.dtype] = None, has_dlse: bool = False) -> tuple:
    """What :func:`backward`'s plan is made from (its key among the kept plans)."""
    r = current()
    return ("bwd", _tensor_key(q), _tensor_key(k), _tensor_key(v), _tensor_key(do), call_key(call), grad_dtype,
            has_dlse, r, _env(r), _state())


def backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, call: AttentionCall,
             grad_dtype: Optional[torch.dtype] = None, has_dlse: bool = False,
             key: Optional[tuple] = None) -> Tuple[PassPlan, ...]:
    """The backward's plan: ``"bwd"`` (the 128 x 128 or the fused Gluon kernel, or the two Triton passes), and for
    the two passes their ``"dkdv"`` and ``"dq"`` tiles per view. ``has_dlse``: an upstream gradient of the
    log-sum-exp comes with ``do``. ``key``: :func:`backward_key` of these arguments where the caller has it."""
    r = current()
    key = key or backward_key(q, k, v, do, call, grad_dtype, has_dlse)
    return PLANS.get(key, lambda: _backward(q, k, v, do, call, grad_dtype, has_dlse, _device(q, r), r))


def _backward(q, k, v, do, call, grad_dtype, has_dlse, dev, r) -> Tuple[PassPlan, ...]:
    kernel, rejected = _first(BACKWARD, Backward(q, k, v, do, call, grad_dtype, dev, r, has_dlse))
    plans = [PassPlan("bwd", Choice(kernel, _gluon_backward_options(kernel, q, call, r)), rejected)]
    if kernel == TRITON_TWO_PASS:
        vs, _ = kernel_views(call, q, k)
        band = BandArgs.of(call.band)
        for i, view in enumerate(vs):
            for pass_ in ("dkdv", "dq"):
                tiles = _triton_tiles(pass_, q, call, band, view, dev)
                plans.append(PassPlan(pass_name(pass_, i), Choice(f"triton_{pass_}", (("tiles", tiles),))))
    return tuple(plans)


def _gluon_backward_options(kernel: str, q: Tensor, call: AttentionCall, r: Routing) -> tuple:
    """The Gluon backward's options: ``host_descriptors`` (named only where True), its TMA descriptors made on the
    host (the routing's ``wide_bwd_host_descriptors`` and ``fused_bwd_host_descriptor_head_dims``; the fused kernel
    takes them at D = 64 and 128 on calls without a packed batch or block lists), unless that form failed to
    compile here (``gluon._host_failed``)."""
    d = q.shape[-1]
    host = (r.wide_bwd_host_descriptors and "wide" not in gluon._host_failed if kernel == GLUON_WIDE_BWD
            else kernel == GLUON_FUSED_BWD and d in r.fused_bwd_host_descriptor_head_dims and d in (64, 128)
            and call.seqlens is None and call.blocks is None and "fused" not in gluon._host_failed)
    return (("host_descriptors", True),) if host else ()


def decode(q: Tensor, call: AttentionCall) -> Tuple[PassPlan, ...]:
    """The decode pass's plan: the decode kernels with the tiles and split count of the call's launch plan
    (:data:`longattn.backends.triton.decode_launch.PLANS`, kept by the call's signature)."""
    launch_plan = decode_launch.PLANS.plan(q, call)
    block_n, warps, stages = launch_plan.tiles
    return (PassPlan("decode", Choice(TRITON_DECODE, (("block_n", block_n), ("num_warps", warps),
                                                      ("num_stages", stages), ("splits", launch_plan.splits),
                                                      ("merge", not launch_plan.direct),
                                                      ("tma", launch_plan.tma)))),)


def clear() -> None:
    """Forget every plan (the next call of each signature plans again)."""
    PLANS.clear()

