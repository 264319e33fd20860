"""Attention over zero-size inputs: correctly shaped results that keep the autograd graph.

A call with no batch, no queries, no query heads or no keys has nothing to compute: every query sees no key, so the
output is 0 and the log-sum-exp ``-inf`` (lse ``(B, Hq, N)``, float64 for float64 inputs, float32 otherwise). The
result (the output and the log-sum-exp) stays connected to q, k and v, whose gradients are zeros, as with the
reference and SDPA.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from longattn._autograd import transform_reason
from longattn.call import accumulator_dtype


def is_empty(q: Tensor, k: Tensor) -> bool:
    """Whether the call has nothing to compute (a zero batch, query count, query-head count or key count)."""
    b, n, hq, _ = q.shape
    return b == 0 or n == 0 or hq == 0 or k.shape[1] == 0


class _NoKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        b, n, hq, _ = q.shape
        ctx.set_materialize_grads(False)
        ctx.likes = [(x.shape, x.dtype, x.device) for x in (q, k, v)]
        out = q.new_zeros((b, n, hq, v.shape[-1]))
        lse = q.new_full((b, hq, n), float("-inf"), dtype=accumulator_dtype(q.dtype))
        return out, lse  # (both differentiable, as the reference's: a loss on lse alone has zero gradients too)

    @staticmethod
    def backward(ctx, dout, dlse):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.likes)


def empty_attention(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of a call where no query sees any key: zeros and ``-inf``, differentiable in q, k, v. Under a
    ``torch.func`` transform or forward-mode AD (:func:`longattn._autograd.transform_reason`), where an autograd
    Function without ``setup_context`` and ``jvp`` is refused by PyTorch, plain operations give the same result:
    the output adds ``x.reshape(-1)[:0].sum()`` (0, whatever the values, with zero gradients and tangents) of
    each input."""
    if transform_reason(q, k, v) is None:
        return _NoKeys.apply(q, k, v)
    b, n, hq, _ = q.shape
    tie = sum(x.reshape(-1)[:0].sum() for x in (q, k, v))
    out = q.new_zeros((b, n, hq, v.shape[-1])) + tie
    lse = q.new_full((b, hq, n), float("-inf"), dtype=accumulator_dtype(q.dtype)) + tie
    return out, lse


def empty_result(q: Tensor, k: Tensor, v: Tensor, out_dtype) -> Tuple[Tensor, Tensor]:
    """:func:`empty_attention`, or for a call whose output has another dtype than q (FP8 inputs: forward only, no
    graph) zeros of ``out_dtype`` and a float32 ``-inf`` log-sum-exp."""
    if out_dtype is None or out_dtype == q.dtype:
        return empty_attention(q, k, v)
    b, n, h, _ = q.shape
    out = torch.zeros((b, n, h, v.shape[-1]), dtype=out_dtype, device=q.device)
    return out, torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
