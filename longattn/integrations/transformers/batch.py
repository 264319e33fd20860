"""How a transformers batch reaches longattn: the padding mask the model builds for us, unpadding into a packed
batch and back, and the documents of a packed (padding-free) batch.

transformers calls a registered mask function once per forward pass (:func:`padding_mask`); what it returns is the
``attention_mask`` every layer's attention function receives: a bool ``(batch, keys)`` tensor that is True at the
keys that exist (real tokens, not the unused tail of a static cache), whose all-True check is paid here once per
forward pass, carrying a :class:`MaskInfo` (whether the mask is causal, its sliding window, its chunks, whether the
model got an attention_mask: where it got none, position_ids that restart mark a packed batch, as for transformers'
sdpa); or ``None`` where the mask function says none of these. The query rows are the last ``q_length`` of those key
columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn._memo import own, per_tensor
from longattn.integrations.transformers.parallel import active as active_plan


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[Tensor] = None, **kwargs) -> Optional[Tensor]:
    """transformers' mask-interface signature: the 2-D key mask described in the module docstring, or ``None``.

    Raises ``ValueError`` for masks we cannot honour: a model's custom mask functions (``or_mask_function`` /
    ``and_mask_function``, e.g. bidirectional image tokens) or block-wise overlays.
    """
    if kwargs.get("use_vmap") or "or_mask" in _mask_parts(mask_function):
        raise ValueError("longattn attention implementations cannot honour this model's custom attention mask "
                         "(or_mask_function / and_mask_function / block_sequence_ids); use attn_implementation="
                         "'sdpa' for it")
    if getattr(kwargs.get("config"), "index_topk", None):  # DeepSeek sparse attention: its indexer reads the mask
        raise ValueError("longattn attention implementations do not run DeepSeek sparse attention (config.index_topk: "
                         "its indexer reads a 4-D mask, and its attention takes sparse indices); use "
                         "attn_implementation='sdpa' or 'eager' for it")
    if attention_mask is not None and active_plan() is not None:  # refused on every rank (the zeros may be on one)
        raise ValueError("context parallelism (longattn.integrations.transformers.context_parallel) takes no "
                         "attention_mask: padding is not supported; pack the sequences into one row instead "
                         "(ContextParallel.shard_batch drops a mask without zeros)")
    window = mask_window(mask_function, kwargs.get("local_size"))
    causal = mask_causality(mask_function)
    chunked = any(getattr(fn, "__qualname__", "").split(".")[0].endswith("chunked_overlay")  # (or _legacy_...)
                  for fn in _mask_functions(mask_function))
    chunks = None
    if chunked or _packed(mask_function):
        chunks = mask_chunks(mask_function, batch_size, kv_offset, kv_length, kwargs.get("device", "cpu"))
    if chunked and chunks is None:
        raise ValueError("longattn attention implementations could not read the chunks of this model's chunked "
                         "attention mask; use attn_implementation='sdpa' for it")
    if causal and q_length > 1 and kwargs.get("allow_is_causal_skip") is False and not _packed(mask_function):
        # the model asked for a materialised causal mask (no is_causal shortcut) to edit or read it before its
        # attention runs: Doge adds its dynamic mask onto it, an indexer reads causality from it; a 2-D key mask
        # would reach that code, not ours (Doge raised IndexError there)
        raise ValueError("longattn attention implementations cannot honour this model's attention mask: the model "
                         "builds its causal mask with allow_is_causal_skip=False to edit or read the 4-D mask itself "
                         "(e.g. Doge's dynamic mask, an indexer's causality); use attn_implementation='sdpa' or "
                         "'eager' for it")
    kv_end = kv_offset + kv_length
    # one past the last query's position: in causal attention keys from there on do not exist yet (a static cache's
    # unused tail); in bidirectional attention (an encoder's, a decoder's cross-attention) every key exists
    end = kv_end if _sees_later_keys(mask_function, q_offset, kv_end) else q_offset + q_length
    if attention_mask is None:
        if isinstance(end, int) and end >= kv_end and window is None and causal is None:
            return None
        keep = torch.ones(batch_size, kv_end, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    else:
        if attention_mask.dim() != 2:
            raise ValueError(f"longattn attention implementations take a 2-D padding attention_mask "
                             f"(batch, seq) of 0/1; got shape {tuple(attention_mask.shape)} (an arbitrary 4-D mask "
                             f"cannot be honoured: use attn_implementation='sdpa' for it)")
        keep = attention_mask.to(torch.bool)
        reused = kv_offset > 0 and keep.shape[1] == kv_length < kv_end
        if (not reused and isinstance(q_offset, int) and keep.shape[1] < q_offset + q_length
                and causal):
            # eager and sdpa run it too, each on its own reading: columns missing at the right taken as padding
            # would hide the new tokens, taken as keys they are guesses
            raise ValueError(f"attention_mask has {keep.shape[1]} columns, but the model attends over "
                             f"{q_offset + q_length} tokens ({q_offset} cached and {q_length} new): a 2-D padding "
                             f"mask needs one column per token, the cached ones included (generate() extends it by "
                             f"one column per new token)")
        if reused:
            # a mask this function already built for these keys (``generate`` builds the masks once per step
            # and hands them back to the model as its attention_mask): keep it as it is
            keep = F.pad(keep, (kv_offset, 0))
        elif keep.shape[1] < kv_end:
            keep = F.pad(keep, (0, kv_end - keep.shape[1]))
    keep = keep[:, kv_offset:kv_end]
    if not (isinstance(end, int) and end >= kv_end):  # keys past the last query (a static cache's unused tail)
        keep = keep[:, :int(end) - kv_offset]
    if attention_mask is None and keep.shape[1] == kv_length and window is None and causal is None and chunks is None:
        return None
    chunks = None if chunks is None else chunks[:, :keep.shape[1]]
    keep = keep.contiguous()  # generate() makes a compileable (static) cache's masks contiguous: a copy has no MaskInfo
    setattr(keep, MASK_INFO, MaskInfo(window, causal, attention_mask is not None, chunks, chunked))
    own(keep)  # a tensor of ours: what is read from it is remembered for every layer of this forward pass
    if attention_mask is not None or keep.shape[1] < kv_length:  # (else all True: made to carry the MaskInfo)
        all_true(keep)  # one host sync per forward pass
    return keep


@dataclass(frozen=True)
class MaskInfo:
    """What the model's mask function draws, carried by every mask of :func:`padding_mask` (attribute
    :data:`MASK_INFO`; a mask made only to carry it is all True). The attention functions take causality and the
    window from it, as eager and sdpa take them from the mask, not from the layer's ``is_causal`` attribute or
    ``sliding_window`` argument: BigBird-Pegasus's decoder layers say ``is_causal=False`` under a causal mask,
    Qwen2-MoE's layers pass no window, and in bidirectional attention the argument differs by one between models
    that compensate for FlashAttention's ``(w - 1, w - 1)`` (ModernBERT passes ``config.sliding_window + 1``) and
    those that do not (T5Gemma's encoder, a decoder with ``config.is_causal=False``)."""
    window: Optional[Tuple[int, int]]  # (left, right): a query sees the keys left positions before it to right after
    causal: Optional[bool]  # whether the mask hides later keys (None: the mask function did not say)
    given: bool  # whether the model got an attention_mask (if not, the mask may be all True)
    # bool (batch, keys), True where a chunk of chunked attention or a document of a packed batch starts (mask_chunks)
    chunks: Optional[Tensor] = None
    chunked: bool = False  # whether the mask is chunked attention's (transformers' chunked_overlay: Llama 4's)


MASK_INFO = "_longattn_mask"


@torch.compiler.disable
def mask_window(mask_function, local_size) -> Optional[Tuple[int, int]]:
    """``(left, right)`` of the sliding window in ``mask_function``: ``(w - 1, 0)`` for transformers' causal one (a
    query sees itself and the ``w - 1`` keys before it), ``(w, w)`` for its bidirectional one (``|q - k| <= w``),
    ``w`` being the ``local_size`` transformers passes the mask function with; None if it has neither. Found by
    name among the functions it is composed of (so a packed batch's or a padded one's are read alike) and asked
    at one query position: a window of another width is not taken for one."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        return None
    for fn in _mask_functions(mask_function):
        name = getattr(fn, "__qualname__", "")
        if name.startswith("sliding_window_overlay."):
            window = (local_size - 1, 0)
        elif name.startswith("sliding_window_bidirectional_overlay."):
            window = (local_size, local_size)
        else:
            continue
        left, right = window
        index = torch.tensor
        try:
            def sees(d: int) -> bool:
                return bool(fn(index(0), index(0), index(left + 1), index(left + 1 + d)))

            shown = sees(-left) and not sees(-left - 1) and (right == 0 or (sees(right) and not sees(right + 1)))
        except Exception:  # noqa: BLE001 - a function of another form under that name
            return None
        return window if shown else None
    return None


@torch.compiler.disable
def mask_chunks(mask_function, batch_size: int, kv_offset, kv_length: int, device) -> Optional[Tensor]:
    """Where the chunks of a causal mask of chunks start: Llama 4's chunked attention (transformers'
    ``chunked_overlay`` on a causal mask: a query sees the earlier keys of its own chunk) and a packed batch's
    documents. A bool ``(batch_size, kv_length)``, True at the key columns whose query cannot see the key just before
    it, column 0 included. Asked of the mask function itself at every column (transformers' take index tensors of
    absolute positions), so the chunks are counted as eager's mask counts them: from each row's first real token
    (after left padding; before torch 2.6 transformers counted from column 0), per document of a packed batch, and
    past the tokens a cache dropped (``kv_offset``). None where the function cannot be asked so."""
    cols = torch.arange(kv_length, device=device) + kv_offset
    rows = torch.arange(batch_size, device=device)[:, None]
    try:
        sees = mask_function(rows, cols.new_zeros(()), cols[None, 1:], cols[None, :-1])
        sees = torch.as_tensor(sees, device=device).expand(batch_size, kv_length - 1)
    except Exception:  # noqa: BLE001 - a mask function of another form
        return None
    return torch.cat([sees.new_ones(batch_size, 1), ~sees], 1)


def _packed(mask_function) -> bool:
    """Whether ``mask_function`` is a padding-free packed batch's: transformers remaps its positions per document
    (and then never skips materialising the mask, which for that reason alone is no edit by the model)."""
    return any(getattr(fn, "__qualname__", "").startswith("remap_positions_for_packed_sequence.")
               for fn in _mask_functions(mask_function))


def _mask_parts(mask_function) -> Tuple[str, ...]:
    """The names of the functions transformers composed ``mask_function`` of (``and_masks``/``or_masks`` keep theirs
    in their closures), itself included: a custom overlay (``or_mask``) may sit inside an ``and_mask``, as a packed
    batch's mask wraps the model's."""
    return tuple(getattr(fn, "__name__", "") for fn in _mask_functions(mask_function))


def _mask_functions(mask_function) -> list:
    """``mask_function`` and the functions in its closures, recursively (see :func:`_mask_parts`)."""
    functions, todo, seen = [], [mask_function], set()
    while todo:
        fn = todo.pop()
        if not callable(fn) or id(fn) in seen:
            continue
        seen.add(id(fn))
        functions.append(fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            todo.extend(value if isinstance(value, (tuple, list)) else (value,))
    return functions


@torch.compiler.disable
def mask_causality(mask_function) -> Optional[bool]:
    """Whether ``mask_function`` hides key 1 from query 0 (a causal mask, sliding or chunked; not an encoder's or a
    cross-attention's, whose 2-D mask is the keys' own); None without a mask function or where it cannot be asked
    (a packed batch's of one token)."""
    if mask_function is None:
        return None
    index = torch.tensor
    try:
        return not bool(mask_function(index(0), index(0), index(0), index(1)))
    except Exception:  # noqa: BLE001 - a mask function of another form
        return None


@torch.compiler.disable  # host-side questions to the mask function: Dynamo failed tracing transformers' and_masks
def _sees_later_keys(mask_function, q_offset: int, kv_end: int) -> bool:
    """Whether the model's mask lets the first query (position ``q_offset``) see the last key (``kv_end - 1``) past
    it: bidirectional attention, where no key is a future one. Asked of the mask function itself (transformers' take
    index tensors of absolute positions); a causal one says no."""
    if mask_function is None or not isinstance(q_offset, int) or kv_end <= q_offset + 1:
        return False
    index = torch.tensor
    try:
        return bool(mask_function(index(0), index(0), index(q_offset), index(kv_end - 1)))
    except Exception:  # noqa: BLE001 - a mask function of another form: take it as causal, as before
        return False


@dataclass
class Unpadded:
    """Where the real rows of a padded ``(B, L, ...)`` tensor went in the packed ``(total, ...)`` one."""
    index: Tensor       # (total,) flat positions ``b * L + i`` of the real rows
    cu_seqlens: Tensor  # (B + 1,) int32
    batch: int
    length: int


def unpad_plan(keep: Tensor) -> Unpadded:
    """The plan that packs the True rows of the bool ``(B, L)`` mask ``keep`` (one host sync)."""
    counts = keep.sum(1, dtype=torch.int32)
    cu = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    index = keep.reshape(-1).nonzero().squeeze(1)
    return Unpadded(index, cu, keep.shape[0], keep.shape[1])


def unpad(x: Tensor, plan: Unpadded) -> Tensor:
    """``(B, L, ...)`` -> ``(total, ...)``: the real rows, sequence after sequence."""
    return x.reshape(plan.batch * plan.length, *x.shape[2:]).index_select(0, plan.index)


def pad(x: Tensor, plan: Unpadded) -> Tensor:
    """``(total, ...)`` -> ``(B, L, ...)``, zeros at the padded rows (differentiable)."""
    out = x.new_zeros(plan.batch * plan.length, *x.shape[1:])
    out = out.index_copy(0, plan.index, x)
    return out.reshape(plan.batch, plan.length, *x.shape[1:])


@per_tensor()
def _plans_of(mask: Tensor) -> dict:
    return {}


def unpad_plan_of(mask: Tensor, last: int) -> Unpadded:
    """:func:`unpad_plan` of the last ``last`` columns of ``mask``, built once per mask tensor and ``last`` (every
    layer gets the same mask: its host syncs are paid once per forward pass)."""
    plans = _plans_of(mask)
    if last not in plans:
        plans[last] = unpad_plan(mask if last == mask.shape[1] else mask[:, mask.shape[1] - last:])
    return plans[last]


@per_tensor()
def _chunk_plans_of(mask: Tensor) -> dict:
    return {}


def chunk_plans_of(mask: Tensor, last: int, documents: Optional[Tensor] = None) -> Tuple[Unpadded, Unpadded]:
    """Chunked attention as a packed batch: ``(queries, keys)`` plans that unpad the real query rows (the last ``last``
    columns of ``mask``) and the real keys of ``mask`` (a mask of :func:`padding_mask` with ``chunks``) into one
    sequence per chunk holding a query, its queries being the last of its keys (bottom-right causal is exact).
    ``documents``, the ``cu_seq_lens`` of a packed batch (``last`` columns in all), must each start a chunk of the
    mask (``ValueError`` if not). Built once per mask tensor, ``last`` and ``documents`` (host syncs once per forward
    pass, as :func:`unpad_plan_of`)."""
    plans = _chunk_plans_of(mask)
    key = (last, None if documents is None else id(documents))
    if key not in plans:
        plans[key] = (documents, _chunk_plans(mask, getattr(mask, MASK_INFO).chunks, last, documents))
    return plans[key][1]  # (the entry holds documents: its id is not reused while the mask lives)


def _chunk_plans(mask: Tensor, starts: Tensor, last: int, documents: Optional[Tensor]) -> Tuple[Unpadded, Unpadded]:
    batch, length = mask.shape
    starts = starts.reshape(-1)
    if documents is not None:
        firsts = documents[:-1].long()
        if not bool(starts[firsts[firsts < starts.numel()]].all()):
            # chunks counted from a row's start, not from each document's: eager's mask, and ours, when transformers
            # did not see a packed batch (it looks for one only without a cache)
            raise ValueError("a packed batch (cu_seq_lens_q/k) on a chunked attention layer needs transformers' mask "
                             "to separate its documents: pass position_ids restarting at each document and "
                             "use_cache=False (transformers looks for a packed batch only without a cache)")
    chunk = torch.cumsum(starts, 0)  # the chunk of each key column, row after row
    cols = torch.arange(length, device=mask.device)
    q_at = (mask & (cols >= length - last)).reshape(-1).nonzero().squeeze(1)  # flat key positions of the queries
    k_at = mask.reshape(-1).nonzero().squeeze(1)
    chunks, q_counts = torch.unique_consecutive(chunk[q_at], return_counts=True)
    k_at = k_at[torch.isin(chunk[k_at], chunks)]  # the keys of chunks without a query are never read
    k_counts = torch.unique_consecutive(chunk[k_at], return_counts=True)[1]
    q_index = q_at - (q_at // length + 1) * (length - last)  # b * length + c  ->  b * last + c - (length - last)

    def cu(counts):
        return F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))

    return Unpadded(q_index, cu(q_counts), batch, last), Unpadded(k_at, cu(k_counts), batch, length)


@per_tensor()
def all_true(mask: Tensor) -> bool:
    """Whether a bool mask has no False (one host sync, once per mask of :func:`padding_mask`)."""
    return bool(mask.all())


@per_tensor()
def has_gaps(mask: Tensor) -> bool:
    """Whether some row of a bool mask has a False between two True (padding inside a sequence, not only on its
    left or right); one host sync, once per mask."""
    ones = mask.sum(1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, cols, mask.shape[1]).amin(1)
    last = torch.where(mask, cols, -1).amax(1)
    return bool(((ones > 0) & (ones < last - first + 1)).any())


@per_tensor()
def documents(position_ids: Tensor) -> Optional[Tensor]:
    """``cu_seqlens`` (int32) of the documents of a packed batch, or ``None`` if each row is one sequence.

    A document starts at the first column of every row and wherever the position does not follow the previous one
    by 1: the rule transformers applies for ``"sdpa"`` and ``"flex_attention"`` (``find_packed_sequence_indices``),
    so padding-free batches from ``DataCollatorWithFlattening`` split where their position_ids restart. One host
    sync, once per position_ids tensor and version on a GPU (see :func:`longattn.remember_host_reads`).
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    flat = starts.reshape(-1).nonzero().squeeze(1).to(torch.int32)
    if flat.numel() == starts.shape[0]:
        return None
    return torch.cat([flat, flat.new_tensor([starts.numel()])])
