"""Dilated attention composed of plain parts: the baseline longattn's fused dilated path is measured against.

For every branch ``(w, r)`` and every head offset ``o`` (heads ``o, o + r, ...`` share it): view the sequence as
segments of ``w`` positions and take rows ``o, o + r, ...`` of each (a strided view, no copy), run attention on the
slices with its log-sum-exp, scatter the result back; then merge the branches by their log-sum-exps.

The per-slice attention is the fused kernel SDPA runs by default (:func:`default_kernel`: cuDNN on Hopper, flash
elsewhere; ``torch.ops.aten._scaled_dot_product_cudnn_attention`` / ``_flash_attention``, which return the
log-sum-exp; CUDA, float16/bfloat16), with a backward that runs that kernel's backward on every slice against the
*merged* output and log-sum-exp (the exact gradient of the merge). Elsewhere it is a plain
matmul-softmax in float32 with autograd. ``N`` must be a multiple of every segment length (``min(w, N)``).
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
from torch import Tensor

Branch = Callable[[Tensor, Tensor, Tensor], Tuple[Tensor, Tensor]]


def flash_lse_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA's flash kernel with log-sum-exp can run here."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention")
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward"))


def _rows(x: Tensor, seg: int, o: int, r: int) -> Tensor:
    """Rows ``o, o + r, ...`` of every segment, heads ``o, o + r, ...``: a view ``(B, S, L, Hs, ...)``."""
    b, n = x.shape[:2]
    return x.view(b, n // seg, seg, *x.shape[2:])[:, :, o::r, o::r]


def _slice(x: Tensor, seg: int, o: int, r: int) -> Tensor:
    """``(B * S, Hs, L, D)`` view of the selected rows and heads of ``x`` ``(B, N, H, D)``."""
    s = _rows(x, seg, o, r)
    return s.reshape(-1, *s.shape[2:]).transpose(1, 2)


def _unslice(src: Tensor, like: Tensor) -> Tensor:
    """Inverse layout of :func:`_slice`: ``(B * S, Hs, L, D)`` to the shape of ``like`` ``(B, S, L, Hs, D)``."""
    return src.transpose(1, 2).reshape(like.shape)


def _lse_rows(lse: Tensor, seg: int, o: int, r: int) -> Tensor:
    """View ``(B, S, L, Hs)`` of a ``(B, H, N)`` log-sum-exp at the selected rows and heads."""
    b, h, n = lse.shape
    return lse.view(b, h, n // seg, seg)[:, o::r, :, o::r].permute(0, 2, 3, 1)


def _math_branch(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    dt = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(dt))
    return out, lse


def _flash_branch(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_branch_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    length = q.shape[2]
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, None, None, length, length, 0.0, causal, empty, empty, scale=scale)


def _cudnn_branch(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    lse = res[1]
    return res[0], lse.reshape(lse.shape[:3])  # (B, H, L), or (B, H, L, 1) in some versions


def _cudnn_branch_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    length = q.shape[2]
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: the seed and offset are unused
    # no bias, no packed sequences (None); cuDNN keeps its lse as (B, H, L, 1)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, out, lse[..., None], seed, seed, None, None, None, length, length, 0.0, causal, scale=scale)


KERNELS = {"flash": (_flash_branch, _flash_branch_backward), "cudnn": (_cudnn_branch, _cudnn_branch_backward)}


def default_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The fused kernel SDPA runs by default here: ``"cudnn"`` on Hopper and newer (where SDPA prefers it),
    ``"flash"`` on other GPUs, ``"math"`` where no fused kernel with a log-sum-exp runs."""
    if not flash_lse_available(device, dtype):
        return "math"
    if torch.cuda.get_device_capability(device)[0] >= 9 and cudnn_lse_available():
        return "cudnn"
    return "flash"


def cudnn_lse_available() -> bool:
    return (hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")
            and torch.backends.cudnn.is_available())


def _branches(n: int, h: int, segments: Sequence[int], rates: Sequence[int]) -> List[Tuple[int, int, int]]:
    out = []
    for seg, r in zip(segments, rates):
        seg = min(seg, n)
        if n % seg:
            raise ValueError(f"dilated_composition: N={n} must be a multiple of every segment length, got {seg}")
        out.extend((seg, r, o) for o in range(min(r, h)))
    return out


def _forward(q, k, v, segments, rates, causal, scale, branch: Branch, out_dtype) -> Tuple[Tensor, Tensor]:
    b, n, h, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    outs, lses = [], []
    for seg, r in zip(segments, rates):
        seg = min(seg, n)
        out_b = torch.zeros(b, n, h, d, device=q.device, dtype=acc)
        lse_b = torch.full((b, h, n), float("-inf"), device=q.device, dtype=acc)
        for o in range(min(r, h)):
            o_s, l_s = branch(_slice(q, seg, o, r), _slice(k, seg, o, r), _slice(v, seg, o, r), causal, scale)
            view = _rows(out_b, seg, o, r)
            view.copy_(_unslice(o_s.to(acc), view))
            lview = _lse_rows(lse_b, seg, o, r)
            lview.copy_(l_s.to(acc).view(b, -1, *l_s.shape[1:]).permute(0, 1, 3, 2))
        outs.append(out_b)
        lses.append(lse_b)
    lse_all = torch.stack(lses)
    lse = torch.logsumexp(lse_all, dim=0)
    weights = torch.exp(lse_all - lse).nan_to_num(0.0)  # (k, B, H, N); 0 where a branch skips the query
    out = sum(weights[i].transpose(1, 2)[..., None] * outs[i] for i in range(len(outs)))
    return out.to(out_dtype), lse


class _FusedComposition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, rates, causal, scale, kernel):
        with torch.no_grad():
            out, lse = _forward(q, k, v, segments, rates, causal, scale, KERNELS[kernel][0], q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (segments, rates, causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        segments, rates, causal, scale, kernel = ctx.cfg
        do = do.contiguous()
        b, n, h, _ = q.shape
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for seg, r, o in _branches(n, h, segments, rates):
            qs, ks, vs = (_slice(x, seg, o, r) for x in (q, k, v))
            length = qs.shape[2]
            lse_s = _lse_rows(lse, seg, o, r).permute(0, 1, 3, 2).reshape(-1, qs.shape[1], length).contiguous()
            g = KERNELS[kernel][1](_slice(do, seg, o, r), qs, ks, vs, _slice(out, seg, o, r), lse_s, causal, scale)
            for dst, src in zip(grads, g):
                view = _rows(dst, seg, o, r)
                view += _unslice(src, view)
        return (*grads, None, None, None, None, None)


def dilated_composition(q: Tensor, k: Tensor, v: Tensor, segments: Sequence[int], rates: Sequence[int], *,
                        causal: bool = False, scale: float = None, kernel: str = "math") -> Tensor:
    """Dilated attention (the semantics of :func:`longattn.dilated_attention`, ``head_split=False``, Hq == Hk) by
    slicing, per-slice attention and a log-sum-exp merge.

    Args:
        q, k, v: contiguous ``(B, N, H, D)``; ``N`` a multiple of every ``min(segment, N)``.
        kernel: ``"cudnn"`` (SDPA's cuDNN kernel, what SDPA runs by default on Hopper), ``"flash"`` (SDPA's flash
            kernel; both CUDA half precision) or ``"math"`` (matmul-softmax, any device); see
            :func:`default_kernel`.

    Returns:
        ``(B, N, H, D)`` in q's dtype, differentiable in q, k and v.
    """
    if kernel not in ("cudnn", "flash", "math"):
        raise ValueError(f"dilated_composition: kernel must be 'cudnn', 'flash' or 'math', got {kernel!r}")
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"dilated_composition: q, k, v must have one shape, got {q.shape}, {k.shape}, {v.shape}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    segments, rates = tuple(segments), tuple(rates)
    _branches(q.shape[1], q.shape[2], segments, rates)  # validates divisibility
    if kernel != "math":
        return _FusedComposition.apply(q, k, v, segments, rates, causal, scale, kernel)
    return _forward(q, k, v, segments, rates, causal, scale, _math_branch, q.dtype)[0]
