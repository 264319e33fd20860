"""FP8 inputs of the forward functions: their descale factors, output dtype and the forward-only rule.

``flash_attention``, ``flash_attention_varlen`` and ``dilated_attention`` take ``float8_e4m3fn`` q, k and v (all
three) with float32 descale factors in FlashAttention-3's convention: the true values are ``x.float() * descale``,
one factor for the tensor ``(1,)`` or one per (batch, key/value head) ``(B, Hk)`` (per sequence of a packed batch);
a query head uses its key/value head's factor. The output is bfloat16 unless ``out_dtype`` says otherwise, the
log-sum-exp float32. FP8 attention is forward only (an inference path): inputs or descale factors that require grad
are an error. The semantics are the operation on the dequantised values (:func:`longattn.reference.dequantize_fp8`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from longattn._validation import DTYPES, FP8_DTYPES, _is_int, check_cu_seqlens, check_flag, has_values
from longattn.call import Descale

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8(t: Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def check(q: Tensor, k: Tensor, v: Tensor, descales: Tuple[Optional[Tensor], ...], out_dtype, *, batch: int,
          fn: str) -> Tuple[Optional[Descale], Optional[torch.dtype]]:
    """The :class:`~longattn.call.Descale` and output dtype of a call on checked inputs (``(None, None)`` for
    inputs that are not FP8; the output of FP8 inputs is bfloat16 unless ``out_dtype`` says otherwise).

    ``batch`` is the number of rows a per-head factor has (the batch, or the sequences of a packed batch); the
    inputs' key/value heads are ``k.shape[-2]``. Descales and ``out_dtype`` given with inputs that are not FP8 are
    an error, as are FP8 inputs that require grad (with grad mode on)."""
    if out_dtype is None and q.dtype not in FP8_DTYPES and all(d is None for d in descales):
        return None, None  # (the common case, without building the list below)
    if not is_fp8(q):
        given = [name for name, d in zip(_NAMES, descales) if d is not None]
        if out_dtype is not None:
            given.append("out_dtype")
        if given:
            raise ValueError(f"{fn}: {', '.join(given)} apply to float8_e4m3fn inputs only; q, k, v have dtype "
                             f"{q.dtype}")
        return None, None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"{fn}: FP8 attention is forward only, but q, k or v requires grad; detach them (or run "
                         "under torch.no_grad()), or train in bfloat16")
    check_descales_need_no_grad(descales, _NAMES, fn)
    hk = k.shape[-2]
    factors = []
    for name, d in zip(_NAMES, descales):
        if d is None:
            factors.append(torch.ones((batch, hk), dtype=torch.float32, device=q.device))
        else:
            check_descale(d, name, batch, hk, q.device, fn, heads=q.shape[-2])
            factors.append(d.expand(batch, hk))
    if out_dtype is None:
        out_dtype = torch.bfloat16
    elif out_dtype not in OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got "
                        f"{out_dtype!r}")
    return Descale(torch.stack(factors).contiguous()), out_dtype


def check_descales_need_no_grad(descales, names, fn: str) -> None:
    """FP8 is forward only: no route computes a descale factor's gradient (the kernels read the factors as
    constants), so a factor that requires grad with grad mode on is an error, as ALiBi's slopes are, rather than a
    gradient on one backend and none on another."""
    if not torch.is_grad_enabled():
        return
    given = [name for name, d in zip(names, descales) if isinstance(d, Tensor) and d.requires_grad]
    if given:
        raise ValueError(f"{fn}: {', '.join(given)} must not require grad (FP8 attention is forward only: no backend "
                         "computes the descale factors' gradient); pass them detached (.detach()) or run under "
                         "torch.no_grad()")


def check_descale(d, name: str, batch: int, kv_heads: int, device: torch.device, fn: str,
                  heads: Optional[int] = None) -> None:
    """A descale factor: a float32 tensor ``(1,)`` (per tensor) or ``(batch, kv_heads)`` on ``device``; ``heads``:
    the query heads, for the hint where a factor per query head was given."""
    if not isinstance(d, Tensor):
        raise TypeError(f"{fn}: {name} must be a float32 torch.Tensor or None, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise TypeError(f"{fn}: {name} must have dtype float32, got {d.dtype}")
    if d.device != device:
        raise ValueError(f"{fn}: {name} must be on the inputs' device {device}, got {d.device}")
    if tuple(d.shape) not in ((1,), (batch, kv_heads)):
        hint = (f"; for grouped-query heads quantise q with quantize_fp8(q, per_head=True, kv_heads={kv_heads}) (one "
                "factor per key/value head, FlashAttention-3's convention)"
                if heads is not None and heads != kv_heads and tuple(d.shape) == (batch, heads) else "")
        raise ValueError(f"{fn}: {name} must have shape (1,) (per tensor) or ({batch}, {kv_heads}) (per batch row "
                         f"or sequence, and key/value head), got {tuple(d.shape)}{hint}")


def quantize_fp8(x: Tensor, per_head: bool = False, kv_heads: Optional[int] = None,
                 cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(x_fp8, descale)``: ``x (B, S, H, D)`` scaled into float8_e4m3fn's range (its largest magnitude to 448)
    and rounded, with the float32 factor that gives the values back, ``(1,)`` for the tensor or ``(B, H)`` with
    ``per_head``. ``kv_heads`` (with ``per_head``, for the queries of a grouped-query call, whose descale is per
    key/value head as FlashAttention-3's): one factor per group of ``H / kv_heads`` query heads, ``(B, kv_heads)``.

    A packed batch (``x (total, H, D)``, as :func:`longattn.flash_attention_varlen` takes it): ``per_head`` needs
    its ``cu_seqlens`` (``(batch + 1,)``) and gives one factor per (sequence, head or key/value head),
    ``(batch, H or kv_heads)``, the varlen functions' per-sequence descale; per tensor, ``(1,)``, needs none.

    A helper for callers that hold bfloat16/float16 tensors; an all-zero tensor, head or sequence gets factor 1.
    ``x`` must be finite (an ``inf`` or NaN has no finite factor): checked with one device-to-host copy.
    """
    fn = "quantize_fp8"
    per_head = check_flag(per_head, "per_head", fn)
    packed = _check_quantize_input(x, per_head, cu_seqlens, fn)
    heads = x.shape[-2]
    groups = _check_kv_heads(kv_heads, per_head, heads, fn) or heads
    top = torch.finfo(torch.float8_e4m3fn).max
    rows = len(cu_seqlens) - 1 if packed and per_head else x.shape[0]
    if x.numel() == 0:  # nothing to scale: factor 1
        amax = torch.zeros((rows, groups) if per_head else (1,), dtype=torch.float32, device=x.device)
    elif per_head:
        amax = _packed_amax(x, cu_seqlens, rows) if packed else x.abs().amax(dim=(1, 3))  # (rows, H)
        amax = amax.reshape(rows, groups, heads // groups).amax(dim=2)
    else:
        amax = x.abs().amax().reshape(1)
    # (in float64: float32's largest value rounds to inf in bfloat16; NaN compares False)
    if has_values(amax) and not bool((amax.double() <= torch.finfo(torch.float32).max).all()):
        if not bool(torch.isfinite(amax).all()):  # amax is inf or NaN where x is
            raise ValueError(f"{fn}: x has non-finite values (inf or NaN), which float8 cannot represent with a "
                             "finite scale; replace them (e.g. torch.nan_to_num) before quantising")
        raise ValueError(f"{fn}: x has values beyond float32's range ({float(amax.max()):.3g}; float64 inputs), "
                         "which the float32 factor cannot give back; scale x down first")
    amax = amax.float()
    quotient = amax / top  # (a subnormal maximum's quotient may round to 0: then, as for zeros, factor 1)
    descale = torch.where(quotient > 0, quotient, torch.ones_like(quotient))
    shaped = descale
    if per_head:
        shaped = descale.repeat_interleave(heads // groups, dim=1)  # (rows, H)
        shaped = shaped[_sequence_of_rows(cu_seqlens, x.shape[0])] if packed else shaped[:, None]
        shaped = shaped[..., None]
    return (x.float() / shaped).clamp(-top, top).to(torch.float8_e4m3fn), descale


def _check_float_input(x, name: str, fn: str) -> None:
    """``x`` a float16/bfloat16/float32/float64 tensor, batch-first ``(B, S, H, D)`` or packed ``(total, H, D)``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{fn}: {name} must have dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{fn}: {name} must have 4 dims (batch, seq, heads, head_dim), or 3 (total, heads, "
                         f"head_dim) for a packed batch, got {tuple(x.shape)}")


def _check_quantize_input(x, per_head: bool, cu_seqlens, fn: str) -> bool:
    """``x`` and ``cu_seqlens`` of :func:`quantize_fp8`; returns whether ``x`` is a packed batch ``(total, H, D)``."""
    _check_float_input(x, "x", fn)
    packed = x.dim() == 3
    if cu_seqlens is not None:
        if not packed:
            raise ValueError(f"{fn}: cu_seqlens goes with a packed x (total, heads, head_dim); x has shape "
                             f"{tuple(x.shape)}")
        check_cu_seqlens(cu_seqlens, x.shape[0], "cu_seqlens", fn, x.device)
    elif packed and per_head:
        raise ValueError(f"{fn}: a packed x (total, heads, head_dim) with per_head=True needs its cu_seqlens (one "
                         f"factor per sequence and head, as flash_attention_varlen's descales)")
    return packed


def _check_kv_heads(kv_heads, per_head: bool, heads: int, fn: str) -> Optional[int]:
    if kv_heads is None:
        return None
    if not per_head:
        raise ValueError(f"{fn}: kv_heads groups the per-head factors: pass per_head=True with it")
    if not _is_int(kv_heads) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{fn}: kv_heads must be a positive int dividing x's {heads} heads, got {kv_heads!r}")
    return int(kv_heads)


def _sequence_of_rows(cu_seqlens: Tensor, total: int) -> Tensor:
    """The sequence number (int64 ``(total,)``) of each row of a packed batch."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def _packed_amax(x: Tensor, cu_seqlens: Tensor, batch: int) -> Tensor:
    """The largest magnitude per (sequence, head) of a packed ``x (total, H, D)``: ``(batch, H)`` in x's dtype, 0
    for an empty sequence."""
    row_max = x.abs().amax(dim=2)  # (total, H)
    index = _sequence_of_rows(cu_seqlens, x.shape[0])[:, None].expand_as(row_max)
    return row_max.new_zeros(batch, x.shape[1]).scatter_reduce_(0, index, row_max, "amax")



def rotation(head_dim: int, seed: int = 0, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """A ``(head_dim, head_dim)`` orthogonal matrix ``R`` (``R @ R.T = I``) that spreads every coordinate over all
    of them: a Hadamard matrix (Sylvester's construction) over ``sqrt(head_dim)`` with its columns' signs drawn
    from ``seed`` where ``head_dim`` is a power of two, else the orthogonal factor of a seeded Gaussian matrix."""
    g = torch.Generator().manual_seed(int(seed))
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=g).double() * 2 - 1
        r = h * signs / head_dim ** 0.5
    else:
        a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
        qr, tri = torch.linalg.qr(a)
        r = qr * torch.sign(torch.diagonal(tri))
    return r.to(device=device, dtype=dtype)


def rotate_qk(q: Tensor, k: Tensor, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """``(q @ R, k @ R)`` for one orthogonal ``R`` (:func:`rotation`): the scores ``q k^T`` are unchanged, so
    attention over the rotated pair is attention over ``q`` and ``k`` (V is not touched), but an outlier channel of
    q or k (a head-dim coordinate much larger than the others, as language models' queries and keys have) is spread
    over every coordinate before :func:`quantize_fp8`, whose one factor per tensor or head is then not set by the
    outlier alone: FlashAttention-3's incoherent processing. q ``(..., Hq, D)`` and k ``(..., Hk, D)`` (batch-first
    or packed), float16, bfloat16, float32 or float64; returned in float32 (float64 for float64) for
    :func:`quantize_fp8`. The errors it saves and costs: docs/benchmarks.md ("FP8 with the queries and keys rotated")."""
    fn = "rotate_qk"
    _check_float_input(q, "q", fn)
    _check_float_input(k, "k", fn)
    if q.dim() != k.dim():
        raise ValueError(f"{fn}: q and k must both be batch-first (4 dims) or both packed (3 dims), got shapes "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if isinstance(seed, bool) or not _is_int(seed):
        raise TypeError(f"{fn}: seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -2 ** 63 <= int(seed) < 2 ** 64:
        raise ValueError(f"{fn}: seed must be an int in [-2**63, 2**64) (torch.Generator's seeds), got {seed}")
    if q.shape[-1] != k.shape[-1] or q.device != k.device:
        raise ValueError(f"{fn}: q and k must share head_dim and device, got {tuple(q.shape)} on {q.device} and "
                         f"{tuple(k.shape)} on {k.device}")
    if q.shape[-1] < 1:
        raise ValueError(f"{fn}: head_dim must be at least 1, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
    r = rotation(q.shape[-1], seed, q.device, dtype)
    return q.to(dtype) @ r, k.to(dtype) @ r
