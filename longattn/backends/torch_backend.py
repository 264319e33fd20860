"""The ``backend="torch"`` path: PyTorch operations on any device, differentiable by autograd.

Memory stays bounded: queries are processed in chunks (each chunk's scores are ``chunk x M``), and under autograd
each chunk is checkpointed, so the backward recomputes its scores instead of keeping them. Half-precision inputs
are computed in float32. Dilated branches run on strided views of their segments (no gathers of q, k, v).
Every function returns ``(out, lse)`` with lse ``(B, Hq, N)`` (float32, or float64 for float64 inputs).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longattn.reference import flash_mask, head_groups, masked_attention, safe_logsumexp

CHUNK = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunked(q: Tensor, k: Tensor, v: Tensor, scale: float,
             allowed: Callable[[int, int], Tensor]) -> Tuple[Tensor, Tensor]:
    """Attention of q over (k, v) in query chunks; ``allowed(start, stop)`` gives the chunk's bool mask."""
    ct = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
    outs, lses = [], []
    n = q.shape[1]
    for start in range(0, max(n, 1), CHUNK):
        stop = min(start + CHUNK, n)

        def run(qs, kk, vv, start=start, stop=stop):
            return masked_attention(qs, kk, vv, allowed(start, stop), scale)

        qs = qc[:, start:stop]
        if torch.is_grad_enabled() and (qs.requires_grad or kc.requires_grad or vc.requires_grad):
            o, lse = checkpoint(run, qs, kc, vc, use_reentrant=False)
        else:
            o, lse = run(qs, kc, vc)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, 2) if len(lses) > 1 else lses[0]
    return out.to(q.dtype), lse if ct == torch.float64 else lse.float()


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: Tuple[int, int],
                    scale: float) -> Tuple[Tensor, Tensor]:
    n, m = q.shape[1], k.shape[1]
    return _chunked(q, k, v, scale, lambda a, b: flash_mask(n, m, causal, window, device=q.device)[a:b])


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, *, block_mask: Tensor, block_size: Tuple[int, int],
                           causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    n, m = q.shape[1], k.shape[1]
    bq, bk = block_size
    mask = block_mask.to(q.device)

    def allowed(a, b):
        rows = mask.repeat_interleave(bq, dim=2)[:, :, a:b]
        return rows.repeat_interleave(bk, dim=3)[..., :m] & flash_mask(n, m, causal, device=q.device)[a:b]

    return _chunked(q, k, v, scale, allowed)


def _segments_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """Attention inside each of ``S`` segments: inputs ``(B, S, L, H, D)`` -> out ``(B, S, L, H, D)``, lse
    ``(B, S, H, L)``."""
    b, s, L, h, d = q.shape
    hk = k.shape[3]
    out, lse = _chunked(q.reshape(b * s, L, h, d), k.reshape(b * s, L, hk, d), v.reshape(b * s, L, hk, d), scale,
                        lambda a, c: flash_mask(L, L, causal, device=q.device)[a:c])
    return out.view(b, s, L, h, d), lse.view(b, s, h, L)


def dilated_attention(q: Tensor, k: Tensor, v: Tensor, *, segment_lengths: Sequence[int],
                      dilation_rates: Sequence[int], causal: bool, head_split: bool,
                      scale: float) -> Tuple[Tensor, Tensor]:
    b, n, h, d = q.shape
    hk = k.shape[2]
    group = h // hk
    ct = _compute_dtype(q.dtype)
    groups = head_groups(h, len(segment_lengths)) if head_split else None
    outs, lses = [], []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        w = min(w, n)
        out_b = q.new_zeros((b, n, h, d), dtype=ct)
        lse_b = q.new_full((b, h, n), float("-inf"), dtype=ct)
        heads = list(groups[i]) if head_split else list(range(h))
        by_offset = {}
        for hh in heads:
            by_offset.setdefault(i % r if head_split else hh % r, []).append(hh)
        full = (n // w) * w
        for o, hs in by_offset.items():
            hs_t = torch.tensor(hs, device=q.device)
            kv_heads = hs_t // group
            for start, stop in ((0, full), (full, n)):
                if stop - start <= o:
                    continue
                seg = stop - start if start == full else w
                s_count = (stop - start) // seg
                # rows o, o + r, ... of every segment of [start, stop)
                qs = q[:, start:stop].reshape(b, s_count, seg, h, d)[:, :, o::r][:, :, :, hs_t]
                ks = k[:, start:stop].reshape(b, s_count, seg, hk, d)[:, :, o::r][:, :, :, kv_heads]
                vs = v[:, start:stop].reshape(b, s_count, seg, hk, d)[:, :, o::r][:, :, :, kv_heads]
                o_s, l_s = _segments_attention(qs, ks, vs, causal, scale)  # heads expanded: one kv head per q head
                rows = torch.arange(start, stop, device=q.device).view(s_count, seg)[:, o::r].reshape(-1)
                L = o_s.shape[2]
                out_b[:, rows[:, None], hs_t[None, :]] = o_s.reshape(b, s_count * L, len(hs), d).to(ct)
                lse_b[:, hs_t[:, None], rows[None, :]] = l_s.permute(0, 2, 1, 3).reshape(b, len(hs), -1).to(ct)
        outs.append(out_b)
        lses.append(lse_b)
    lse_all = torch.stack(lses)
    lse = safe_logsumexp(lse_all, dim=0)
    weights = torch.exp(lse_all - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    out = sum(weights[i].transpose(1, 2)[..., None] * outs[i] for i in range(len(outs)))
    return out.to(q.dtype), lse if ct == torch.float64 else lse.float()


def attention_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: Tuple[int, int],
                      scale: float) -> Tuple[Tensor, Tensor]:
    """Forward without autograd: ``(out, lse)``."""
    with torch.no_grad():
        return flash_attention(q, k, v, causal=causal, window=window, scale=scale)


def attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, *, causal: bool,
                       window: Tuple[int, int], scale: float,
                       delta: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients from the given final ``o`` and ``lse`` (see :func:`longattn.ops.attention_backward`)."""
    ct = _compute_dtype(q.dtype)
    b, n, hq, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    group = hq // hk
    qc, kc, vc, doc, oc = (x.to(ct) for x in (q, k, v, do, o))
    kr, vr = kc.repeat_interleave(group, 2), vc.repeat_interleave(group, 2)
    if delta is None:
        delta = (doc * oc).sum(-1).transpose(1, 2)  # (B, H, N)
    lse_c = lse.to(ct)
    lse_c = torch.where(torch.isfinite(lse_c), lse_c, torch.full_like(lse_c, float("inf")))  # P = 0 on empty rows
    dq = torch.zeros_like(qc)
    dk = torch.zeros_like(kr)
    dv = torch.zeros_like(vr)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        allowed = flash_mask(n, m, causal, window, device=q.device)[start:stop]
        s = torch.einsum("bnhd,bmhd->bhnm", qc[:, start:stop], kr) * scale
        p = torch.exp(s - lse_c[:, :, start:stop, None]) * allowed
        dv += torch.einsum("bhnm,bnhd->bmhd", p, doc[:, start:stop])
        dp = torch.einsum("bnhd,bmhd->bhnm", doc[:, start:stop], vr)
        ds = p * (dp - delta[:, :, start:stop, None].to(ct))
        dq[:, start:stop] = torch.einsum("bhnm,bmhd->bnhd", ds, kr) * scale
        dk += torch.einsum("bhnm,bnhd->bmhd", ds, qc[:, start:stop]) * scale
    dk = dk.view(b, m, hk, group, d).sum(3)
    dv = dv.view(b, m, hk, group, d).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
