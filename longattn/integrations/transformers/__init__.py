"""longattn as Hugging Face transformers attention implementations.

::

    from longattn.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="longattn")

:func:`register` adds three names to transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (without
the mask entry transformers would drop padding masks):

- ``"longattn"``: exact attention (causal, sliding window, GQA, the model's ``scaling``, attention sinks as gpt-oss
  passes them, ``s_aux``, logit soft-capping as Gemma 2 passes it, ``softcap``, Llama 4's chunked attention layers,
  ``config.attention_chunk_size``) on longattn's kernels, for training (also padding-free packed batches:
  ``cu_seq_lens_q/k`` or restarting ``position_ids``), padded batches (unpadded, never ignored) and generation with
  transformers' KV cache (the decode kernels; a chunked layer's chunks of real tokens run as a packed batch).
- ``"longattn_dilated"``: LongNet dilated attention, causal, configured by ``config.longattn_dilated``.
- ``"longattn_block_sparse"``: a block-sparse pattern from ``config.longattn_block_sparse``.

Inside ``with context_parallel(group=g, mode="ring")`` (or ``"ulysses"``, ``"hybrid"``), ``"longattn"`` trains on
a sequence split over the ranks of a process group (:mod:`.parallel`, ``docs/context_parallel.md``).

What a path cannot honour (output_attentions, attention dropout, soft-capping, sinks and chunked attention outside
``"longattn"``, chunked attention under context parallelism, a model's custom or 4-D mask, a 2-D mask without a
column for every token) raises ``ValueError`` naming the argument. Sliding windows and chunks are read from the mask
transformers builds (what ``"eager"`` and ``"sdpa"`` apply), not from the layers' ``sliding_window`` argument or the
config alone. transformers is imported only here, on the
first call of :func:`register` (``pip install 'longattn[hf]'``).
"""
from __future__ import annotations

from longattn.integrations.transformers.config import (BLOCK_SPARSE_DEFAULTS, BLOCK_SPARSE_KEY, DILATED_DEFAULTS,
                                                       DILATED_KEY)
from longattn.integrations.transformers.parallel import context_parallel

IMPLEMENTATIONS = ("longattn", "longattn_dilated", "longattn_block_sparse")

__all__ = ["register", "context_parallel", "IMPLEMENTATIONS", "DILATED_KEY", "DILATED_DEFAULTS", "BLOCK_SPARSE_KEY",
           "BLOCK_SPARSE_DEFAULTS"]


def register() -> None:
    """Register the attention implementations of :data:`IMPLEMENTATIONS` with transformers (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("longattn.integrations.transformers needs transformers>=5: pip install 'longattn[hf]'") from e
    from longattn.integrations.transformers.attention import (longattn_attention, longattn_block_sparse_attention,
                                                              longattn_dilated_attention)
    from longattn.integrations.transformers.batch import padding_mask

    functions = (longattn_attention, longattn_dilated_attention, longattn_block_sparse_attention)
    for name, fn in zip(IMPLEMENTATIONS, functions):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, padding_mask)
