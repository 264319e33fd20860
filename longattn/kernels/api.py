"""The Triton backend: custom ops (``torch.library``) with autograd over the kernel launchers.

One pair of ops serves every operation. ``longattn::attention_fwd`` takes the branch description (segment lengths and
dilation rates; none for plain attention), the causal/window band, and optionally block lists; it returns the output
and the log-sum-exp. ``longattn::attention_bwd`` returns the three gradients. Being custom ops with fake (meta)
implementations, they stay single nodes under ``torch.compile`` instead of breaking the graph.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from longattn.blocklist import BlockLists, block_lists_from_mask
from longattn.kernels import launch


def _views(q: Tensor, k: Tensor, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
           head_split: bool) -> List[launch.SeqView]:
    if not segment_lengths:
        return [launch.dense_view(q.shape[1], k.shape[1], q.shape[2])]
    return launch.dilated_views(q.shape[1], q.shape[2], segment_lengths, dilation_rates, head_split)


def _lists(kv_num, kv_idx, q_num, q_idx) -> Optional[BlockLists]:
    return None if kv_num is None else BlockLists(kv_num, kv_idx, q_num, q_idx)


def _list_block(list_m: int, list_n: int) -> Optional[Tuple[int, int]]:
    return (list_m, list_n) if list_m else None


def _on_device(t: Tensor):
    """Launch on ``t``'s GPU even when another one is current (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _forward_impl(q, k, v, kv_num, kv_idx, q_num, q_idx, segment_lengths, dilation_rates, head_split, causal,
                  window_left, window_right, scale, list_m, list_n):
    B, N, H, _ = q.shape
    views = _views(q, k, segment_lengths, dilation_rates, head_split)
    lists = _lists(kv_num, kv_idx, q_num, q_idx)
    window = (window_left, window_right)
    first_covers = views[0].covers(H)
    if first_covers:
        o = torch.empty_like(q)
        lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    else:
        o = torch.zeros_like(q)
        lse = torch.full((B, H, N), float("-inf"), device=q.device, dtype=torch.float32)
    if N == 0:
        return o, lse
    if k.shape[1] == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    with _on_device(q):
        for i, view in enumerate(views):
            launch.forward(q, k, v, o, lse, view, causal, window, scale, merge=not (i == 0 and first_covers),
                           lists=lists, list_block=_list_block(list_m, list_n))
    return o, lse


@torch.library.custom_op("longattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, kv_num: Optional[Tensor], kv_idx: Optional[Tensor], q_num: Optional[Tensor],
    q_idx: Optional[Tensor], segment_lengths: List[int], dilation_rates: List[int], head_split: bool, causal: bool,
    window_left: int, window_right: int, scale: float, list_m: int, list_n: int,
) -> Tuple[Tensor, Tensor]:
    return _forward_impl(q, k, v, kv_num, kv_idx, q_num, q_idx, segment_lengths, dilation_rates, head_split, causal,
                         window_left, window_right, scale, list_m, list_n)


@attention_fwd.register_fake
def _(q, k, v, kv_num, kv_idx, q_num, q_idx, segment_lengths, dilation_rates, head_split, causal, window_left,
      window_right, scale, list_m, list_n):
    B, N, H, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, N), dtype=torch.float32)


def _backward_impl(do, q, k, v, o, lse, dlse, kv_num, kv_idx, q_num, q_idx, segment_lengths, dilation_rates,
                   head_split, causal, window_left, window_right, scale, list_m, list_n, grad_dtype=None):
    H = q.shape[2]
    views = _views(q, k, segment_lengths, dilation_rates, head_split)
    lists = _lists(kv_num, kv_idx, q_num, q_idx)
    do = do.contiguous() if do.stride(-1) != 1 else do
    lse = lse.contiguous()  # the backward kernels index lse and delta with the same strides
    first_covers = views[0].covers(H)
    alloc = torch.empty_like if first_covers else torch.zeros_like
    dq, dk, dv = (alloc(x, dtype=grad_dtype) for x in (q, k, v))  # the kernels cast on store
    if q.shape[1] == 0 or k.shape[1] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    with _on_device(q):
        delta = launch.row_delta(o, do)
        if dlse is not None:
            # d lse / d s = P, so an upstream gradient on lse folds into delta: dS = P * (dP - (delta - dlse)).
            delta = delta - dlse.float()
        window = (window_left, window_right)
        for i, view in enumerate(views):
            launch.backward(do, q, k, v, lse, delta, dq, dk, dv, view, causal, window, scale,
                            accumulate=not (i == 0 and first_covers), lists=lists,
                            list_block=_list_block(list_m, list_n))
    return dq, dk, dv


@torch.library.custom_op("longattn::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor],
    kv_num: Optional[Tensor], kv_idx: Optional[Tensor], q_num: Optional[Tensor], q_idx: Optional[Tensor],
    segment_lengths: List[int], dilation_rates: List[int], head_split: bool, causal: bool, window_left: int,
    window_right: int, scale: float, list_m: int, list_n: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(do, q, k, v, o, lse, dlse, kv_num, kv_idx, q_num, q_idx, segment_lengths, dilation_rates,
                          head_split, causal, window_left, window_right, scale, list_m, list_n)


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, kv_num, kv_idx, q_num, q_idx, segment_lengths, dilation_rates, head_split, causal,
      window_left, window_right, scale, list_m, list_n):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_ARGS = ("kv_num", "kv_idx", "q_num", "q_idx", "segment_lengths", "dilation_rates", "head_split", "causal",
             "window_left", "window_right", "scale", "list_m", "list_n")


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.config = inputs[3:]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    kv_num, kv_idx, q_num, q_idx, *rest = ctx.config
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, dlse, kv_num, kv_idx, q_num, q_idx, *rest)
    return (dq, dk, dv) + (None,) * len(_FWD_ARGS)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward without the custom-op dispatch, whose host cost (hundreds of microseconds a
    call) dominates short sequences in eager mode. Under ``torch.compile`` the custom ops are used instead."""

    @staticmethod
    def forward(ctx, q, k, v, *config):
        o, lse = _forward_impl(q, k, v, *config)
        ctx.config = config
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _backward_impl(do, q, k, v, o, lse, dlse, *ctx.config)
        return (dq, dk, dv) + (None,) * len(ctx.config)


def _attention(q, k, v, *config):
    if torch.compiler.is_compiling():
        return attention_fwd(q, k, v, *config)
    return _EagerAttention.apply(q, k, v, *config)


# --- entry points used by longattn.functional and longattn.ops -------------------------------------------------

def flash_attention(q, k, v, *, causal: bool, window: Tuple[int, int], scale: float) -> Tuple[Tensor, Tensor]:
    return _attention(q, k, v, None, None, None, None, [], [], False, causal, window[0], window[1], scale, 0, 0)


def dilated_attention(q, k, v, *, segment_lengths, dilation_rates, causal: bool, head_split: bool,
                      scale: float) -> Tuple[Tensor, Tensor]:
    return _attention(q, k, v, None, None, None, None, list(segment_lengths), list(dilation_rates), head_split,
                      causal, -1, -1, scale, 0, 0)


def block_sparse_attention(q, k, v, *, block_mask: Tensor, block_size: Tuple[int, int], causal: bool,
                           scale: float, lists: Optional[BlockLists] = None) -> Tuple[Tensor, Tensor]:
    """Block-sparse attention; ``lists`` may carry the mask's block lists, already converted (and cached) by
    :func:`longattn.blocklist.block_lists_from_mask` with the same block size, lengths and ``causal``."""
    if lists is None:
        lists = block_lists_from_mask(block_mask.to(q.device), block_size, (q.shape[1], k.shape[1]), causal)
    return _attention(q, k, v, lists.kv_num, lists.kv_idx, lists.q_num, lists.q_idx, [], [], False, causal,
                      -1, -1, scale, block_size[0], block_size[1])


def attention_forward(q, k, v, *, causal: bool, window: Tuple[int, int], scale: float) -> Tuple[Tensor, Tensor]:
    return flash_attention(q, k, v, causal=causal, window=window, scale=scale)


def attention_backward(do, q, k, v, o, lse, *, causal: bool, window: Tuple[int, int], scale: float,
                       grad_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(do, q, k, v, o, lse, None, None, None, None, None, [], [], False, causal, window[0],
                          window[1], scale, 0, 0, grad_dtype)
