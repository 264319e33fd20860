"""The buffers the Gluon backwards' launches write and the tables they read (``bwd_fused.fused_backward``,
``bwd_wide_tile.backward``), made apart from them so that a caller recording their launches (the Triton backend's
replays) can name them and make fresh ones for each replay. Imports no Triton."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from longattn.backends.gluon.packed import query_blocks_before, work_table
from longattn.backends.gluon.shapes import FUSED_BWD_TILES
from longattn.backends.kernel_args import cdiv


class Workspace(NamedTuple):
    """The buffers a Gluon backward's launches write: ``dk``, ``dv`` (the gradients), the row statistics
    ``stats`` ``(B·H·2, n_pad)`` float32 (``n_pad``: the query rows the statistics kernel's blocks cover), dQ's
    float32 accumulator ``dq`` ``(B, N, H, D)``, zeroed, and where deterministic the turn counters ``turns``
    (int32, zeroed; None otherwise); for a packed batch the tables its launches read (None otherwise)."""
    dk: Tensor
    dv: Tensor
    stats: Tensor
    dq: Tensor
    turns: Optional[Tensor]
    q_blocks: Optional[Tensor] = None
    block_seq: Optional[Tensor] = None
    work: Optional[Tensor] = None

    def tensors(self) -> Tuple[Tensor, ...]:
        """The buffers and tables, those absent (None) left out."""
        return tuple(t for t in self if t is not None)


def make_workspace(q: Tensor, k: Tensor, v: Tensor, grad_dtype: torch.dtype, deterministic: bool,
                   cu_seqlens: Optional[Tuple[Tensor, Tensor]] = None, left: Optional[int] = None,
                   right: Optional[int] = None, block_m: Optional[int] = None) -> Workspace:
    """Fresh buffers for the fused backward of these arguments: q ``(B, N, H, D)``, k and v ``(B, M, Hk, D)``,
    the gradients in ``grad_dtype``. A packed batch (``cu_seqlens = (cu_q, cu_k)``, ``B`` = 1, the band's kernel
    sides ``left`` and ``right``, None: unbounded) adds its tables, computed on the GPU without a host sync
    (:mod:`longattn.backends.gluon.packed`): the query blocks before each sequence (``q_blocks``), each statistics
    block's sequence (``block_seq``) and the programs' work table (``work``). ``block_m``: the statistics blocks'
    rows where not the fused backward's (the 128 x 128 backward's, which writes the same buffers for dense calls)."""
    B, N, H, D = q.shape
    fused_m, sub_n = FUSED_BWD_TILES[D]
    block_m = block_m or fused_m
    n_seqs = None if cu_seqlens is None else cu_seqlens[0].shape[0] - 1
    n_pad = cdiv(N, block_m) * block_m if n_seqs is None else (N // block_m + n_seqs) * block_m
    turns = torch.zeros(B * H * (n_pad // block_m), dtype=torch.int32, device=q.device) if deterministic else None
    tables: tuple = ()
    if cu_seqlens is not None:
        cu_q, cu_k = cu_seqlens
        q_blocks = query_blocks_before(cu_q, block_m)
        block_seq = torch.searchsorted(q_blocks[1:], torch.arange(n_pad // block_m, device=q.device,
                                                                  dtype=torch.int32), right=True).to(torch.int32)
        tables = (q_blocks, block_seq, work_table(cu_q, cu_k, q_blocks, k.shape[1], block_m, 2 * sub_n, left, right))
    return Workspace(torch.empty(k.shape, dtype=grad_dtype, device=k.device),
                     torch.empty(v.shape, dtype=grad_dtype, device=v.device),
                     torch.empty((B * H * 2, n_pad), dtype=torch.float32, device=q.device),
                     torch.zeros((B, N, H, D), dtype=torch.float32, device=q.device), turns, *tables)
