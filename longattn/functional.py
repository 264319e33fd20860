"""The public functional API: check the arguments, describe the call, run it (:mod:`longattn.runner`).

The semantics of each function are specified by the plain-PyTorch implementations in :mod:`longattn.reference`.
Each function checks its arguments, describes the call once (:class:`longattn.call.AttentionCall`) and hands it
to a backend: ``backend="torch"`` runs :mod:`longattn.backends.torch` (PyTorch operations, any device);
``backend="triton"`` runs the Triton kernels of :mod:`longattn.backends.triton` (CUDA GPUs, or the Triton
interpreter when ``TRITON_INTERPRET=1``); ``backend="auto"`` runs PyTorch's own SDPA for the calls it computes
exactly unless the dispatch table measured our kernels faster (see :mod:`longattn.backends.dispatch`), and
otherwise Triton when it can and PyTorch elsewhere. Zero-size calls (no batch, queries, query heads or keys)
return zeros (lse ``-inf``) that keep the autograd graph.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from longattn import _autocast, _fp8
from longattn import _validation as V
from longattn import runner
from longattn.backends import dispatch as _dispatch
from longattn.call import AttentionCall, BlockSparse, dilated_branches, flash_call

if TYPE_CHECKING:  # pragma: no cover
    from longattn.patterns.pattern import BlockSparsePattern

Window = Tuple[int, int]


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: Window = (-1, -1),
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    sinks: Optional[Tensor] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact softmax attention without materializing the attention matrix.

    Args:
        q: ``(B, N, Hq, D)`` queries (FlashAttention's layout; from PyTorch SDPA's or FlexAttention's
            ``(B, H, N, D)``, pass ``q.transpose(1, 2)``, and ``k``, ``v`` alike: the shapes cannot always tell the
            layouts apart, and self-attention in the other layout passes every check, attending across heads).
        k, v: ``(B, M, Hk, D)`` keys and values, ``Hq % Hk == 0``; query head ``h`` reads key/value head
            ``h // (Hq // Hk)`` (grouped-query attention).
        causal: query ``i`` may only see keys ``j <= i + M - N`` (bottom-right aligned, as FlashAttention 2.1+;
            SDPA's ``is_causal`` aligns top-left, the same mask only when ``N == M``).
        window: ``(left, right)``: query ``i`` sees keys ``i + M - N - left <= j <= i + M - N + right``;
            ``-1`` means unbounded on that side. Combined with ``causal`` (``right`` becomes at most 0).
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled scores, ``(B, Hq, N)``, float32 (float64 for
            float64 inputs).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        q_descale, k_descale, v_descale: for ``float8_e4m3fn`` q, k, v (forward only): float32 factors, ``(1,)``
            or ``(B, Hk)``, the true values being ``x.float() * descale`` (FlashAttention-3's convention; None is
            1). The Triton kernels multiply in FP8 on sm_89/sm_90 (the probabilities rounded to FP8 for the
            ``P V`` product); the PyTorch backend computes in float32 from the dequantised values.
        out_dtype: the output's dtype for FP8 inputs (bfloat16, the default, float16 or float32).
        sinks: attention sinks (gpt-oss), ``(Hq,)`` logits: each query's softmax denominator gains
            ``exp(sinks[h])``, with no value attached; differentiable. The log-sum-exp then counts it.
        softcap: logit soft-capping (Gemma 2): the scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)``;
            0 turns it off; other caps from 1e-30 to 1e30.
        alibi_slopes: float32 ``(Hq,)`` or ``(B, Hq)``: ``-slope * |i + M - N - j|`` is added to the (soft-capped)
            score of query ``i`` and key ``j`` (ALiBi). The order is soft-cap, ALiBi, then the causal/window mask,
            then the softmax with the sinks.
        deterministic: bitwise-identical gradients from run to run (FlashAttention's flag): the backward runs only
            kernels that sum in a fixed order. On Hopper that is the two Triton backward passes instead of the fused
            Gluon backward, whose float32 dQ sums arrive in whatever order its programs finish (the fused one
            measured 0.99-1.27x the speed of the two passes on an H200, docs/kernel_notes.md; the fused one with dQ
            added in a fixed order, ``longattn.routing(deterministic_bwd_head_dims=(64, 128))``, is bitwise
            reproducible too but measured slower than the two passes, so it is not the default); and ``"auto"`` runs
            a call that needs gradients on our kernels instead of PyTorch's SDPA, whose backward PyTorch does not
            document as deterministic (the two passes took 1.2-1.5x the time of SDPA's cuDNN backward in the same
            runs). The forward is unchanged, and so are calls that build no autograd graph. Also on while PyTorch's
            deterministic mode is (``torch.use_deterministic_algorithms(True)``, ``warn_only`` or not): a user who
            asked PyTorch for deterministic algorithms gets them here too.

    Returns:
        ``out`` of shape ``(B, N, Hq, D)`` and dtype of ``q`` (``out_dtype`` for FP8 inputs); with
        ``return_lse``, ``(out, lse)``. A query that sees no key outputs 0 and has log-sum-exp ``-inf`` (its sink's
        logit with ``sinks``).
    """
    fn = "flash_attention"
    plain = (q_descale is None and k_descale is None and v_descale is None and out_dtype is None and sinks is None
             and alibi_slopes is None and type(softcap) in (float, int) and softcap == 0)
    deterministic_mode = torch.are_deterministic_algorithms_enabled()  # (read once: the key and the call agree)
    known = (runner.known_key(fn, q, k, v, (causal, window, scale, return_lse, backend, deterministic),
                              deterministic_mode) if plain else None)
    if known is not None:
        found = runner.KNOWN.find(known)
        if found is not None:
            return _result(*runner.run_known(found, q, k, v), return_lse)
    q, k, v = _autocast.cast_inputs(q, k, v)
    causal = V.check_flag(causal, "causal", fn)
    return_lse = V.check_flag(return_lse, "return_lse", fn)
    V.check_attention_inputs(q, k, v, fn=fn, fp8=True)
    window = V.check_window(window)
    scale = V.check_scale(scale, q.shape[-1])
    V.check_backend(backend, fn)
    descale, out_dtype = _fp8.check(q, k, v, (q_descale, k_descale, v_descale), out_dtype, batch=q.shape[0], fn=fn)
    sinks = None if sinks is None else V.check_sinks(sinks, q.shape[2], q.device, fn=fn)
    softcap = V.check_softcap(softcap, fn=fn)
    alibi = None if alibi_slopes is None else V.check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device, fn=fn)
    deterministic = V.check_flag(deterministic, "deterministic", fn) or deterministic_mode  # (V.check_deterministic)
    call = flash_call(scale, causal, window, need_lse=return_lse)
    if descale is not None or sinks is not None or softcap or alibi is not None:
        call = replace(call, descale=descale, out_dtype=out_dtype, sinks=sinks, softcap=softcap, alibi=alibi)
    if deterministic:
        call = replace(call, deterministic=True)
    sdpa_call = None
    if backend == "auto":
        sdpa_call = _dispatch.sdpa_call(q, k, causal=causal, window=window, need_lse=return_lse,
                                        needs_grad=_needs_grad(q, k, v))
    return _result(*runner.run(q, k, v, call, backend=backend, fn=fn, sdpa=sdpa_call, known=known), return_lse)


def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    head_split: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    deterministic: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """LongNet dilated attention (self-attention, ``N == M``).

    Branch ``i`` cuts the sequence into segments of ``segment_lengths[i]`` positions (the last may be shorter); in
    the segment starting at ``s``, head ``h`` selects positions ``s + o, s + o + r, ...`` (``r = dilation_rates[i]``,
    offset ``o = h % r``) and attends among them (``causal``: only to keys at or before its own position).
    The branches are merged by the softmax of their log-sum-exps (the softmax-denominator merge): this is one
    softmax over all the (query, key) pairs the branches compute, a key that ``c`` branches give the query counting
    ``c`` times (as if its score were raised by ``log c``); with branches that share no pair it is softmax attention
    over the union of their keys. A query no branch selects outputs 0.
    With ``head_split=True`` the heads are cut into ``len(segment_lengths)`` contiguous groups (the first
    ``H % k`` one head larger) and group ``i`` runs only branch ``i``, with offset ``i % r_i``.

    Args:
        q: ``(B, N, Hq, D)``; k, v: ``(B, N, Hk, D)`` with ``Hq % Hk == 0``.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs (forward only), as in
            :func:`flash_attention`.
        deterministic: bitwise-identical gradients from run to run, as in :func:`flash_attention` (also on under
            PyTorch's deterministic mode). Dilated attention's backward (the two Triton passes, the branches added
            one after another; or PyTorch's operations) sums in a fixed order already, so this costs nothing today.

    Returns:
        ``(B, N, Hq, D)``; with ``return_lse`` also the merged log-sum-exp ``(B, Hq, N)``, float32 (float64 for
        float64 inputs).
    """
    fn = "dilated_attention"
    q, k, v = _autocast.cast_inputs(q, k, v)
    causal = V.check_flag(causal, "causal", fn)
    head_split = V.check_flag(head_split, "head_split", fn)
    return_lse = V.check_flag(return_lse, "return_lse", fn)
    V.check_attention_inputs(q, k, v, fn=fn, self_attention=True, fp8=True)
    segment_lengths, dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates)
    scale = V.check_scale(scale, q.shape[-1])
    V.check_backend(backend, fn)
    descale, out_dtype = _fp8.check(q, k, v, (q_descale, k_descale, v_descale), out_dtype, batch=q.shape[0], fn=fn)
    deterministic = V.check_deterministic(deterministic, fn)
    branches = dilated_branches(q.shape[1], q.shape[2], segment_lengths, dilation_rates, head_split, fn=fn)
    call = AttentionCall(scale=scale, causal=causal, branches=branches, descale=descale, out_dtype=out_dtype,
                         deterministic=deterministic)
    return _result(*runner.run(q, k, v, call, backend=backend, fn=fn), return_lse)


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_mask: Union[Tensor, "BlockSparsePattern"],
    block_size: Union[int, Tuple[int, int], None] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention restricted to the allowed block pairs of ``block_mask``.

    Args:
        q: ``(B, N, Hq, D)``; k, v: ``(B, M, Hk, D)`` with ``Hq % Hk == 0``.
        block_mask: bool ``(B or 1, Hq or 1, ceil(N / block_q), ceil(M / block_k))``: query block ``a`` may attend
            to key block ``b`` only where it is True; every pair inside an allowed block pair attends. Or a
            :class:`longattn.patterns.BlockSparsePattern` (a mask with its block size), whose conversion to the
            kernels' block lists is cached: pass a pattern when the same mask serves many calls (layers, steps),
            as a raw tensor is converted again on every call.
        block_size: ``block_q = block_k = block_size``, or a pair ``(block_q, block_k)``; default 128 for a
            tensor mask, the pattern's own for a pattern (a different value is an error).
        causal: bottom-right aligned causal mask applied on top of the block mask.
        deterministic: bitwise-identical gradients from run to run, as in :func:`flash_attention` (also on under
            PyTorch's deterministic mode). The block-list kernels' backward sums in a fixed order already; a
            pattern that allows every block pair runs as dense attention, whose fused Hopper backward this turns
            off (the cost given there).

    Returns:
        ``(B, N, Hq, D)``; with ``return_lse`` also the log-sum-exp ``(B, Hq, N)``, float32 (float64 for float64
        inputs). Queries with no allowed key output 0.
    """
    from longattn.patterns.pattern import BlockSparsePattern

    fn = "block_sparse_attention"
    q, k, v = _autocast.cast_inputs(q, k, v)
    causal = V.check_flag(causal, "causal", fn)
    return_lse = V.check_flag(return_lse, "return_lse", fn)
    deterministic = V.check_deterministic(deterministic, fn)
    V.check_attention_inputs(q, k, v, fn=fn)
    V.check_backend(backend, fn)
    given_pattern = isinstance(block_mask, BlockSparsePattern)
    if given_pattern:
        pattern = block_mask
        if block_size is not None and V.check_block_size(block_size, fn) != pattern.block_size:
            raise ValueError(f"{fn}: block_size={block_size!r} differs from the pattern's block size "
                             f"{pattern.block_size}; leave block_size out when passing a BlockSparsePattern")
        if pattern.seq_lens is not None and any(isinstance(x, torch.SymInt) for x in q.shape[1:2] + k.shape[1:2]):
            raise ValueError(f"{fn}: the pattern was built for (N, M) = {pattern.seq_lens}, which torch.export "
                             f"cannot keep dynamic; build the pattern without seq_lens, or export with a static length")
        if pattern.seq_lens is not None and pattern.seq_lens != (q.shape[1], k.shape[1]):
            raise ValueError(f"{fn}: the pattern was built for (N, M) = {pattern.seq_lens}, got N={q.shape[1]}, "
                             f"M={k.shape[1]}")
        V.check_block_mask(pattern.mask, q, k, pattern.block_size, fn=fn)
        fitted = V.fit_block_size(pattern.block_size, q.shape[1], k.shape[1])
        if fitted != pattern.block_size:  # a block longer than its sequence is the sequence, as for a raw mask
            pattern, given_pattern = BlockSparsePattern(pattern.mask, fitted), False  # (lists made for this call)
    else:  # a raw mask becomes a pattern: checked here, converted on every call (no cache outlives the call)
        block_size = V.check_block_mask(block_mask, q, k, 128 if block_size is None else block_size, fn=fn,
                                        raw=True)
        pattern = BlockSparsePattern(block_mask, V.fit_block_size(block_size, q.shape[1], k.shape[1]))
    scale = V.check_scale(scale, q.shape[-1])
    pattern = pattern.to(q.device)
    call = AttentionCall(scale=scale, causal=causal, blocks=BlockSparse(pattern.mask, pattern.block_size),
                         deterministic=deterministic)
    backward = given_pattern or _needs_grad(q, k, v)

    def kernel_form(impl: str, call: AttentionCall) -> AttentionCall:
        return _triton_blocks(call, pattern, given_pattern, backward, q, k) if impl == "triton" else call

    return _result(*runner.run(q, k, v, call, backend=backend, fn=fn, prepare=kernel_form), return_lse)


def _triton_blocks(call: AttentionCall, pattern: "BlockSparsePattern", given_pattern: bool, backward: bool,
                   q: Tensor, k: Tensor) -> AttentionCall:
    """A block-sparse call in the Triton kernels' form: the block lists (converted once per device, causal and
    lengths, then cached by the pattern; the transposed lists only for a call that may run its backward), or,
    for a given pattern that allows every block pair, a dense (or causal) call on the range loops of the dense
    kernels, which pipeline better than the list loops' indirect loads (asked of patterns only: it needs a host
    sync, which the pattern pays once)."""
    if given_pattern and pattern._dense_kernels():
        return replace(call, blocks=None)  # (deterministic kept)
    lists = pattern._block_lists(q.device, call.causal, (q.shape[1], k.shape[1]), backward)  # (checked: to)
    return replace(call, blocks=BlockSparse(pattern.mask, pattern.block_size, lists))


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _result(out: Tensor, lse: Tensor, return_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    return (out, lse) if return_lse else out
