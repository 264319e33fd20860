"""Argument checks shared by the public API, the reference and the backends.

Each raises ``TypeError`` (wrong kind of object) or ``ValueError`` (wrong value) with a message that names the
function, the argument and what is allowed. Where ``fn`` (the function named in messages) is optional and not
given, it is the name of the calling function (for example ``flash_attention`` or ``attention_forward``).
"""
from __future__ import annotations

import math
import sys
import warnings
from numbers import Integral, Real
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from longattn._flags import _is_numpy_bool, check_flag  # noqa: F401 (the API's flag check, here with the others)
from longattn._memo import per_tensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what the API accepts (any backend)
FP8_DTYPES = (torch.float8_e4m3fn,)  # forward only, with descale factors (longattn._fp8)
MAX_HEAD_DIM = 256
BACKENDS = ("auto", "triton", "torch", "fa4")  # "fa4": FlashAttention-4, where installed (backends/fa4.py)
_WITH_FP8 = DTYPES + FP8_DTYPES


def has_values(t: Tensor) -> bool:
    """Whether ``t``'s values can be read: not a meta tensor, nor a fake one (``torch.compile``'s tracing, where
    dynamo breaks the graph to read them: a caller that must trace without a break asks
    ``torch.compiler.is_compiling()`` first)."""
    return t.device.type != "meta" and not is_fake(t)


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_deterministic(deterministic, fn: str) -> bool:
    """The ``deterministic`` flag (:func:`check_flag`), on as well while PyTorch's deterministic mode is
    (``torch.use_deterministic_algorithms(True)``, with ``warn_only`` or not)."""
    return check_flag(deterministic, "deterministic", fn) or torch.are_deterministic_algorithms_enabled()


def check_backend(backend, fn: str) -> str:
    """One of :data:`BACKENDS`."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _caller(fn: Optional[str]) -> str:
    """``fn``, or else the name of the function that called the check (only looked up when a check fails)."""
    if fn is not None:
        return fn
    name = sys._getframe(2).f_code.co_name
    return name if name.isidentifier() else "longattn"


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, *, fn: str, self_attention: bool = False,
                           names: Tuple[str, str, str] = ("q", "k", "v"), fp8: bool = False,
                           layout_hint: bool = True) -> None:
    """q ``(B, N, Hq, D)``, k and v ``(B, M, Hk, D)``, same dtype and device, ``Hq % Hk == 0``; errors call the
    tensors by ``names`` (a KV cache's checks name ``k_cache`` and ``v_cache``). ``fp8``: the function also takes
    float8_e4m3fn inputs (all three). ``layout_hint``: a head-count error also says how to pass tensors in SDPA's
    ``(B, H, N, D)`` layout where that layout would fit them (off for packed inputs, which have no such layout).
    Tensors in that layout whose shapes pass these checks as ``(B, N, H, D)`` (self-attention among them) cannot be
    told apart here."""
    qn, kn, vn = names
    allowed = _WITH_FP8 if fp8 else DTYPES
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"{fn}: {name} is a nested tensor, which this function does not take; pack the sequences "
                            "into one (total, heads, head_dim) tensor and call flash_attention_varlen with their "
                            "cu_seqlens (FlashAttention's varlen convention)")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have 4 dims (batch, seq, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in allowed:
            allowed_names = "float16, bfloat16, float32, float64" + (", float8_e4m3fn" if fp8 else "")
            raise TypeError(f"{fn}: {name} has dtype {t.dtype}; allowed: {allowed_names}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{fn}: {qn}, {kn}, {vn} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{fn}: {qn}, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: {kn} and {vn} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, n, hq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"{fn}: batch sizes differ: {qn} has {b}, {kn} and {vn} have {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"{fn}: head_dim differs: {qn} has {d}, {kn} and {vn} have {k.shape[3]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head_dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    hk = k.shape[2]
    if (hk == 0 and hq != 0) or (hk != 0 and hq % hk != 0):
        raise ValueError(f"{fn}: the number of query heads ({hq}, {qn}) must be a multiple of the number of "
                         f"key/value heads ({hk}, {kn} and {vn})" + _layout_hint(q, k, self_attention, layout_hint))
    if layout_hint and hq >= SDPA_LAYOUT_HEADS and n < hq and _layout_hint(q, k, self_attention, True):
        warnings.warn(f"{fn}: {qn} {tuple(q.shape)} has {hq} heads over {n} positions, which is how tensors in "
                      "PyTorch SDPA's or FlexAttention's (batch, heads, seq, head_dim) layout read as FlashAttention's "
                      "(batch, seq, heads, head_dim): attention then runs across heads, not positions. If so, pass "
                      f"{qn}.transpose(1, 2) (and {kn}, {vn}) and transpose the output back", stacklevel=3)
    if self_attention and k.shape[1] != n:
        # The hint only where SDPA's reading has no more heads than rows (q (1, 4096, 8, 64) with k (1, 2048, 8, 64)
        # would also fit SDPA's layout read as ours, as 4096 heads over 2048, but is a genuine N != M).
        raise ValueError(f"{fn}: self-attention needs k and v as long as q (N == M), got N={n}, M={k.shape[1]}"
                         + (_layout_hint(q, k, self_attention, layout_hint) if n <= hq else ""))


# At least this many query heads over fewer positions: the shape of a call whose tensors are in SDPA's layout (its
# sequence read as heads); no model we know has as many heads, so such a call gets a warning.
SDPA_LAYOUT_HEADS = 512
SDPA_LAYOUT_HINT = ("; the tensors are (batch, seq, heads, head_dim), FlashAttention's layout: tensors in PyTorch "
                    "SDPA's or FlexAttention's (batch, heads, seq, head_dim) need .transpose(1, 2)")


def _layout_hint(q: Tensor, k: Tensor, self_attention: bool, wanted: bool) -> str:
    """:data:`SDPA_LAYOUT_HINT` where q and k with their dims 1 and 2 swapped (SDPA's layout read as ours) would
    pass the head-count and self-attention checks, else ``""``."""
    heads_q, heads_k = q.shape[1], k.shape[1]  # (what SDPA's layout has there)
    fits = heads_k > 0 and heads_q % heads_k == 0 and (not self_attention or q.shape[2] == k.shape[2])
    return SDPA_LAYOUT_HINT if wanted and fits else ""


# A window side at least this wide reaches past any sequence that fits in memory: it is taken as unbounded (-1), the
# same attention, and no index arithmetic overflows int64 with it.
_UNBOUNDED_WINDOW = 2 ** 62


def check_window(window, fn: Optional[str] = None) -> Tuple[int, int]:
    """``(left, right)``, each an int >= -1 (-1: unbounded; a side of ``2**62`` or more counts as unbounded)."""
    if type(window) is tuple and len(window) == 2:  # (the common case, checked cheaply: the same answer)
        left, right = window
        if (type(left) is int and type(right) is int and -1 <= left < _UNBOUNDED_WINDOW
                and -1 <= right < _UNBOUNDED_WINDOW):
            return window
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{_caller(fn)}: window must be a pair (left, right) of ints, got {window!r}")
    left, right = window
    for side, x in (("left", left), ("right", right)):
        if not _is_int(x):  # (FlashAttention-4's None for an unbounded side is refused by name: -1 here)
            raise TypeError(f"{_caller(fn)}: window {side} must be an int >= 0, or -1 for unbounded "
                            f"(FlashAttention 2's convention), got {x!r}"
                            + ("; FlashAttention-4's None (unbounded) is -1 here" if x is None else ""))
        if x < -1:
            raise ValueError(f"{_caller(fn)}: window {side} must be >= 0, or -1 for unbounded; got {x}")
    return tuple(-1 if int(x) >= _UNBOUNDED_WINDOW else int(x) for x in (left, right))


def check_scale(scale, head_dim: int, fn: Optional[str] = None) -> float:
    """``None`` gives ``head_dim ** -0.5``; otherwise a positive finite number (at most float32's largest)."""
    if scale is None:
        return float(head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"{_caller(fn)}: scale must be a number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{_caller(fn)}: scale must be positive and finite, got {scale}")
    if scale > _FLOAT32_MAX:  # (the kernels and float32 inputs compute in float32: it would be inf there)
        raise ValueError(f"{_caller(fn)}: scale must be at most float32's largest value {_FLOAT32_MAX:.4g}, got "
                         f"{scale}")
    return scale


_FLOAT32_MAX = torch.finfo(torch.float32).max


# Soft-capping's caps besides 0: the kernels compute cap * log2(e) and 2 / cap in float32, and a backward through
# autograd (the PyTorch backend's) multiplies the scores' gradients by the cap: beyond these bounds that overflows or
# underflows (NaN outputs near float32's limits, NaN gradients from 1.7e38), while a cap above 1e30 changes no
# score below 1e26 by float32's rounding and one below 1e-30 makes every score +-cap.
SOFTCAP_RANGE = (1e-30, 1e30)


def check_softcap(softcap, fn: Optional[str] = None) -> float:
    """Logit soft-capping: 0 (off) or a number within :data:`SOFTCAP_RANGE`; returns it as a float."""
    if type(softcap) is float and (softcap == 0.0 or SOFTCAP_RANGE[0] <= softcap <= SOFTCAP_RANGE[1]):
        return softcap  # (the common case, checked cheaply)
    if isinstance(softcap, bool) or not isinstance(softcap, Real):
        raise TypeError(f"{_caller(fn)}: softcap must be a number >= 0 (0: off), got {type(softcap).__name__}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{_caller(fn)}: softcap must be finite and >= 0 (0: off), got {softcap}")
    if softcap != 0.0 and not SOFTCAP_RANGE[0] <= softcap <= SOFTCAP_RANGE[1]:
        raise ValueError(f"{_caller(fn)}: softcap must be 0 (off) or between {SOFTCAP_RANGE[0]:g} and "
                         f"{SOFTCAP_RANGE[1]:g} (float32 arithmetic overflows beyond: NaN outputs or gradients; a "
                         f"larger cap changes no score, pass 0), got {softcap}")
    return softcap


def check_alibi(slopes, batch: int, n_heads: int, device: torch.device, fn: Optional[str] = None) -> Optional[Tensor]:
    """ALiBi slopes: None, or a float32 tensor ``(Hq,)`` or ``(batch, Hq)`` on the inputs' device, which needs no
    gradient (as in FlashAttention, the slopes are constants: no backend computes their gradient); returned as
    ``(batch, Hq)`` (a view for ``(Hq,)``: it shares the version counter of the caller's tensor, so that a backward
    after the slopes changed in place is refused)."""
    if slopes is None:
        return None
    if not isinstance(slopes, Tensor):
        raise TypeError(f"{_caller(fn)}: alibi_slopes must be a float32 torch.Tensor or None, got "
                        f"{type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"{_caller(fn)}: alibi_slopes must have dtype float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((n_heads,), (batch, n_heads)):
        raise ValueError(f"{_caller(fn)}: alibi_slopes must have shape (Hq,) = ({n_heads},) or (batch, Hq) = "
                         f"({batch}, {n_heads}), got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"{_caller(fn)}: alibi_slopes must be on the inputs' device {device}, got {slopes.device}")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{_caller(fn)}: alibi_slopes must not require a gradient (the slopes are constants: no "
                         f"backend computes their gradient); pass alibi_slopes.detach()")
    return slopes.expand(batch, n_heads)


def check_sinks(sinks, n_heads: int, device: torch.device, fn: Optional[str] = None) -> Optional[Tensor]:
    """Attention sinks: None, or a floating-point tensor ``(Hq,)`` of logits on the inputs' device. Values are not
    read (that would be a host sync a call): a non-finite logit follows IEEE arithmetic on every route, as in the
    reference (``-inf``: no sink; a NaN: NaN outputs and log-sum-exp for its head)."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{_caller(fn)}: sinks must be a torch.Tensor (Hq,) of logits or None, got "
                        f"{type(sinks).__name__}")
    if not sinks.dtype.is_floating_point or sinks.dtype in FP8_DTYPES:
        raise TypeError(f"{_caller(fn)}: sinks must have a floating dtype (float32, bfloat16, float16, float64), got "
                        f"{sinks.dtype}")
    if tuple(sinks.shape) != (n_heads,):
        raise ValueError(f"{_caller(fn)}: sinks must have shape (Hq,) = ({n_heads},), one logit per query head, got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"{_caller(fn)}: sinks must be on the inputs' device {device}, got {sinks.device}")
    return sinks


def check_dilated_args(segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                       fn: Optional[str] = None) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Two sequences of the same nonzero length, of ints >= 1 (bools are rejected)."""
    fn = fn if fn is not None else "dilated_attention"
    for name, seq in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise TypeError(f"{fn}: {name} must be a sequence of ints, got {seq!r}")
        if len(seq) == 0:
            raise ValueError(f"{fn}: {name} must not be empty")
        for x in seq:
            if not _is_int(x):
                raise TypeError(f"{fn}: {name} must hold ints, got {x!r}")
            if x < 1:
                raise ValueError(f"{fn}: {name} must hold ints >= 1, got {x}")
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(f"{fn}: segment_lengths and dilation_rates must have the same length, got "
                         f"{len(segment_lengths)} and {len(dilation_rates)}")
    return tuple(int(x) for x in segment_lengths), tuple(int(x) for x in dilation_rates)


def check_block_size(block_size: Union[int, Tuple[int, int]], fn: str = "block_sparse_attention") -> Tuple[int, int]:
    """An int or a pair of positive ints ``(block_q, block_k)``."""
    if _is_int(block_size):
        pair = (int(block_size), int(block_size))
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(_is_int(x) for x in block_size):
        pair = (int(block_size[0]), int(block_size[1]))
    else:
        raise TypeError(f"{fn}: block_size must be an int or a pair of ints (block_q, block_k), got {block_size!r}")
    if min(pair) < 1:
        raise ValueError(f"{fn}: block_size must be positive, got {block_size!r}")
    return pair


def fit_block_size(block_size: Tuple[int, int], n: int, m: int) -> Tuple[int, int]:
    """``(block_q, block_k)`` with a block longer than its sequence cut to the smallest power of two >= 16 that
    covers it: the same single block (the same mask, the same answer), a size the Triton kernels take if the given
    one was (a power of two >= 16), and nothing sized by an absurd block (``block_size=10**12``) downstream."""
    def fit(b: int, length: int) -> int:
        if b <= 16 or b <= length:  # (first: a length that torch.export keeps symbolic has no bit_length)
            return b
        return min(b, max(16, 1 << max(length - 1, 0).bit_length()))

    return fit(block_size[0], n), fit(block_size[1], m)


def check_dynamic_grid(block_mask: Tensor, lengths: Tuple[int, int], block_size: Tuple[int, int], fn: str) -> None:
    """A length that ``torch.export`` keeps symbolic (a ``Dim``) must stay within ``block_mask``'s fixed block grid
    for every value of its range: a ``ValueError`` naming the lengths allowed otherwise (PyTorch would specialize
    the length to the example's, or fail on a guard)."""
    for name, length, blocks, size in zip(("N", "M"), lengths, block_mask.shape[-2:], block_size):
        if not isinstance(length, torch.SymInt):
            continue
        from torch.fx.experimental.symbolic_shapes import statically_known_true  # (loaded with any SymInt)

        if not statically_known_true(-(-length // size) == blocks):
            raise ValueError(f"{fn}: under torch.export with a dynamic sequence length, block_mask's grid fixes "
                             f"{name} to {(blocks - 1) * size + 1}..{blocks * size} ({blocks} blocks of {size}); "
                             f"give the length's Dim that range (min and max), or export with a static length")


def _grid_hint(grid: Tuple[int, int], lengths: Tuple[int, int], block_size: Tuple[int, int]) -> str:
    """For a block mask whose last two dims are not the grid of ``block_size`` over ``lengths``: the block size
    whose grid they are, where one is (block_size defaults to 128 where a function takes a raw mask)."""
    if grid == tuple(-(-x // b) for x, b in zip(lengths, block_size)) or min(grid) < 1:
        return ""
    fits = tuple(-(-x // g) for x, g in zip(lengths, grid))  # (the smallest blocks that cover each length in g)
    if tuple(-(-x // b) for x, b in zip(lengths, fits)) != grid:
        return ""
    return (f" (a {grid[0]} x {grid[1]} grid is that of block_size={fits if fits[0] != fits[1] else fits[0]}; "
            "pass the block_size the mask was built with, the default being 128)")


def check_block_mask(block_mask: Tensor, q: Tensor, k: Tensor, block_size,
                     fn: Optional[str] = None, raw: bool = False) -> Tuple[int, int]:
    """Bool ``(B or 1, Hq or 1, ceil(N / block_q), ceil(M / block_k))``; returns ``(block_q, block_k)``. ``raw``: a
    mask the caller passed with its own ``block_size`` (or the default 128): a grid of another block size says which
    one."""
    fn = fn if fn is not None else "block_sparse_attention"
    bq, bk = check_block_size(block_size, fn)
    if not isinstance(block_mask, Tensor):
        raise TypeError(f"{fn}: block_mask must be a bool torch.Tensor, got {type(block_mask).__name__}")
    if block_mask.dtype != torch.bool:
        raise TypeError(f"{fn}: block_mask must have dtype torch.bool, got {block_mask.dtype}")
    if block_mask.device.type == "meta" and q.device.type != "meta":  # (all on meta: shapes only, allowed)
        raise ValueError(f"{fn}: block_mask is on the meta device, which holds no values; pass a bool mask with "
                         f"its values (on the inputs' device)")
    b, n, hq, _ = q.shape
    m = k.shape[1]
    want = (-(-n // bq), -(-m // bk))
    if block_mask.dim() != 4:
        raise ValueError(f"{fn}: block_mask must have 4 dims (B or 1, Hq or 1, {want[0]}, {want[1]}), got shape "
                         f"{tuple(block_mask.shape)}")
    mb, mh, mq, mk = block_mask.shape
    check_dynamic_grid(block_mask, (n, m), (bq, bk), fn)
    if mb not in (1, b) or mh not in (1, hq) or (mq, mk) != want:
        batch, heads = (str(x) if x == 1 else f"{x} or 1" for x in (b, hq))
        swapped = (mq, mk) == (-(-hq // bq), -(-k.shape[2] // bk)) and mh in (1, n)  # (q, k given as (B, H, N, D))
        raise ValueError(f"{fn}: block_mask must have shape ({batch}, {heads}, {want[0]}, {want[1]}) for "
                         f"N={n}, M={m}, block_size=({bq}, {bk}); got {tuple(block_mask.shape)}"
                         + (SDPA_LAYOUT_HINT if swapped else _grid_hint((mq, mk), (n, m), (bq, bk)) if raw else ""))
    return bq, bk


def check_packed_inputs(q: Tensor, k: Tensor, v: Tensor, *, fn: str, fp8: bool = False) -> None:
    """Packed variable-length inputs: q ``(total_q, Hq, D)``, k and v ``(total_k, Hk, D)``; otherwise as
    :func:`check_attention_inputs`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"{fn}: {name} is a nested tensor; pass the packed (total, heads, head_dim) tensor and "
                            "its cu_seqlens (of a jagged nested tensor: values() and offsets(), as int32)")
        if t.dim() != 3:
            raise ValueError(f"{fn}: {name} must have 3 dims (total, heads, head_dim) for packed sequences, got "
                             f"shape {tuple(t.shape)}")
    if k.shape != v.shape:  # (here, with the shapes as given: the check below sees batch-of-one views)
        raise ValueError(f"{fn}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_attention_inputs(q[None], k[None], v[None], fn=fn, fp8=fp8, layout_hint=False)


def check_varlen_args(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q, cu_seqlens_k, *,
                      fn: str, fp8: bool = False) -> Tuple[List[int], List[int]]:
    """Packed inputs and their ``cu_seqlens`` (:func:`check_packed_inputs`, :func:`check_cu_seqlens`), both
    describing the same number of sequences; returns the two boundary lists."""
    check_packed_inputs(q, k, v, fn=fn, fp8=fp8)
    cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q", fn, q.device)
    cu_k = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k", fn, q.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{len(cu_q) - 1} and {len(cu_k) - 1}")
    return cu_q, cu_k


@per_tensor(size=64)
def _host_list(t: Tensor) -> List[int]:
    return t.tolist()


def host_values(t: Tensor) -> List[int]:
    """``t.tolist()``: read on every call for a CPU tensor; copied from the device once per tensor object and
    version counter for a CUDA one, unless :func:`longattn.remember_host_reads` turned that off
    (:mod:`longattn._memo`)."""
    if t.device.type == "cpu":  # free to read: never remembered (a NumPy array may share its memory)
        return t.tolist()
    return list(_host_list(t))


def check_cu_seqlens(cu_seqlens, total: int, name: str, fn: str, device: Optional[torch.device] = None) -> List[int]:
    """``cu_seqlens``: a 1-D int32 or int64 tensor ``(batch + 1,)`` on ``device`` (the inputs'), starting at 0,
    non-decreasing, ending at ``total`` (the packed length). Returns its values as a list (:func:`host_values`:
    see there when a CUDA tensor's values are read again)."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{fn}: {name} must have shape (batch + 1,), got {tuple(cu_seqlens.shape)}")
    if device is not None and cu_seqlens.device != device:
        raise ValueError(f"{fn}: {name} must be on the inputs' device {device}, got {cu_seqlens.device}")
    if total >= 2 ** 31:
        raise ValueError(f"{fn}: packed length {total} too long: {name} holds int32 row indices (< 2**31)")
    if not has_values(cu_seqlens):
        raise ValueError(f"{fn}: {name} is a {'meta' if cu_seqlens.device.type == 'meta' else 'fake'} tensor, "
                         "without values; a packed batch's boundaries decide how it is computed, so they must hold "
                         "values (meta and fake inputs work for the other attention functions)")
    values = host_values(cu_seqlens)
    if values[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{fn}: {name} must be non-decreasing (sequence b is rows cu[b]:cu[b+1]), got {values}")
    if values[-1] != total:
        raise ValueError(f"{fn}: {name} must end at the packed length {total}, got {values[-1]}")
    return values


def tensor_key(x: Optional[torch.Tensor]) -> tuple:
    """What checks of shapes and Triton's specialisation read of a tensor: shape, strides, dtype, device and
    whether its data pointer is 16-byte aligned (``()`` for None; a fake tensor's, which has no memory to point
    at, is taken as aligned, as a meta tensor's address 0 is). Calls whose tensors have equal keys pass the same
    checks and launch the same compiled kernels."""
    if x is None:
        return ()
    return (x.shape, x.stride(), x.dtype, x.device, aligned16(x))


def aligned16(x: torch.Tensor) -> bool:
    """Whether ``x``'s data pointer is 16-byte aligned; True for a fake tensor (``FakeTensorMode``, ``torch.compile``'s
    tracing), which has no memory to point at (as a meta tensor's address 0 is aligned) and whose data pointer
    PyTorch warns against reading."""
    return x.data_ptr() % 16 == 0 if type(x) is torch.Tensor or has_values(x) else True
