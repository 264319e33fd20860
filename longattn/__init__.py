"""longattn: exact attention for very long sequences.

Public functional API (batch-first, ``(batch, seq, heads, head_dim)``):

- :func:`flash_attention`: dense / causal / sliding-window attention with grouped-query heads.
- :func:`dilated_attention`: LongNet's dilated attention (segments x dilation rates, softmax-denominator merge).
- :func:`block_sparse_attention`: attention restricted to the allowed pairs of a block mask.
- :func:`flash_attention_varlen`, :func:`dilated_attention_varlen`: packed variable-length batches,
  ``(total, heads, head_dim)`` with ``cu_seqlens``.
- :func:`flash_attention_with_kvcache`: inference, new tokens against a contiguous or paged KV cache.
- :func:`dilated_attention_with_kvcache`: LongNet decoding against such a cache, reading only the selected keys.
- FP8 (forward only): ``flash_attention``, ``flash_attention_varlen`` and ``dilated_attention`` take
  ``float8_e4m3fn`` q, k, v with ``q_descale``/``k_descale``/``v_descale``; the KV-cache functions take FP8 caches
  with ``k_descale``/``v_descale``. :func:`quantize_fp8` makes such tensors from bfloat16/float16 ones.
- :func:`explain`: what a call of any of these functions would run (backend, and each pass's kernel and tiles,
  with the candidates not chosen and why), without running it; :func:`routing`: the routing settings (Gluon on or
  off, the measured thresholds, made-up device facts) changed for a ``with`` block.
- :func:`remember_host_reads`: whether the host reads of a CUDA ``cu_seqlens`` (one device-to-host copy each) are
  made once per tensor and version (the default) or on every call.

Every function takes ``backend="auto" | "triton" | "torch"`` (and the attention functions ``"fa4"``, where
FlashAttention-4 is installed): ``auto`` runs the fastest of PyTorch's own SDPA, FlashAttention-4 (where installed)
and our kernels that the dispatch table measured for the call on this device, among those that compute it exactly;
the Triton kernels for other calls on a CUDA GPU, and the PyTorch backend elsewhere.

Submodules, reachable as attributes after ``import longattn`` (imported on first use): ``reference`` (the
specification), ``ops`` (explicit forward/backward), ``patterns`` (block-sparse masks), ``nn`` (modules),
``models`` (LongNet), ``distributed`` (ring attention), ``flash_attn_interface`` (FlashAttention 2's
``flash_attn_func`` and the rest, with its signatures, for code ported from ``flash_attn``).
"""
import importlib

from longattn._fp8 import quantize_fp8
from longattn._fp8 import rotate_qk
from longattn._memo import remember_host_reads
from longattn.backends.routing import routing
from longattn.runner import explain
from longattn.functional import block_sparse_attention, dilated_attention, flash_attention
from longattn.kvcache import dilated_attention_with_kvcache, flash_attention_with_kvcache
from longattn.varlen import dilated_attention_varlen, flash_attention_varlen

__version__ = "0.1.0"

_SUBMODULES = ("reference", "ops", "patterns", "nn", "models", "distributed", "utils", "flash_attn_interface")

__all__ = ["flash_attention", "dilated_attention", "block_sparse_attention", "flash_attention_varlen",
           "dilated_attention_varlen", "flash_attention_with_kvcache", "dilated_attention_with_kvcache", "quantize_fp8",
           "rotate_qk",
           "remember_host_reads", "explain", "routing", "__version__",
           *_SUBMODULES]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"longattn.{name}")
    raise AttributeError(f"module 'longattn' has no attribute {name!r}")
