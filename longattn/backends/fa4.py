"""FlashAttention-4 (``flash-attn-4`` on PyPI, ``flash_attn.cute``) as an optional longattn backend.

Installed (``pip install 'longattn[fa4]'``) on a Hopper or Blackwell GPU, its kernels compute exactly what longattn
defines for the calls it takes: dense attention, causal and sliding windows aligned bottom-right (FlashAttention's
convention, and ours), grouped-query heads, packed batches (``cu_seqlens``), attention sinks (its
``learnable_sink``), soft-capping, the log-sum-exp (differentiable) and ``deterministic`` backwards. It takes no
ALiBi, FP8 inputs, dilated or block-sparse calls, KV caches, or float32 partial outputs (the ring's blocks); for those
:func:`unsupported_reason` says why and the dispatch runs another backend. ``backend="auto"`` runs it where the
dispatch table (:mod:`longattn.backends.auto_table`) measured it fastest; without FA4 nothing changes.

Its kernels compile on their first call per kind of call (CuTe DSL JIT: 2-10 s each measured on an H200); FA4 keeps
them in memory for the process and, as longattn sets it up, on disk: unless the user set FA4's own variables first,
longattn turns FA4's on-disk kernel cache on (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``) in a user cache
directory (``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``: ``$XDG_CACHE_HOME/longattn/fa4``, ``~/.cache/longattn/fa4`` by
default) before importing it, so a second process loads what the first compiled. Under ``torch.compile`` tracing it is
not a candidate (our kernels' custom ops run).
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Optional, Tuple

import torch
from torch import Tensor

from longattn._autograd import refuse_second_derivative_of
from longattn.backends.device import capability
from longattn.call import AttentionCall

ATTENTION_SINKS = True  # FA4 adds the sinks itself (its learnable_sink), log-sum-exp included
DTYPES = (torch.float16, torch.bfloat16)
ARCHS = (9, 10, 11)  # compute capability majors with FA4 kernels: sm90 (Hopper), sm100/sm110 (Blackwell)


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "longattn", "fa4")


@functools.lru_cache(maxsize=None)
def _module():
    """``flash_attn.cute``, or None where it does not import. FA4 reads its cache settings when imported: they are
    set here first where the user has not set them (module docstring)."""
    if "flash_attn.cute" not in sys.modules:
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", _cache_dir())
    try:
        from flash_attn import cute
    except Exception:  # not installed, or its CUDA DSL does not load here
        return None
    return cute if hasattr(cute, "flash_attn_func") else None


def installed() -> bool:
    """Whether FlashAttention-4 imports."""
    return _module() is not None


def _head_dim_reason(d: int, major: int) -> Optional[str]:
    if d in (64, 128, 256):
        return None  # (the common head dims, answered first)
    if d % 8 or not 8 <= d <= 256:
        return f"head dim {d} (FA4 takes multiples of 8 from 8 to 256)"
    if major != 9 and d > 128 and d != 256:
        return f"head dim {d} on sm{major}x (FA4 takes 8-128 or 256 there)"
    return None


def device_reason(q: Tensor) -> Optional[str]:
    """Why FA4 cannot run on ``q``'s device here (None when it can)."""
    if torch.compiler.is_compiling():  # (first: tracing would step into the import below)
        return "torch.compile tracing (FA4 runs eagerly only)"
    if not q.is_cuda:
        return "not a CUDA tensor"
    if not installed():
        return "FlashAttention-4 (flash_attn.cute) is not installed"
    major = capability(q.device)[0]
    if major not in ARCHS:
        return f"compute capability {major}.x (FA4's kernels need sm90, sm100 or sm110)"
    return None


# FA4 takes soft-capping's tanh from the hardware's approximation (``tanh.approx.f32``, fastmath), off by up to about
# 8e-6: a capped score off by ``cap * 8e-6``, which grows with the cap (4e-4 at 50, 8e-2 at 1e4). Larger caps run our
# Triton kernels, whose tanh stays within float32's rounding (as the routing's ``gluon_max_softcap`` for ours).
MAX_SOFTCAP = 64.0


def call_reason(q: Tensor, call: AttentionCall) -> Optional[str]:
    """Why FA4 does not compute ``call`` on ``q (B, N, Hq, D)`` exactly (None when it does)."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (FA4 takes float16 and bfloat16)"
    what = ("dilated branches" if call.branches else "block-sparse blocks" if call.blocks is not None
            else "a KV cache" if call.cache is not None else "FP8 inputs" if call.descale is not None
            else "ALiBi" if call.alibi is not None else None)
    if what is not None:
        return f"{what} (FA4 takes none)"
    if call.softcap > MAX_SOFTCAP:
        return f"a soft-cap above {MAX_SOFTCAP:g} (FA4's approximate tanh is off by up to cap x 8e-6)"
    if call.out_dtype is not None and call.out_dtype != q.dtype:
        return f"an output dtype {call.out_dtype} other than the inputs'"
    major = capability(q.device)[0] if q.is_cuda else 9  # (read once per device: backends.device)
    return _head_dim_reason(q.shape[-1], major)


def unsupported_reason(q: Tensor, call: AttentionCall) -> Optional[str]:
    """Why FA4 cannot compute ``call`` on ``q (B, N, Hq, D)`` exactly here (None when it can): the device's reason
    (:func:`device_reason`), else the call's (:func:`call_reason`)."""
    return device_reason(q) or call_reason(q, call)


def kind_of(call: AttentionCall) -> str:
    """The kind of a call FA4 computes, as the dispatch table (:mod:`longattn.backends.auto_table`) keys its
    measurements: ``"softcap"``, ``"packed"``, ``"sinks"``, ``"window"`` (a band with a left side, or a right side
    other than causal's), else ``"causal"`` or ``"dense"`` (with or without the log-sum-exp, any N and M); the first
    that applies, in that order."""
    band = call.band
    if call.softcap:
        return "softcap"
    if call.seqlens is not None:
        return "packed"
    if call.sinks is not None:
        return "sinks"
    if band.left is not None or band.right not in (None, 0):
        return "window"
    return "causal" if band.right == 0 else "dense"


def _window(call: AttentionCall) -> Tuple[bool, Tuple[Optional[int], Optional[int]]]:
    """FA4's ``(causal, window_size)`` of the call's band (bottom-right aligned in both; None: unbounded)."""
    band = call.band
    if band.left is None and band.right == 0:
        return True, (None, None)
    return False, (band.left, band.right)


def _sinks(call: AttentionCall) -> Optional[Tensor]:
    return None if call.sinks is None else call.sinks.float().contiguous()


def _arguments(call: AttentionCall) -> dict:
    """FA4's keyword arguments for ``call``. The log-sum-exp only where the caller reads it: asking for it costs FA4
    host time on every call (with autograd FA4 computes it anyway). Made once per call object where the call holds
    no tensor (a call is immutable; plain calls are one object per arguments, :func:`longattn.call.flash_call`),
    else on every call (the sinks' values are read then, and no packed batch's boundaries are kept alive). FA4 runs
    eagerly only (:func:`device_reason`), so no tracing sees the table."""
    if call.sinks is not None or call.seqlens is not None:
        return _make_arguments(call)
    kept = _ARGUMENTS.get(id(call))
    if kept is None or kept[0] is not call:  # (the entry holds its call: no other object takes that id meanwhile)
        kept = (call, _make_arguments(call))
        if len(_ARGUMENTS) >= _ARGUMENTS_KEPT:
            _ARGUMENTS.clear()
        _ARGUMENTS[id(call)] = kept
    return kept[1]


_ARGUMENTS: dict = {}  # id(call) -> (call, FA4's keyword arguments), calls without sinks (_arguments)
_ARGUMENTS_KEPT = 1024


def _make_arguments(call: AttentionCall) -> dict:
    causal, window = _window(call)
    return dict(softmax_scale=call.scale, causal=causal, window_size=window, learnable_sink=_sinks(call),
                softcap=call.softcap, deterministic=call.deterministic, return_lse=call.need_lse)


def attention(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
    """``call`` with autograd on FA4: ``(out (B, N, Hq, D), lse (B, Hq, N) float32)``, the sinks (if any)
    included in both; a packed call (``call.seqlens``, one batch row) runs FA4's varlen kernels. ``lse`` may be
    None where the call does not need it (``call.need_lse`` False)."""
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # (FA4 launches on the current device; the inputs are on another)
            return _attention(q, k, v, call)
    return _attention(q, k, v, call)


def _attention(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
    fa = _module()
    common = _arguments(call)
    if call.seqlens is None:
        return _no_second_derivative(*fa.flash_attn_func(q, k, v, **common))
    s = call.seqlens
    # squeeze, not q[0]: indexing's backward would zero-fill a q-sized gradient and copy the incoming one into
    # it (9% of a packed batch's forward+backward on an H200, docs/benchmarks.md)
    out, lse = fa.flash_attn_varlen_func(q.squeeze(0), k.squeeze(0), v.squeeze(0), cu_seqlens_q=s.cu_q,
                                         cu_seqlens_k=s.cu_k, max_seqlen_q=s.max_q, max_seqlen_k=s.max_k, **common)
    out, lse = _no_second_derivative(out, lse)
    return out.unsqueeze(0), (None if lse is None else lse.unsqueeze(0))


def _no_second_derivative(out: Tensor, lse: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """FA4's autograd Function returns gradients without a graph: under ``create_graph=True`` the second derivative
    would silently be zero, so its node refuses one (:func:`longattn._autograd.refuse_second_derivative_of`)."""
    refuse_second_derivative_of((out, lse), "longattn (backend 'fa4')",
                                "; backend='torch' (the PyTorch backend) computes them")
    return out, lse
