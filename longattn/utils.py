"""Small public helpers around the attention functions: the ``cu_seqlens`` of a packed batch, padding and
unpadding (FlashAttention's ``bert_padding`` convention), which implementation ``backend="auto"`` picks, and a
step captured in a CUDA graph."""
from __future__ import annotations

from collections.abc import Mapping, Set as AbstractSet
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn import _validation as V

if TYPE_CHECKING:  # pragma: no cover
    from longattn.backends.plan import Plan

__all__ = ["cu_seqlens_of", "unpad_input", "pad_input", "auto_backend", "cuda_graph"]


def cu_seqlens_of(lengths: Union[Sequence[int], Tensor], device: Union[str, torch.device, None] = None) -> Tensor:
    """int32 ``cu_seqlens`` ``(batch + 1,)`` of sequences of ``lengths``: ``[0, l0, l0 + l1, ...]`` (the packed
    batch's boundaries, as :func:`longattn.flash_attention_varlen` takes them). ``lengths``: ints, or a 1-D integer
    tensor (``mask.sum(1)``; read on the host once, the result on ``device``, else on the tensor's). The total must
    stay below ``2**31`` (int32 row indices, as the varlen functions require)."""
    fn = "cu_seqlens_of"
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype.is_complex \
                or lengths.dtype == torch.bool:
            raise TypeError(f"{fn}: a tensor of lengths must be 1-D with an integer dtype, got shape "
                            f"{tuple(lengths.shape)} and dtype {lengths.dtype}")
        if not V.has_values(lengths):
            raise ValueError(f"{fn}: lengths is a {lengths.device.type} tensor without values; the boundaries are "
                             "computed on the host from the lengths' values: pass them as ints or a tensor that holds "
                             "them")
        device = lengths.device if device is None else device
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes, AbstractSet, Mapping)) or not hasattr(lengths, "__iter__"):
        # (a set has no order: its lengths would be laid out in whatever order it iterates)
        raise TypeError(f"{fn}: lengths must be a sequence of ints in the batch's order (a list, tuple or 1-D "
                        f"tensor), got {type(lengths).__name__}")
    bounds = [0]
    for n in lengths:
        if not V._is_int(n) or n < 0:
            raise ValueError(f"{fn}: lengths must be ints >= 0, got {n!r}")
        bounds.append(bounds[-1] + int(n))
        if bounds[-1] >= 2 ** 31:
            raise ValueError(f"{fn}: the lengths add up to {bounds[-1]} or more; a packed batch must total fewer "
                             f"than 2**31 rows (int32 cu_seqlens)")
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def unpad_input(x: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor, int]:
    """A padded batch ``x (B, L, ...)`` as a packed one: the rows where ``mask (B, L)`` (bool, or 0/1) is true,
    sequence after sequence (True keeps a row, as in transformers' ``attention_mask``; ``nn.MultiheadAttention``'s
    ``key_padding_mask`` is True at the padding: pass ``~key_padding_mask``). Returns ``(x_packed (total, ...),
    indices (total,), cu_seqlens (B + 1,) int32, max_seqlen)``; :func:`pad_input` puts the rows back. One host
    synchronisation (the lengths; two for a mask that is not bool, whose values are checked)."""
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise TypeError(f"unpad_input: x must be a torch.Tensor (batch, seq, ...), got "
                        f"{getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"unpad_input: mask must be a (batch, seq) tensor like x's first two dims "
                         f"{tuple(x.shape[:2])}, got {getattr(mask, 'shape', type(mask).__name__)}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("unpad_input: mask must be bool or hold only 0 and 1 (True/1 keeps a row, as transformers' "
                         "attention_mask); an additive mask (0 keeps, -inf pads) is the opposite: pass mask == 0")
    keep = mask.to(torch.bool)
    lengths = keep.sum(1, dtype=torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    indices = keep.reshape(-1).nonzero().squeeze(1)
    packed = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, indices)
    return packed, indices, cu, int(lengths.max()) if lengths.numel() else 0


def pad_input(x: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of :func:`unpad_input`: ``x (total, ...)`` back to ``(batch, seqlen, ...)``, zeros at the padded
    rows (differentiable). ``indices``: int64 ``(total,)``, distinct rows in ``[0, batch * seqlen)`` as
    :func:`unpad_input` returns them (their range and that they are distinct checked: one host synchronisation,
    none for meta or fake tensors)."""
    _check_pad_args(x, indices, batch, seqlen)
    out = x.new_zeros(batch * seqlen, *x.shape[1:]).index_copy(0, indices.long(), x)
    return out.reshape(batch, seqlen, *x.shape[1:])


def _check_pad_args(x: Tensor, indices: Tensor, batch: int, seqlen: int) -> None:
    """:func:`pad_input`'s arguments: TypeError / ValueError naming the argument and what is allowed."""
    fn = "pad_input"
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise TypeError(f"{fn}: x must be a torch.Tensor (total, ...), got {getattr(x, 'shape', type(x).__name__)}")
    for name, value in (("batch", batch), ("seqlen", seqlen)):
        if not V._is_int(value) or value < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0, got {value!r}")
    if not isinstance(indices, Tensor) or indices.dtype not in (torch.int64, torch.int32) or indices.dim() != 1:
        raise TypeError(f"{fn}: indices must be a 1-D int64 (or int32) tensor (unpad_input's indices), got "
                        f"{_describe(indices)}")
    if indices.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}: indices must hold one row per row of x ({x.shape[0]}), got {indices.shape[0]}")
    if indices.device != x.device:
        raise ValueError(f"{fn}: indices must be on x's device {x.device}, got {indices.device}")
    rows = batch * seqlen
    if indices.numel() > rows:
        raise ValueError(f"{fn}: x has {indices.numel()} rows, more than batch * seqlen = {rows}")
    if indices.numel() and V.has_values(indices):
        ordered = indices.sort().values  # (one host read below for the range and the repeats)
        repeats = (ordered[1:] == ordered[:-1]).sum().to(ordered.dtype)
        lo, hi, repeats = (int(t) for t in torch.stack([ordered[0], ordered[-1], repeats]).tolist())
        if lo < 0 or hi >= rows:
            raise ValueError(f"{fn}: indices must lie in [0, batch * seqlen) = [0, {rows}), got values in "
                             f"[{lo}, {hi}]")
        if repeats:
            raise ValueError(f"{fn}: indices must be distinct rows (unpad_input's indices), got {repeats} row(s) "
                             f"repeating an earlier index: two rows of x would be written to one output row")


def _describe(x) -> str:
    return f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def auto_backend(q: Tensor, k: Tensor, *, causal: bool = False, window: Tuple[int, int] = (-1, -1),
                 return_lse: bool = False, needs_grad: Optional[bool] = None, deterministic: bool = False,
                 v: Optional[Tensor] = None, return_plan: bool = False) -> Union[str, "Plan"]:
    """The implementation ``longattn.flash_attention(q, k, v, backend="auto", ...)`` runs for these inputs:
    ``"sdpa"`` (PyTorch's own kernel), ``"fa4"`` (FlashAttention-4, where installed), ``"triton"`` or ``"torch"``.
    ``needs_grad`` defaults to whether q, k (or ``v``, when given; ``k`` stands in for it otherwise) requires grad
    with grad mode on. ``deterministic``: the call's flag (also on under PyTorch's deterministic mode, as in
    ``flash_attention``): a call that needs gradients then never runs on SDPA.

    A thin wrapper over :func:`longattn.explain` of that call: ``return_plan=True`` returns the whole
    :class:`~longattn.backends.plan.Plan` instead of its ``backend`` (the backends not chosen and why; for Triton
    each pass's kernel, the Gluon forward or the Triton one, the fused backward or the two Triton passes, and
    their tiles). The arguments are checked as ``flash_attention`` checks them. It answers for a call without score
    modifications or FP8 inputs; for one with sinks, soft-capping, ALiBi or descales, ask
    ``longattn.explain(longattn.flash_attention, q, k, v, ...)`` with those arguments (they can change the
    answer: SDPA computes none of them)."""
    from longattn.functional import flash_attention
    from longattn.runner import explain

    deterministic = V.check_deterministic(deterministic, "auto_backend")
    return_plan = V.check_flag(return_plan, "return_plan", "auto_backend")
    if needs_grad is not None:
        needs_grad = V.check_flag(needs_grad, "needs_grad", "auto_backend")
    v = k if v is None else v
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    with torch.set_grad_enabled(bool(needs_grad)):
        if needs_grad and not any(x.requires_grad for x in (q, k, v)):
            q = q.detach().requires_grad_()  # (a view: what needs a gradient is all the plan reads)
        plan = explain(flash_attention, q, k, v, causal=causal, window=window, return_lse=return_lse,
                       deterministic=deterministic)
    return plan if return_plan else plan.backend


def cuda_graph(step: Callable[[], object], warmup: int = 3) -> Tuple["torch.cuda.CUDAGraph", object]:
    """``step`` (a callable of no arguments on CUDA tensors: a training step's forward and backward, say) captured
    in a CUDA graph after ``warmup`` runs on a side stream (which compile its kernels and record their launches):
    ``(graph, what the captured run returned)``. ``graph.replay()`` runs the step again on the tensors it captured:
    copy new values into its inputs first (``x.copy_(new)`` under ``torch.no_grad()``), and read the returned
    tensors after it. Short steps are bound by the host; a replay has no host cost but the launch of the graph.
    What a graph cannot hold raises PyTorch's capture error (a host read of a tensor's values, for one); a packed
    batch's ``cu_seqlens`` must keep their values while the graph is in use."""
    if not callable(step):
        raise TypeError(f"cuda_graph: step must be a callable of no arguments, got {type(step).__name__}")
    if type(warmup) is not int or warmup < 1:
        raise ValueError(f"cuda_graph: warmup must be an int >= 1 (the runs that compile the kernels before the "
                         f"capture), got {warmup!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_graph: CUDA graphs need a CUDA GPU, and none is available")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
