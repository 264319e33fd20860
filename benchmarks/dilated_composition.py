"""The plain dilated-attention composition that longattn's fused path is measured against.

For each branch: view the sequence as segments and take every r-th row of each segment (heads sharing the offset
``h % r`` form one strided view, so the inputs are not copied), run SDPA's flash kernel on it with its log-sum-exp,
scatter the result back; merge the branches by log-sum-exp in PyTorch. Its backward calls SDPA's flash backward on every branch
with the merged output and log-sum-exp (the exact gradient of the merge), and scatters the gradients back.
Requires N to be a multiple of every segment length (the composition pads otherwise; the benchmark avoids that).
"""
from __future__ import annotations

import torch


def _rows(x, w, o, r):
    """Rows ``o, o + r, ...`` of every segment of length ``w``, for the heads ``o, o + r, ...`` (those with
    ``h % r == o``): a strided view ``(B, S, L, Hs, D)``, no copy."""
    b, n, h, d = x.shape
    return x.view(b, n // w, w, h, d)[:, :, o::r, o::r]


def _gather(x, w, o, r):
    s = _rows(x, w, o, r)
    b, n_seg, L, hs, d = s.shape
    return s.reshape(b * n_seg, L, hs, d).transpose(1, 2)  # (B*S, Hs, L, D), still a view


def _scatter(dst, src, w, o, r, accumulate=False):
    view = _rows(dst, w, o, r)
    src = src.transpose(1, 2).reshape(view.shape)
    if accumulate:
        view += src
    else:
        view.copy_(src)


def _lse_rows(lse, w, o, r):
    """The ``(B, H, N)`` log-sum-exp at the same rows and heads, as ``(B*S, Hs, L)``."""
    b, h, n = lse.shape
    x = lse.view(b, h, n // w, w)[:, o::r, :, o::r]
    return x.permute(0, 2, 1, 3).reshape(b * (n // w), x.shape[1], -1)


def composition_forward(q, k, v, segment_lengths, dilation_rates, scale=None):
    b, n, h, d = q.shape
    outs, lses = [], []
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        o_b = torch.zeros_like(q)
        l_b = torch.full((b, h, n), float("-inf"), device=q.device)
        for o in range(min(r, h)):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                _gather(q, w, o, r), _gather(k, w, o, r), _gather(v, w, o, r), scale=scale)
            _scatter(o_b, res[0], w, o, r)
            hs = res[1].shape[1]
            l_b.view(b, h, n // w, w)[:, o::r, :, o::r] = res[1].view(b, n // w, hs, -1).permute(0, 2, 1, 3)
        outs.append(o_b)
        lses.append(l_b)
    lse = torch.logsumexp(torch.stack(lses), 0)
    out = torch.zeros_like(q, dtype=torch.float32)
    for o_b, l_b in zip(outs, lses):
        out += o_b * torch.exp(l_b - lse).nan_to_num_(0.0).transpose(1, 2)[..., None]
    return out.to(q.dtype), lse


def composition_backward(do, q, k, v, out, lse, segment_lengths, dilation_rates, scale=None):
    b, n, h, d = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        for o in range(min(r, h)):
            qs, ks, vs = (_gather(x, w, o, r) for x in (q, k, v))
            L = qs.shape[2]
            g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _gather(do, w, o, r), qs, ks, vs, _gather(out, w, o, r), _lse_rows(lse, w, o, r).contiguous(),
                None, None, L, L, 0.0, False, empty, empty, scale=scale)
            for dst, src in zip((dq, dk, dv), g):
                _scatter(dst, src, w, o, r, accumulate=True)
    return dq, dk, dv


class _Composition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segment_lengths, dilation_rates):
        out, lse = composition_forward(q, k, v, segment_lengths, dilation_rates)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (segment_lengths, dilation_rates)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        return (*composition_backward(do.contiguous(), q, k, v, out, lse, *ctx.cfg), None, None)


def dilated_composition(q, k, v, segment_lengths, dilation_rates):
    """Differentiable plain composition, ``(B, N, H, D)`` like :func:`longattn.dilated_attention`."""
    return _Composition.apply(q, k, v, tuple(segment_lengths), tuple(dilation_rates))
