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


class NoSecondDerivative(torch.autograd.Function):
    """The identity on ``(out, lse)`` whose backward refuses a second derivative (for a backend whose own autograd
    Function, outside longattn, would return gradients without a graph)."""

    @staticmethod
    def forward(ctx, out, lse, fn: str, alternative: str):
        ctx.what = (fn, alternative)
        ctx.set_materialize_grads(False)
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        refuse_second_derivative(*ctx.what)
        return d_out, d_lse, None, None
