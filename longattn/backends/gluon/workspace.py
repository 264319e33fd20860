"""The buffers the fused Gluon backward's launches write (:func:`longattn.backends.gluon.bwd_fused.fused_backward`),
made apart from it so that a caller recording its launches (the Triton backend's replays) can name them and make
fresh ones for each replay. Imports no Triton."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from longattn.backends.gluon.shapes import FUSED_BWD_TILES
from longattn.backends.kernel_args import cdiv


class Workspace(NamedTuple):
    """The buffers the fused backward's launches write: ``dk``, ``dv`` (the gradients), the row statistics
    ``stats`` ``(B·H·2, n_pad)`` float32 (``n_pad``: the query rows the statistics kernel's blocks cover), dQ's
    float32 accumulator ``dq`` ``(B, N, H, D)``, zeroed, and where deterministic the turn counters ``turns``
    (int32, zeroed; None otherwise)."""
    dk: Tensor
    dv: Tensor
    stats: Tensor
    dq: Tensor
    turns: Optional[Tensor]

    def tensors(self) -> Tuple[Tensor, ...]:
        """The buffers, ``turns`` left out where there are none."""
        return tuple(t for t in self if t is not None)


def make_workspace(q: Tensor, k: Tensor, v: Tensor, grad_dtype: torch.dtype, deterministic: bool,
                   n_seqs: Optional[int]) -> Workspace:
    """Fresh buffers for the fused backward of these arguments: q ``(B, N, H, D)``, k and v ``(B, M, Hk, D)``,
    the gradients in ``grad_dtype``; ``n_seqs``: the sequences of a packed batch (``B`` = 1), None for a dense
    call."""
    B, N, H, D = q.shape
    block_m = FUSED_BWD_TILES[D][0]
    n_pad = cdiv(N, block_m) * block_m if n_seqs is None else (N // block_m + n_seqs) * block_m
    turns = torch.zeros(B * H * (n_pad // block_m), dtype=torch.int32, device=q.device) if deterministic else None
    return Workspace(torch.empty(k.shape, dtype=grad_dtype, device=k.device),
                     torch.empty(v.shape, dtype=grad_dtype, device=v.device),
                     torch.empty((B * H * 2, n_pad), dtype=torch.float32, device=q.device),
                     torch.zeros((B, N, H, D), dtype=torch.float32, device=q.device), turns)
