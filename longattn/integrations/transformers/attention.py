"""The attention functions registered with transformers' ``AttentionInterface``.

Each takes transformers' arguments (``query (B, Hq, N, D)``, ``key``/``value (B, Hk, M, D)`` including any cached
tokens, the mask of :func:`batch.padding_mask`, ``dropout``, ``scaling``, ``sliding_window`` and the model's keyword
arguments) and returns ``(out (B, N, Hq, D), None)``. Which longattn function runs:

- a packed batch (``cu_seq_lens_q/k`` given, or ``position_ids`` restarting inside a row): the varlen functions;
- a padded batch (a mask with zeros): unpadded into a packed batch, the varlen functions, padded back (padded query
  rows give 0; bidirectional attention without a window, an encoder's or a cross-attention, unpads only the keys
  and computes every query row, as sdpa does);
- a chunked layer (Llama 4's, the chunks read from the model's mask: :func:`batch.mask_chunks`), or a packed batch
  that only the mask describes (a model that does not pass ``position_ids`` to its attention, as Llama 4): each
  chunk's real tokens one sequence of a packed batch (:func:`_chunked`), with or without padding or a KV cache;
- otherwise the batched functions: ``flash_attention`` / ``dilated_attention`` / ``block_sparse_attention`` when the
  queries are the whole sequence or gradients are needed, the KV-cache decode functions when a few new tokens
  (at most :data:`DECODE_MAX_NEW`) attend to a cache.

Inside ``with context_parallel(...)`` (:mod:`.parallel`) ``"longattn"`` instead runs the plan's distributed
attention on this rank's shard of the sequence (:func:`_context_parallel`).

One new token of dense attention against transformers' cache runs PyTorch's SDPA on the visible keys (all of them,
or the window's): measured on an H100 it is at least as fast as our decode kernel at one query token, and
transformers' dynamic cache is a new, longer tensor at every step, which makes every step a first call for the
decode kernels' per-shape launch plan. Two to :data:`DECODE_MAX_NEW` new tokens (speculative decoding, chunked
prefill) run :func:`longattn.flash_attention_with_kvcache`, bottom-right causal, which SDPA cannot do without a
mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

import longattn
from longattn import _validation as V
from longattn._memo import per_tensor
from longattn.backends import sdpa as sdpa_backend
from longattn.integrations.transformers import batch as B
from longattn.integrations.transformers.config import backend, block_sparse_settings, dilated_settings, setting
from longattn.integrations.transformers.parallel import active as active_plan

DECODE_MAX_NEW = 16
# Keyword arguments some models hand their attention function that change what it computes and that no longattn
# function takes: T5's relative position bias, sinks under that name, sparse-attention indices.
_UNHONOURED = ("position_bias", "sinks", "indices", "block_indices")


@dataclass
class Inputs:
    """One attention call, batch-first and checked."""
    name: str
    query: Tensor  # transformers' (B, Hq, N, D)
    key: Tensor  # (B, Hk, M, D)
    value: Tensor
    mask: Optional[Tensor]  # bool (B, M') key mask of batch.padding_mask, M' <= M, with a False; or None
    packable: bool  # no attention_mask was given: position_ids may describe a packed batch (transformers' rule)
    causal: bool
    scale: Optional[float]
    window: Tuple[int, int]
    backend: str
    kwargs: dict
    sinks: Optional[Tensor] = None  # gpt-oss's s_aux: (Hq,) logits
    softcap: float = 0.0  # Gemma 2's attn_logit_softcapping (0: off)
    cross: bool = False  # cross-attention: the keys are another sequence's (an encoder's), the mask is theirs
    chunks: Optional[Tensor] = None  # the mask of batch.padding_mask if it has MaskInfo.chunks (chunked or packed)
    chunked: bool = False  # a chunked attention layer (Llama 4's)

    @property
    def q(self) -> Tensor:  # (B, N, Hq, D)
        return self.query.transpose(1, 2)

    @property
    def k(self) -> Tensor:  # (B, M, Hk, D)
        return self.key.transpose(1, 2)

    @property
    def v(self) -> Tensor:
        return self.value.transpose(1, 2)

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.query, self.key, self.value))


def _inputs(name: str, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float,
            scaling: Optional[float], sliding_window: Optional[int], softcap, kwargs: dict) -> Inputs:
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_implementation={name!r} does not return attention weights: output_attentions=True "
                         f"needs attn_implementation='eager'")
    if dropout:
        raise ValueError(f"attn_implementation={name!r} has no attention dropout: the model runs with "
                         f"{_dropout_key(getattr(module, 'config', None), dropout)}={dropout} in training; build it "
                         f"with 0.0 there (its layers copy the value when they are built)")
    if softcap is not None and name != "longattn":
        raise ValueError(f"attn_implementation={name!r} does not support logit soft-capping (softcap={softcap}, "
                         f"config.attn_logit_softcapping); attn_implementation='longattn' does")
    unknown = [k for k in _UNHONOURED if kwargs.get(k) is not None]
    if unknown:
        raise ValueError(f"attn_implementation={name!r} cannot honour the model's {', '.join(unknown)} (a score bias, "
                         f"sinks or sparse indices passed to the attention function); use attn_implementation='sdpa' "
                         f"or 'eager' for this model")
    sinks = kwargs.get("s_aux")
    if sinks is not None and name != "longattn":
        raise ValueError(f"attn_implementation={name!r} does not support attention sinks (s_aux); "
                         f"attn_implementation='longattn' does")
    config = getattr(module, "config", None)
    info = getattr(attention_mask, B.MASK_INFO, None)
    chunks = None if info is None or info.chunks is None else attention_mask
    chunked = info is not None and info.chunked
    if chunked and name != "longattn":
        raise ValueError(f"attn_implementation={name!r} does not support chunked attention (this layer's mask is "
                         f"chunked: config.attention_chunk_size); attn_implementation='longattn' does")
    layer_types, layer = setting(config, "layer_types", None), getattr(module, "layer_idx", None)
    if (info is not None and not chunked and setting(config, "attention_chunk_size", None)
            and isinstance(layer_types, (list, tuple)) and isinstance(layer, int) and 0 <= layer < len(layer_types)
            and layer_types[layer] == "chunked_attention"):  # (a transformers whose chunked mask is not read here)
        raise ValueError(f"attn_implementation={name!r}: layer {layer} is a chunked attention layer "
                         f"(config.layer_types) but its mask was not read as chunked; use attn_implementation='sdpa'")
    if info is None and setting(config, "attention_chunk_size", None):
        # no mask of ours tells whether this layer is one of the chunked ones
        raise ValueError(f"attn_implementation={name!r}: the model has chunked attention (config.attention_chunk_size"
                         f"={config.attention_chunk_size}) but this layer got no attention_mask built by longattn's "
                         f"mask function, so it cannot tell whether the layer is chunked; use "
                         f"attn_implementation='sdpa' for it")
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2
                                       or attention_mask.dtype != torch.bool):
        raise ValueError(f"attn_implementation={name!r} got an attention_mask it did not build "
                         f"({type(attention_mask).__name__} "
                         f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else ''}): an "
                         f"arbitrary (e.g. 4-D float) mask cannot be honoured; use attn_implementation='sdpa'")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"attn_implementation={name!r} needs the value head dim equal to the query's, got "
                         f"{value.shape[-1]} and {query.shape[-1]}")
    if not 1 <= query.shape[-1] <= V.MAX_HEAD_DIM:
        raise ValueError(f"attn_implementation={name!r} takes head dims from 1 to {V.MAX_HEAD_DIM}, this model's is "
                         f"{query.shape[-1]}; use attn_implementation='sdpa' for it")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    window = (-1, -1)
    given = attention_mask is not None if info is None else info.given
    packable = not given
    if info is not None and info.causal is not None:
        causal = info.causal  # what the model's mask draws, which eager applies, whatever the layer says it is
    if info is not None and info.window is not None:
        # the sliding window of the model's mask, which eager and sdpa apply, whatever this layer's sliding_window
        # argument says (see batch.MaskInfo)
        window = info.window
        causal = causal and window[1] == 0
    elif sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"attn_implementation={name!r}: sliding_window must be a positive int, got "
                             f"{sliding_window!r}")
        # transformers' sliding window of w: a query sees itself and the w - 1 keys before it (and after it when
        # bidirectional)
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    if (attention_mask is not None and attention_mask.shape[1] == key.shape[2]
            and (not given or B.all_true(attention_mask))):
        attention_mask = None  # every key real (the check was paid once per forward, by the mask function)
    # Bidirectional attention in a decoder (BART's, T5's, Whisper's `is_decoder` modules), or queries and keys of
    # different lengths without a causal mask: the decoder's cross-attention to the encoder's keys.
    cross = not causal and (bool(getattr(module, "is_decoder", False)) or query.shape[2] != key.shape[2])
    return Inputs(name, query, key, value, attention_mask, packable, causal, scaling, window, backend(config), kwargs,
                  sinks, float(softcap or 0.0), cross, chunks, chunked)


# Where transformers' models keep their attention dropout (Llama's, BERT's, GPT-2's, ...)
_DROPOUT_KEYS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop", "attn_dropout",
                 "attention_dropout_prob")


def _dropout_key(config, dropout: float) -> str:
    """``config.<key>`` of the model's attention dropout ``dropout``, for an error message."""
    for key in _DROPOUT_KEYS:
        if setting(config, key, None) == dropout:
            return f"config.{key}"
    return f"an attention dropout (config.{'/'.join(_DROPOUT_KEYS)})"


def _packed_cu_seqlens(x: Inputs) -> Optional[Tuple[Tensor, Tensor]]:
    """``(cu_seqlens_q, cu_seqlens_k)`` of a padding-free batch, or None."""
    cu_q, cu_k = x.kwargs.get("cu_seq_lens_q"), x.kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError(f"attn_implementation={x.name!r}: cu_seq_lens_q and cu_seq_lens_k must be given together")
        if x.mask is not None:
            raise ValueError(f"attn_implementation={x.name!r}: a packed batch (cu_seq_lens_q/k) takes no padding "
                             f"attention_mask")
        return cu_q, cu_k
    position_ids = x.kwargs.get("position_ids")
    n, m = x.q.shape[1], x.k.shape[1]
    if position_ids is None or not x.packable or x.cross or n != m or position_ids.shape[-1] != n:
        return None
    cu = B.documents(position_ids)
    if cu is None:
        return None
    batch = x.q.shape[0]
    if position_ids.shape[0] == 1 and batch > 1:  # position_ids shared by every row
        rows = torch.arange(batch, device=cu.device, dtype=cu.dtype)[:, None] * n
        cu = torch.cat([(cu[:-1][None] + rows).reshape(-1), cu.new_tensor([batch * n])])
    elif position_ids.shape[0] != batch:
        raise ValueError(f"attn_implementation={x.name!r}: position_ids of shape {tuple(position_ids.shape)} do not "
                         f"match a batch of {batch}")
    return cu, cu


def _flat(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _route(x: Inputs, whole: Callable, cached: Callable, packed: Callable) -> Tensor:
    """Send one call to ``whole(q, k, v)`` (queries are the whole sequence, or gradients are needed),
    ``cached(q, k, v)`` (a few new tokens against a cache) or ``packed(q, k, v, cu_q, cu_k)``
    (a packed batch), unpadding and padding around ``packed`` for a padded batch."""
    q, k, v = x.q, x.k, x.v
    batch, n = q.shape[:2]
    cu = _packed_cu_seqlens(x)
    if cu is not None:
        out = packed(_flat(q), _flat(k), _flat(v), cu[0], cu[1])
        return out.reshape(batch, n, *out.shape[1:])
    if x.mask is not None:
        length = x.mask.shape[1]
        k, v = k[:, :length], v[:, :length]  # keys past the mask (a static cache's unused tail) do not exist yet
        if not B.all_true(x.mask):
            spans_all = x.window[0] >= length - 1 and (x.causal or x.window[1] >= length - 1)
            if x.window != (-1, -1) and not spans_all and B.has_gaps(x.mask):
                # Unpadding would close the gaps, and the window counts positions, padding included (a window
                # spanning every key column cuts nothing, before or after unpadding: exact).
                raise ValueError(f"attn_implementation={x.name!r}: a sliding window with padding inside a sequence "
                                 "(an attention_mask with zeros between ones) is not supported: transformers counts "
                                 "the window in positions, padding included; pad on the left or the right (on the left "
                                 "for generate(): its new tokens follow a right padding)")
            keys = B.unpad_plan_of(x.mask, length)
            if x.cross or (not x.causal and x.window == (-1, -1)):
                # Every query row is computed against the real keys, as by sdpa: the mask is the keys' (in
                # cross-attention, the encoder's padding), and bidirectional attention without a window cannot tell
                # a cross-attention whose module does not say so (BERT's and GPT-2's, with as many decoder tokens as
                # encoder tokens) from an encoder's self-attention: unpadding the queries by the keys' mask would
                # zero decoder rows at the encoder's padding. An encoder's padded rows get sdpa's values, not 0.
                cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * n
                out = packed(_flat(q), B.unpad(k, keys), B.unpad(v, keys), cu_q, keys.cu_seqlens)
                return out.reshape(batch, n, *out.shape[1:])
            queries = B.unpad_plan_of(x.mask, n)
            out = packed(B.unpad(q, queries), B.unpad(k, keys), B.unpad(v, keys), queries.cu_seqlens,
                         keys.cu_seqlens)
            return B.pad(out, queries)
    if n < k.shape[1] and n <= DECODE_MAX_NEW and not x.needs_grad:
        return cached(q, k, v)
    return whole(q, k, v)


def longattn_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                       dropout: float = 0.0, scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                       softcap: Optional[float] = None, **kwargs) -> Tuple[Tensor, None]:
    """``attn_implementation="longattn"``: exact attention (causal or not, sliding window, GQA, attention sinks:
    gpt-oss's ``s_aux``, logit soft-capping: Gemma 2's ``softcap``, Llama 4's chunked layers) on longattn's kernels;
    packed and padded batches and chunked layers through :func:`longattn.flash_attention_varlen`, generation steps
    through :func:`longattn.flash_attention_with_kvcache`."""
    x = _inputs("longattn", module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                kwargs)
    plan = active_plan()
    if plan is not None:
        return _context_parallel(x, plan), None
    if (query.shape[2] == 1 and key.shape[2] > 1 and x.mask is None and x.causal and x.backend == "auto"
            and not x.needs_grad and x.kwargs.get("cu_seq_lens_q") is None
            and not x.chunked):  # a decode step: see the module doc
        return _one_token(x), None
    common = dict(causal=x.causal, window=x.window, scale=x.scale, backend=x.backend, sinks=x.sinks,
                  softcap=x.softcap)

    def whole(q, k, v):
        return longattn.flash_attention(q, k, v, **common)

    def cached(q, k, v):
        if not x.causal:
            return whole(q, k, v)
        return longattn.flash_attention_with_kvcache(q, k, v, cache_seqlens=k.shape[1], **common)

    def packed(q, k, v, cu_q, cu_k):
        return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **common)

    if x.chunked or (x.chunks is not None and x.kwargs.get("position_ids") is None
                     and x.kwargs.get("cu_seq_lens_q") is None):
        return _chunked(x, packed), None
    return _route(x, whole, cached, packed), None


def _chunked(x: Inputs, packed: Callable) -> Tensor:
    """A chunked layer (Llama 4's): a query sees the earlier keys of its chunk, transformers' chunks of
    ``attention_chunk_size`` positions counted from each sequence's first real token (or document's, in a packed
    batch), cache included. Each chunk's real tokens become one sequence of ``packed`` (varlen, bottom-right causal:
    a chunk's new tokens are its last keys), padded query rows give 0; the plan is built once per forward pass
    (:func:`batch.chunk_plans_of`); a packed batch's documents are chunks of the mask too (transformers' packed mask,
    which ``cu_seq_lens_q/k`` must agree with). Also runs the other layers of a packed batch that only the mask
    describes: their chunks are the documents."""
    q, k, v = x.q, x.k, x.v
    n, length = q.shape[1], x.chunks.shape[1]
    documents = x.kwargs.get("cu_seq_lens_q")
    cu_k = x.kwargs.get("cu_seq_lens_k")
    if (documents is not None or cu_k is not None) and (
            documents is None or cu_k is None or x.mask is not None or n != length
            or not (documents is cu_k or torch.equal(documents, cu_k))):
        raise ValueError(f"attn_implementation={x.name!r}: a packed batch (cu_seq_lens_q/k) on a chunked attention "
                         f"layer needs cu_seq_lens_q == cu_seq_lens_k, no padding attention_mask and no cached tokens")
    queries, keys = B.chunk_plans_of(x.chunks, n, documents)
    k, v = k[:, :length], v[:, :length]  # keys past the mask (a static cache's unused tail) do not exist yet
    out = packed(B.unpad(q, queries), B.unpad(k, keys), B.unpad(v, keys), queries.cu_seqlens, keys.cu_seqlens)
    return B.pad(out, queries)


def _context_parallel(x: Inputs, plan) -> Tensor:
    """This rank's rows of attention over the whole sequence split across the ranks of ``plan`` (a
    :class:`longattn.distributed.ContextParallel`): its distributed attention on the shards, global causal mask,
    with the layer's soft-capping and sinks (a packed batch is soft-capped by a Ulysses plan only)."""
    refused = [(x.mask is not None, "a padding attention_mask"),
               (x.window != (-1, -1), f"sliding_window (this layer: window {x.window})"),
               (x.chunked, "chunked attention (config.attention_chunk_size)"),
               (x.q.shape[1] != x.k.shape[1], f"a KV cache holding earlier tokens ({x.q.shape[1]} queries, "
                                              f"{x.k.shape[1]} keys)")]
    for found, name in refused:  # the model's settings: the same on every rank
        if found:
            raise ValueError(f"attn_implementation='longattn': {CONTEXT_PARALLEL} does not support {name}; run it "
                             f"outside the context_parallel block")
    cu = _check_shards(x, plan)
    common = dict(causal=x.causal, scale=x.scale, backend=x.backend, softcap=x.softcap, sinks=x.sinks)
    if cu is None:
        return plan.attention(x.q, x.k, x.v, **common)
    return plan.attention(x.q[0], x.k[0], x.v[0], cu_seqlens=cu, **common)[None]


CONTEXT_PARALLEL = "context parallelism (longattn.integrations.transformers.context_parallel)"


@per_tensor()
def _checked(position_ids: Tensor) -> dict:
    return {}


def _check_shards(x: Inputs, plan) -> Optional[Tensor]:
    """The global ``cu_seqlens`` of a packed batch (None for one sequence per row), after checking on every rank
    that it is one row and that ``position_ids`` are the positions ``plan.shard_batch`` gives this rank's rows (the
    rotary embeddings were computed from them): ``plan.positions``, or for one sequence per row those plus one
    offset ``c >= 0`` per row, the same on every rank (a window ``c .. c + N - 1`` of a longer text, as one process
    would run it). A forgotten ``position_ids`` (each shard numbered from 0) fails: on a rank holding global rows
    after its first ones, the numbers are not the global ones plus a constant ``>= 0``. A failure on any rank raises
    ``ValueError`` on all of them. Checked once per ``position_ids`` tensor where :mod:`longattn._memo` allows
    (every layer receives the same one)."""
    cu_q, cu_k = x.kwargs.get("cu_seq_lens_q"), x.kwargs.get("cu_seq_lens_k")
    position_ids = x.kwargs.get("position_ids")
    n = x.q.shape[1]
    checked = {} if position_ids is None else _checked(position_ids)
    key = (id(plan), id(cu_q), id(cu_k), x.q.shape[0], n)
    if key in checked:
        return cu_q
    error, offsets = None, None
    if (cu_q is None) != (cu_k is None) or not (cu_q is cu_k or cu_q is None or torch.equal(cu_q, cu_k)):
        error = ("cu_seq_lens_q and cu_seq_lens_k must be given together and be equal (the global documents of a "
                 "packed batch, as ContextParallel.shard_batch gives them)")
    elif cu_q is not None and x.q.shape[0] != 1:
        error = f"a packed batch (cu_seq_lens_q/k) must be one row, got {x.q.shape[0]}"
    elif position_ids is not None:
        want = plan.positions(n, cu_q, device=position_ids.device)
        rows = position_ids.reshape(-1, position_ids.shape[-1])
        if rows.shape[-1] == n and rows.shape[0] in (1, x.q.shape[0]):
            offset = rows[:, :1] - want[:1] if cu_q is None else torch.zeros_like(rows[:, :1])  # one per row
            if bool((rows == want + offset).all() & (offset >= 0).all()):
                offsets = offset.expand(x.q.shape[0], 1).flatten().tolist()
        if offsets is None:
            error = (f"position_ids must be the positions of this rank's {n} tokens in the whole sequence "
                     f"({want[:8].tolist()}...{' plus one offset >= 0 per row' if cu_q is None else ''}), got "
                     f"{rows[0, :8].tolist()}...: cut the batch with ContextParallel.shard_batch (position_ids sharded "
                     f"with the tokens)")
    plan.check_together(None if error is None else f"{CONTEXT_PARALLEL}: {error}",
                        fn="attn_implementation='longattn'",
                        same={"offset of position_ids from the global positions, per row (ContextParallel."
                              "shard_batch cuts one batch alike on every rank)": offsets})
    checked[key] = True
    return cu_q


def _one_token(x: Inputs) -> Tensor:
    """One new token against all of transformers' keys: :func:`longattn.flash_attention_with_kvcache` with the
    cache's whole length, which ``auto`` runs on SDPA's default kernel over the keys the token sees where that is
    the faster (the dispatch table's decode entries). Returns ``(B, 1, Hq, D)``."""
    return longattn.flash_attention_with_kvcache(x.q, x.k, x.v, cache_seqlens=x.k.shape[1], causal=True,
                                                 window=x.window, scale=x.scale, backend=x.backend, sinks=x.sinks,
                                                 softcap=x.softcap)


def longattn_dilated_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                               dropout: float = 0.0, scaling: Optional[float] = None,
                               sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                               **kwargs) -> Tuple[Tensor, None]:
    """``attn_implementation="longattn_dilated"``: LongNet's dilated attention, causal, with the segment lengths
    and dilation rates of ``config.longattn_dilated`` (see :mod:`.config`); each document of a packed or padded
    batch is its own sequence (its segments start at its first real token)."""
    x = _inputs("longattn_dilated", module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                softcap, kwargs)
    _refuse_context_parallel(x.name)
    if x.window != (-1, -1):
        raise ValueError(f"attn_implementation='longattn_dilated' replaces full attention, but this layer has "
                         f"sliding_window={x.window[0] if sliding_window is None else sliding_window} "
                         f"(config.sliding_window / use_sliding_window); disable the "
                         f"sliding window or use attn_implementation='longattn'")
    if not x.causal:
        raise ValueError("attn_implementation='longattn_dilated' is for causal decoder models (the model's "
                         "attention has is_causal=False)")
    s = dilated_settings(module.config)
    common = dict(segment_lengths=s.segment_lengths, dilation_rates=s.dilation_rates, head_split=s.head_split,
                  scale=x.scale, backend=x.backend)

    def cached(q, k, v, cache_seqlens=None):
        seqlens = k.shape[1] if cache_seqlens is None else cache_seqlens
        return longattn.dilated_attention_with_kvcache(q, k, v, cache_seqlens=seqlens, **common)

    def whole(q, k, v):
        if q.shape[1] == k.shape[1]:
            return longattn.dilated_attention(q, k, v, causal=True, **common)
        if x.needs_grad:
            raise ValueError(f"attn_implementation='longattn_dilated': {q.shape[1]} queries against {k.shape[1]} "
                             f"keys with gradients (training against a cache) is not supported")
        return cached(q, k, v)

    def packed(q, k, v, cu_q, cu_k):
        if q.shape[0] == k.shape[0] and torch.equal(cu_q, cu_k):
            return longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu_q, causal=True, **common)
        if x.needs_grad:
            raise ValueError("attn_implementation='longattn_dilated': a packed batch needs the same documents in "
                             "queries and keys (cu_seq_lens_q == cu_seq_lens_k)")
        return _compacted(q, k, v, cu_q, cu_k, cached)

    return _route(x, whole, cached, packed), None


def _refuse_context_parallel(name: str) -> None:
    if active_plan() is not None:
        raise ValueError(f"attn_implementation={name!r} does not run under context parallelism "
                         f"(longattn.integrations.transformers.context_parallel); attn_implementation='longattn' does")


def _compacted(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, cached: Callable) -> Tensor:
    """New tokens of padded sequences against their unpadded keys (each sequence's new tokens are its last keys),
    run as one batched cached step: each sequence's keys copied to the front of a ``(B, longest, Hk, D)`` cache.
    Sequences with different numbers of new tokens (a chunked prefill reaching into a left-padded prompt) run one by
    one. Returns ``(total_q, Hq, D)``."""
    nq, nk = torch.diff(cu_q), torch.diff(cu_k)
    batch = nq.numel()
    n = q.shape[0] // max(batch, 1)
    if q.shape[0] != n * batch or not bool((nq == n).all()):
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        outs = [_compacted(q[a:b], k[c:d], v[c:d], cu_q.new_tensor([0, b - a]), cu_k.new_tensor([0, d - c]), cached)
                for a, b, c, d in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]) if b > a]
        return torch.cat(outs) if outs else q.new_zeros(0, *q.shape[1:])
    longest = int(nk.max())
    cols = torch.arange(longest, device=k.device)
    # slot j of sequence b holds its packed key cu_k[b] + j; slots past its length repeat its last key and are never
    # read (cache_seqlens stops before them)
    src = (cu_k[:-1, None].long() + torch.minimum(cols[None], (nk[:, None] - 1).clamp(min=0))).reshape(-1)
    kc = k.index_select(0, src).reshape(batch, longest, *k.shape[1:])
    vc = v.index_select(0, src).reshape(batch, longest, *v.shape[1:])
    out = cached(q.reshape(batch, n, *q.shape[1:]), kc, vc, nk.to(torch.int32))
    return out.reshape(batch * n, *out.shape[2:])


def longattn_block_sparse_attention(module, query: Tensor, key: Tensor, value: Tensor,
                                    attention_mask: Optional[Tensor], dropout: float = 0.0,
                                    scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                                    softcap: Optional[float] = None, **kwargs) -> Tuple[Tensor, None]:
    """``attn_implementation="longattn_block_sparse"``: attention restricted to the block pattern of
    ``config.longattn_block_sparse`` (see :mod:`.config`), causal on top for causal models. The pattern is laid on
    the positions of the whole sequence, so a generation step's new tokens see the keys their rows of that pattern
    allow. Padded and packed batches are refused (a block pattern is laid on positions, which padding shifts)."""
    name = "longattn_block_sparse"
    x = _inputs(name, module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)
    _refuse_context_parallel(name)
    if x.window != (-1, -1):
        raise ValueError(f"attn_implementation={name!r} replaces full attention, but this layer has sliding_window="
                         f"{x.window[0] if sliding_window is None else sliding_window}; disable the sliding window or "
                         f"use attn_implementation='longattn'")
    s = block_sparse_settings(module.config)

    def whole(q, k, v):
        n, m = q.shape[1], k.shape[1]
        if n == m:
            pattern = _pattern(s.pattern, s.block_size, n, q.device)
            return longattn.block_sparse_attention(q, k, v, block_mask=pattern, causal=x.causal, scale=x.scale,
                                                   backend=x.backend)
        return _pattern_rows(q, k, v, s.pattern, s.block_size, x.causal, x.scale)

    def refuse(*args):
        raise ValueError(f"attn_implementation={name!r} does not take padded or packed batches (attention_mask with "
                         f"zeros, cu_seq_lens_q/k, or position_ids restarting inside a row): a block pattern is laid "
                         f"on positions; run such sequences unpadded, one per row")

    return _route(x, whole, whole, refuse), None


_patterns: dict = {}


def _pattern(pattern, block_size: Tuple[int, int], n: int, device: torch.device):
    """The :class:`~longattn.patterns.BlockSparsePattern` of ``pattern`` for length ``n``, built once per (pattern,
    block size, length, device) and shared by the layers and steps (it caches its kernels' block lists).

    Keyed by the pattern object (held by the entry, so its id is not reused) and its repr (an edited pattern is
    built again): a repr alone is shared by a subclass that draws differently (``class Wide(Local)``) or reused
    with the id in a default repr, which gave one pattern another's mask."""
    key = (id(pattern), repr(pattern), block_size, n, str(device))
    entry = _patterns.get(key)
    if entry is None or entry[0] is not pattern:
        if len(_patterns) >= 64:
            _patterns.clear()
        entry = _patterns[key] = (pattern, pattern.build(n, block_size=block_size, device=device))
    return entry[1]


def _pattern_rows(q: Tensor, k: Tensor, v: Tensor, pattern, block_size: Tuple[int, int], causal: bool,
                  scale: Optional[float]) -> Tensor:
    """The last ``N`` query positions of a length-``M`` sequence against its ``M`` keys, with the pattern's rows for
    those positions expanded to an element mask: PyTorch SDPA (a generation step; no kernel of ours takes partial
    rows of a block pattern)."""
    n, m = q.shape[1], k.shape[1]
    bq, bk = block_size
    blocks = pattern.mask(m, block_size=block_size, device=q.device)[0]  # (H or 1, q_blocks, k_blocks)
    rows = torch.arange(m - n, m, device=q.device)
    cols = torch.arange(m, device=q.device)
    allowed = blocks[:, rows // bq][:, :, cols // bk]  # (H or 1, N, M)
    if causal:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    out = sdpa_backend.grouped_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[None],
                                    scale=scale)
    out = torch.where(allowed.any(-1)[None, :, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.transpose(1, 2)
