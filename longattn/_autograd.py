"""What the autograd Functions of longattn check first in their backward: a second derivative they cannot give.

Their backwards run kernels (or collectives) whose gradients carry no autograd graph. Under
``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty, a Hessian-vector product) autograd runs a
backward with grad mode on and expects differentiable gradients; returning these would make the second derivative
silently zero. So such a backward raises instead, naming the function and what does compute it.

Nor do those kernels take part in ``torch.func`` transforms or forward-mode AD: :func:`transform_reason` says when a
call's inputs need them, and the runner then runs the PyTorch backend (``"auto"``) or refuses by name; a backward
given batched gradients (``is_grads_batched=True``) refuses by name too (:func:`refuse_batched_gradients`).

:func:`writes_into` lets the KV-cache calls write into inference tensors (caches made under
``torch.inference_mode()``) outside that mode, as their Triton kernels do.
"""
from __future__ import annotations

import contextlib
import functools
from typing import ContextManager, Optional

import torch
from torch.autograd import forward_ad


def refuse_second_derivative(fn: str, alternative: str = "") -> None:
    """Raise ``RuntimeError`` naming ``fn`` when called from a backward run with ``create_graph=True``."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # (a traced backward is no second derivative)
        raise RuntimeError(f"{fn}: second derivatives (a backward with create_graph=True, as a gradient penalty "
                           f"takes) are not implemented here: its gradients are computed by kernels without an "
                           f"autograd graph{alternative}")


def refuse_batched_gradients(fn: str, *grads, alternative: str = "", reader: str = "its kernels") -> None:
    """Raise ``RuntimeError`` naming ``fn`` when a backward whose gradients kernels compute is given output gradients
    under a ``torch.func`` transform (:func:`transform_reason`): ``torch.autograd.grad(..., is_grads_batched=True)``,
    and ``torch.autograd.functional.jacobian``/``hessian`` with ``vectorize=True``, run the backward under ``vmap``,
    whose batched gradients have no storage for a kernel to read (PyTorch's error there, "Cannot access data pointer
    of Tensor that doesn't have storage", names nothing the caller wrote). The forward was not transformed, so it
    could not choose the PyTorch backend then. (``is_grads_batched`` runs PyTorch's older vmap, whose batched
    tensors no ``torch.func`` interpreter announces: :func:`_legacy_batched` finds them.) ``reader``: what cannot
    take them (a sequence-parallel backward's exchanges between ranks: refused on every rank before the first)."""
    if torch.compiler.is_compiling():  # (a traced backward: no batched gradients reach it)
        return
    if transform_reason(*grads) is not None or any(_legacy_batched(g) for g in grads if g is not None):
        raise RuntimeError(f"{fn}: its backward was given batched output gradients (torch.autograd.grad with "
                           f"is_grads_batched=True, or torch.autograd.functional.jacobian/hessian with "
                           f"vectorize=True, which run it under vmap), which {reader} cannot read{alternative}; "
                           f"or compute the gradients one at a time (is_grads_batched=False, vectorize=False)")


def refuse_batched_gradients_across_ranks(fn: str, *grads) -> None:
    """:func:`refuse_batched_gradients` for a sequence-parallel backward, called before its first exchange: every
    rank is given batched gradients alike, so every rank refuses there and none is left waiting in a collective (the
    PyTorch backend's kernels took them, the exchanges did not, on some ranks earlier than others)."""
    refuse_batched_gradients(fn, *grads, reader="its exchanges between ranks")


def _legacy_batched(t) -> bool:
    """Whether ``t`` is a batched tensor of PyTorch's older vmap (``torch._vmap_internals``)."""
    check = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    return check is not None and check(t)


def refuse_second_derivative_of(outputs, fn: str, alternative: str = "") -> None:
    """Make the autograd nodes that produced ``outputs`` (a backend's own autograd Function, outside longattn, whose
    gradients carry no graph and whose kernels read the gradients' memory) refuse a second derivative and batched
    gradients: a pre-hook on each node raises as :func:`refuse_second_derivative` does when a backward with
    ``create_graph=True`` reaches it, and as :func:`refuse_batched_gradients` does when batched ones do. A hook on the
    node instead of an identity Function after it: no extra node, which at small calls costs measurable host time
    (docs/benchmarks.md); one hook per ``(fn, alternative)``, made once (:func:`_refuser`)."""
    if not torch.is_grad_enabled():
        return
    hook = None
    seen = None
    for x in outputs:
        node = None if x is None else x.grad_fn
        if node is None or node is seen:  # (one Function's outputs, given together, share its node)
            continue
        if hook is None:
            hook = _refuser(fn, alternative)
        node.register_prehook(hook)
        seen = node


@functools.lru_cache(maxsize=None)
def _refuser(fn: str, alternative: str):
    """The pre-hook :func:`refuse_second_derivative_of` registers: a backward that runs with grad mode off (every
    one but ``create_graph=True``'s) reads that mode and whether a transform batches the gradients, and returns."""
    def refuse(grad_outputs):
        if torch.is_grad_enabled():
            refuse_second_derivative(fn, alternative)
        refuse_batched_gradients(fn, *grad_outputs, alternative=alternative)
    return refuse


def transform_reason(*tensors) -> Optional[str]:
    """Why the kernel backends (Triton, FlashAttention-4), which read the tensors' memory and define no rule for
    these, cannot run a call on ``tensors`` (None skipped), or None: a ``torch.func`` transform (``vmap``, ``grad``,
    ``jvp``, ...) wraps one of them (a kernel then failed deep inside, "Cannot access data pointer of Tensor that
    doesn't have storage"), or forward-mode AD (``torch.autograd.forward_ad``) gives one a tangent (a call that
    needed no autograd graph dropped it silently, the output having no tangent). Cheap where neither is in use: one
    read of each mode's state. Under ``torch.compile`` tracing, None (the traced call is what runs)."""
    functorch = torch._C._functorch.peek_interpreter_stack() is not None
    dual = forward_ad._current_level >= 0
    if not (functorch or dual) or torch.compiler.is_compiling():
        return None
    for t in tensors:
        if t is None:
            continue
        if functorch and torch._C._functorch.is_functorch_wrapped_tensor(t):
            return "a torch.func transform (vmap, grad, jvp, ...) of its inputs"
        if dual and forward_ad.unpack_dual(t).tangent is not None:
            return "forward-mode AD (a tangent on its inputs, torch.autograd.forward_ad)"
    return None


def writes_into(*tensors) -> ContextManager:
    """Where in-place writes into ``tensors`` (None skipped) run: under ``torch.inference_mode()`` when one of them
    is an inference tensor (made under that mode) and the mode is off now, for PyTorch refuses such writes outside
    it ("Inplace update to inference tensor outside InferenceMode"); elsewhere as they are. For the KV-cache calls'
    writes into their caches and ``out``, which the Triton kernels (as FlashAttention's) make whatever the tensors'
    kind: a call then works the same on every backend. Under ``torch.compile`` tracing (which reads neither mode
    nor kind), as they are."""
    if all(t is None for t in tensors) or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    if torch.is_inference_mode_enabled() or not any(t is not None and t.is_inference() for t in tensors):
        return contextlib.nullcontext()
    return torch.inference_mode()
