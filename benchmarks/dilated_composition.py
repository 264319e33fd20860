"""The plain dilated-attention composition that longattn's fused path is measured against.

For each branch: view the sequence as segments, take every r-th row of each segment (the per-head offset
``h % r`` groups heads by offset), run SDPA's flash kernel on the gathered rows with its log-sum-exp, scatter the
result back; merge the branches by log-sum-exp in PyTorch. Its backward calls SDPA's flash backward on every branch
with the merged output and log-sum-exp (the exact gradient of the merge), and scatters the gradients back.
Requires N to be a multiple of every segment length (the composition pads otherwise; the benchmark avoids that).
"""
from __future__ import annotations

import torch


def _branch_slices(h: int, r: int):
    """(offset, heads) pairs: heads sharing offset ``o = head % r``."""
    return [(o, torch.arange(o, h, r)) for o in range(min(r, h))]


def _gather(x, w, o, r, heads):
    b, n, h, d = x.shape
    seg = x.view(b, n // w, w, h, d)[:, :, o::r][:, :, :, heads]  # copy: advanced indexing on heads
    return seg.reshape(b * (n // w), -1, len(heads), d).transpose(1, 2)  # (B*S, Hs, L, D)


def _scatter(dst, src, w, o, r, heads, accumulate=False):
    b, n, h, d = dst.shape
    view = dst.view(b, n // w, w, h, d)
    src = src.transpose(1, 2).reshape(b, n // w, -1, len(heads), d)
    idx = view[:, :, o::r]
    if accumulate:
        idx[:, :, :, heads] += src
    else:
        idx[:, :, :, heads] = src


def _gather_lse(lse, w, o, r, heads):
    b, h, n = lse.shape
    x = lse.view(b, h, n // w, w)[:, heads][..., o::r]  # (B, Hs, S, L)
    return x.permute(0, 2, 1, 3).reshape(b * (n // w), len(heads), -1).contiguous()


def _scatter_lse(dst, src, w, o, r, heads):
    b, h, n = dst.shape
    s = n // w
    src = src.view(b, s, len(heads), -1).permute(0, 2, 1, 3)
    view = dst.view(b, h, s, w)
    tmp = view[:, heads]
    tmp[..., o::r] = src
    view[:, heads] = tmp


def composition_forward(q, k, v, segment_lengths, dilation_rates, scale=None):
    b, n, h, d = q.shape
    out = torch.zeros_like(q, dtype=torch.float32)
    lse_tot = torch.full((b, h, n), float("-inf"), device=q.device)
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        o_b = torch.zeros_like(q)
        l_b = torch.full((b, h, n), float("-inf"), device=q.device)
        for o, heads in _branch_slices(h, r):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                _gather(q, w, o, r, heads), _gather(k, w, o, r, heads), _gather(v, w, o, r, heads), scale=scale)
            _scatter(o_b, res[0], w, o, r, heads)
            _scatter_lse(l_b, res[1], w, o, r, heads)
        new = torch.logaddexp(lse_tot, l_b)
        out = (out * torch.exp(lse_tot - new).nan_to_num(0).transpose(1, 2)[..., None]
               + o_b.float() * torch.exp(l_b - new).nan_to_num(0).transpose(1, 2)[..., None])
        lse_tot = new
    return out.to(q.dtype), lse_tot


def composition_backward(do, q, k, v, out, lse, segment_lengths, dilation_rates, scale=None):
    b, n, h, d = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        for o, heads in _branch_slices(h, r):
            qs, ks, vs = (_gather(x, w, o, r, heads) for x in (q, k, v))
            os_, dos = _gather(out, w, o, r, heads), _gather(do, w, o, r, heads)
            ls = _gather_lse(lse, w, o, r, heads)
            L = qs.shape[2]
            g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dos, qs, ks, vs, os_, ls, None, None, L, L, 0.0, False,
                torch.empty((), dtype=torch.int64, device=q.device), torch.empty((), dtype=torch.int64, device=q.device),
                scale=scale)
            for dst, src in zip((dq, dk, dv), g):
                _scatter(dst, src, w, o, r, heads, accumulate=True)
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
