"""Low-level attention building blocks with an explicit forward and backward (no autograd).

These are what the ring-attention layer (:mod:`longattn.distributed`) composes: each block of keys gives a partial
output and log-sum-exp, partial results merge by log-sum-exp, and the backward of every block is the ordinary flash
backward fed with the *final* output and log-sum-exp.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import torch
from torch import Tensor

from longattn import _validation as V
from longattn import runner
from longattn.call import flash_call

__all__ = ["attention_forward", "attention_backward"]

Window = Tuple[int, int]


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, window: Window = (-1, -1),
    scale: Optional[float] = None, backend: str = "auto", out_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor]:
    """Forward of :func:`longattn.flash_attention` without autograd.

    Shapes as there: q ``(B, N, Hq, D)``, k/v ``(B, M, Hk, D)``. Returns ``(out, lse)``: out ``(B, N, Hq, D)`` in
    q's dtype (or ``out_dtype``: ``torch.float32`` keeps a partial output that is merged afterwards unrounded, as
    ring attention does) and lse ``(B, Hq, N)`` float32 (float64 for float64 inputs; ``-inf`` for a query that sees
    no key, whose output is 0).
    """
    fn = "attention_forward"
    causal = V.check_flag(causal, "causal", fn)
    V.check_attention_inputs(q, k, v, fn=fn)
    window = V.check_window(window)
    scale = V.check_scale(scale, q.shape[-1])
    if out_dtype is not None and out_dtype not in (q.dtype, torch.float32):
        raise TypeError(f"{fn}: out_dtype must be None, q's dtype or torch.float32, got {out_dtype!r}")
    call = replace(flash_call(scale, causal, window), out_dtype=None if out_dtype == q.dtype else out_dtype)
    return runner.forward(q, k, v, call, backend=backend, fn=fn)


def attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, *, causal: bool = False,
    window: Window = (-1, -1), scale: Optional[float] = None, backend: str = "auto",
    grad_dtype: Optional[torch.dtype] = None, deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention of q over (k, v), given the final output ``o`` and log-sum-exp ``lse``.

    With ``P = exp(scale * q k^T - lse)`` (masked entries 0) and ``delta = rowsum(do * o)``:
    ``dv = P^T do``, ``dS = P * (do v^T - delta)``, ``dq = scale * dS k``, ``dk = scale * dS^T q``.
    When ``o``/``lse`` are the merged results over several key blocks, this gives each block's share of the
    gradients. ``lse`` is float32 (float32 or float64 for float64 inputs), as :func:`attention_forward` returns it;
    ``o`` has q's dtype or that of ``lse``. Returns ``(dq, dk, dv)`` shaped like ``(q, k, v)`` and typed like them,
    or as ``grad_dtype`` when given: ``torch.float32`` keeps partial gradients that are summed afterwards (ring
    attention) unrounded.
    ``deterministic``: bitwise-identical gradients from run to run, as in :func:`longattn.flash_attention` (on
    Hopper the two Triton passes instead of the fused Gluon backward; also on under PyTorch's deterministic mode).
    """
    fn = "attention_backward"
    causal = V.check_flag(causal, "causal", fn)
    V.check_attention_inputs(q, k, v, fn=fn)
    B, N, H, _ = q.shape
    for name, t, shape in (("do", do, tuple(q.shape)), ("o", o, tuple(q.shape)), ("lse", lse, (B, H, N))):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {name} must have shape {shape} (q is {tuple(q.shape)}), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} must be on q's device {q.device}, got {t.device}")
    if do.dtype != q.dtype:  # (FlashAttention's rule too: the kernels multiply dO in q's dtype)
        raise TypeError(f"{fn}: do must have q's dtype {q.dtype}, got {do.dtype}; cast the output's gradient "
                        f"(do.to(q.dtype))")
    wide = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if lse.dtype not in wide:  # (what attention_forward returns; the kernels read float32)
        raise TypeError(f"{fn}: lse must be {' or '.join(map(str, wide))} (as attention_forward returns it for "
                        f"{q.dtype} inputs), got {lse.dtype}")
    if o.dtype != q.dtype and o.dtype not in wide:  # (a merged output may stay in float32)
        raise TypeError(f"{fn}: o must have q's dtype {q.dtype} or be {' or '.join(map(str, wide))}, got {o.dtype}")
    window = V.check_window(window)
    scale = V.check_scale(scale, q.shape[-1])
    if grad_dtype is not None and grad_dtype not in (torch.float32, torch.float64, q.dtype):
        raise TypeError(f"attention_backward: grad_dtype must be None, q's dtype, float32 or float64; got {grad_dtype}")
    deterministic = V.check_deterministic(deterministic, "attention_backward")
    call = replace(flash_call(scale, causal, window), deterministic=deterministic)
    return runner.backward(do, q, k, v, o, lse, call, backend=backend, fn="attention_backward", grad_dtype=grad_dtype)
