"""Backend selection: which implementation runs a call. It only orders the candidates; each backend says why it
cannot run a call (:func:`longattn.backends.sdpa.unsupported_reason`,
:func:`longattn.backends.triton.support.unsupported_reason`), and the device facts live in
:mod:`longattn.backends.device`.

``"torch"`` always works. ``"triton"`` needs a CUDA GPU of compute capability 8.0 or newer (or the Triton
interpreter, ``TRITON_INTERPRET=1``, with CPU tensors) and inputs the kernels support; otherwise it raises.
``"auto"``: where FlashAttention-4 is installed and computes the call, the fastest of SDPA's default, FA4 and our
kernels that the dispatch table measured for that kind of call (:func:`longattn.backends.auto_table.order_with_fa4`;
no entry: as without FA4). Otherwise, for a call PyTorch's ``scaled_dot_product_attention`` computes exactly, SDPA's
default kernel unless the dispatch table (:mod:`longattn.backends.auto_table`) measured ours faster for that kind of
call on that device;
for any other call, Triton for CUDA tensors the kernels support and PyTorch otherwise, warning once per reason
when a CUDA input falls back. A deterministic call that needs gradients never runs SDPA: PyTorch does not document
SDPA's backward as deterministic (its flash and memory-efficient backwards are deterministic only under
``torch.use_deterministic_algorithms(True)`` without ``warn_only``, which also excludes cuDNN attention from
SDPA's choice: PyTorch's source, not its documentation), and one call cannot ask it for a deterministic backward.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Tuple

import torch

from longattn._validation import check_backend
from longattn.backends import auto_table, sdpa
from longattn.backends.triton import support as triton_support

_warned: set = set()


class SdpaCall(NamedTuple):
    """A call SDPA can compute exactly (see :func:`longattn.backends.sdpa.unsupported_reason`), described for the
    dispatch table."""

    causal: bool
    grouped: bool  # Hq != Hk
    needs_grad: bool  # the call builds an autograd graph (the table's fwd_bwd pass)


def sdpa_call(q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: Tuple[int, int], need_lse: bool,
              needs_grad: bool) -> Optional[SdpaCall]:
    """The :class:`SdpaCall` of a ``flash_attention`` call, or None when SDPA cannot compute it exactly."""
    if sdpa.unsupported_reason(q, k, causal=causal, window=window, need_lse=need_lse) is not None:
        return None
    return SdpaCall(causal, q.shape[2] != k.shape[2], needs_grad)


class Fa4Call(NamedTuple):
    """A call FlashAttention-4 computes exactly (:func:`longattn.backends.fa4.unsupported_reason` says None),
    described for the dispatch table: its kind (:func:`longattn.backends.fa4.kind_of`), the keys of its longest
    sequence, and whether it builds an autograd graph."""

    kind: str
    keys: int
    needs_grad: bool


def choose(backend: str, q: torch.Tensor, *, fn: str, block_size: Optional[Tuple[int, int]] = None,
           sdpa: Optional[SdpaCall] = None, fp8_cache: bool = False, triton_reason: Optional[str] = None,
           deterministic: bool = False, fa4: Optional[Fa4Call] = None, fa4_reason: Optional[str] = None) -> str:
    """Resolve ``backend`` to ``"sdpa"``, ``"triton"`` or ``"torch"`` for a call of ``fn`` on ``q``.

    ``sdpa`` describes the call when PyTorch's SDPA computes it exactly; ``auto`` then runs SDPA unless our
    kernels run it and the dispatch table says they are faster. Without it, ``auto`` runs our kernels where they
    run and the PyTorch backend elsewhere. ``fp8_cache``: the call reads float8 KV caches; ``triton_reason``: why
    the Triton kernels cannot run what the call asks (:func:`longattn.backends.triton.support.call_unsupported_reason`).
    ``deterministic``: the call's gradients must be reproducible bitwise; SDPA then runs it only when it needs none.
    ``fa4``: the call described where FlashAttention-4 computes it (else ``fa4_reason`` says why not): ``"fa4"``
    runs it there, and ``auto`` runs it where :func:`longattn.backends.auto_table.order_with_fa4` measured it fastest
    among the backends that compute the call (FA4 computes its deterministic backward too).
    """
    check_backend(backend, fn)
    if backend == "torch":
        return "torch"
    if backend == "fa4":
        if fa4 is None:
            raise ValueError(f"{fn}: backend='fa4' cannot run: {fa4_reason or 'not a call FlashAttention-4 takes'}")
        return "fa4"
    if deterministic and sdpa is not None and sdpa.needs_grad:
        sdpa = None  # SDPA's backward is not documented deterministic: our kernels (or PyTorch's operations) instead
    reason = triton_reason or triton_support.unsupported_reason(q, block_size, fp8_cache)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"{fn}: backend='triton' cannot run: {reason}")
        return "triton"
    if not q.is_cuda:
        reason = "not a CUDA tensor"  # the interpreter is for testing the kernels, never an automatic choice
    if fa4 is not None:
        order = auto_table.order_with_fa4(auto_table.device_class(q.device), "fwd_bwd" if fa4.needs_grad else "fwd",
                                          fa4.kind, q.shape[-1], fa4.keys)
        runs = {auto_table.SDPA: sdpa is not None, auto_table.FA4: True, auto_table.TRITON: reason is None}
        for impl in order:
            if runs[impl]:
                return impl
    if sdpa is not None:
        if reason is not None:
            return "sdpa"
        pass_ = "fwd_bwd" if sdpa.needs_grad else "fwd"
        return auto_table.choice(auto_table.device_class(q.device), pass_, sdpa.causal, sdpa.grouped,
                                 q.shape[-1])
    if reason is None:
        return "triton"
    if q.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"longattn.{fn}: falling back to the PyTorch backend: {reason}", stacklevel=3)
    return "torch"


class SdpaDecode(NamedTuple):
    """A KV-cache call SDPA can compute exactly (see :func:`longattn.backends.sdpa.decode_unsupported_reason`),
    described for the dispatch table."""

    grouped: bool  # Hq != Hk


def choose_decode(backend: str, q: torch.Tensor, *, fn: str, fp8_cache: bool = False,
                  sdpa: Optional[SdpaDecode] = None, triton_reason: Optional[str] = None) -> str:
    """Resolve ``backend`` for a KV-cache call of ``fn``: ``"sdpa"``, ``"triton"`` or ``"torch"``. ``auto`` runs
    SDPA's default kernel for the calls it computes exactly (``sdpa`` given: one new token against a contiguous
    cache whose length the caller gave as an int) unless the dispatch table's ``decode`` entry measured our kernel
    faster; our kernels for every other call where they run (paged and float8 caches, lengths per sequence in a
    tensor, several new tokens, dilated decode), the PyTorch backend elsewhere. ``triton_reason``: why our decode
    kernels cannot take the call's caches (their layout), if they cannot."""
    if backend == "auto" and sdpa is not None:
        if not q.is_cuda:
            return "sdpa"  # as for flash_attention: PyTorch's own attention on other devices
        if auto_table.choice(auto_table.device_class(q.device), "decode", False, sdpa.grouped,
                             q.shape[-1]) == auto_table.SDPA:
            return "sdpa"
    return choose(backend, q, fn=fn, fp8_cache=fp8_cache, triton_reason=triton_reason)
