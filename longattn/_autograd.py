"""What the autograd Functions of longattn check first in their backward: a second derivative they cannot give.

Their backwards run kernels (or collectives) whose gradients carry no autograd graph. Under
``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty, a Hessian-vector product) autograd runs a
backward with grad mode on and expects differentiable gradients; returning these would make the second derivative
silently zero. So such a backward raises instead, naming the function and what does compute it.
"""
from __future__ import annotations

import torch


def refuse_second_derivative(fn: str, alternative: str = "") -> None:
    """Raise ``RuntimeError`` naming ``fn`` when called from a backward run with ``create_graph=True``."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # (a traced backward is no second derivative)
        raise RuntimeError(f"{fn}: second derivatives (a backward with create_graph=True, as a gradient penalty "
                           f"takes) are not implemented here: its gradients are computed by kernels without an "
                           f"autograd graph{alternative}")


def refuse_second_derivative_of(outputs, fn: str, alternative: str = "") -> None:
    """Make the autograd nodes that produced ``outputs`` (a backend's own autograd Function, outside longattn, whose
    gradients carry no graph) refuse a second derivative: a pre-hook on each node raises as
    :func:`refuse_second_derivative` does when a backward with ``create_graph=True`` reaches it. A hook on the
    node instead of an identity Function after it: no extra node, which at small calls costs measurable host time
    (docs/benchmarks.md)."""
    nodes = {id(x.grad_fn): x.grad_fn for x in outputs if x is not None and x.grad_fn is not None}
    if not nodes or not torch.is_grad_enabled():
        return

    def refuse(grad_outputs):
        refuse_second_derivative(fn, alternative)

    for node in nodes.values():
        node.register_prehook(refuse)
