"""``nn.Module`` front-ends of :func:`ring_dilated_attention` for sequence-parallel training.

Every rank of the group holds the same parameters and its contiguous shard of the sequence. The modules compute
this rank's shard of the output; parameter gradients are this rank's share, so sum them over the group (for
example ``dist.all_reduce(p.grad)`` for every parameter, or DDP over the same ranks) before the optimizer step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist
from torch import Tensor, nn

from longattn import _validation as V
from longattn.distributed.options import ParallelOptions, check_options
from longattn.distributed.shards import group_size_rank
from longattn.distributed.ring_dilated import ring_dilated_attention
from longattn.nn.dilated import MultiheadDilatedAttention


class RingDilatedAttention(nn.Module):
    """Dilated attention of sharded ``q, k, v`` (``(B, n, H, D)`` each, see :func:`ring_dilated_attention`);
    ``deterministic``: bitwise-identical gradients from run to run (as there); ``options``: the
    :class:`~longattn.distributed.ParallelOptions` of the module's calls (``None``: the defaults)."""

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int], *, causal: bool = False,
                 head_split: bool = False, scale: Optional[float] = None,
                 group: Optional[dist.ProcessGroup] = None, backend: str = "auto", deterministic: bool = False,
                 options: Optional[ParallelOptions] = None):
        super().__init__()
        if len(segment_lengths) != len(dilation_rates):
            raise ValueError(
                f"segment_lengths and dilation_rates must have the same length, got {len(segment_lengths)} and "
                f"{len(dilation_rates)}"
            )
        self.segment_lengths = tuple(int(w) for w in segment_lengths)
        self.dilation_rates = tuple(int(r) for r in dilation_rates)
        fn = "RingDilatedAttention"
        self.causal, self.head_split = V.check_flag(causal, "causal", fn), V.check_flag(head_split, "head_split", fn)
        self.scale = scale
        self.group, self.backend = group, backend
        self.deterministic = V.check_flag(deterministic, "deterministic", fn)
        self.options = check_options(options, fn)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ring_dilated_attention(
            q, k, v, segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates, group=self.group,
            causal=self.causal, head_split=self.head_split, scale=self.scale, backend=self.backend,
            deterministic=self.deterministic, options=self.options,
        )

    def extra_repr(self) -> str:
        return (f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
                f"causal={self.causal}, head_split={self.head_split}"
                + (", deterministic=True" if self.deterministic else ""))


class RingMultiheadDilatedAttention(MultiheadDilatedAttention):
    """LongNet multi-head dilated self-attention over a sequence split contiguously across ``group``.

    :class:`longattn.nn.MultiheadDilatedAttention` (same arguments, parameters, initialisation, Sub-LN, dropout,
    grouped-query heads and rotary embedding) whose attention is :class:`RingDilatedAttention`. Input and output
    ``(B, n, embed_dim)`` are this rank's contiguous shard; with ``rotary`` its rows are rotated by their global
    positions ``rank * n ...``. ``group``: the process group (default: the world). ``options``: the
    :class:`~longattn.distributed.ParallelOptions` of its attention's calls. ``deterministic`` (among the keyword
    arguments): bitwise-identical gradients of the attention from run to run.
    """

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int],
                 dilation_rates: Sequence[int], *, group: Optional[dist.ProcessGroup] = None, backend: str = "auto",
                 options: Optional[ParallelOptions] = None, **kwargs):
        super().__init__(embed_dim, num_heads, segment_lengths, dilation_rates, backend=backend, **kwargs)
        self.group = group
        self.attention = RingDilatedAttention(self.attention.segment_lengths, self.attention.dilation_rates,
                                              causal=self.attention.causal, head_split=self.attention.head_split,
                                              group=group, backend=backend,
                                              deterministic=self.attention.deterministic, options=options)

    def _first_position(self, x: Tensor) -> int:
        _, rank = group_size_rank(self.group)
        return rank * x.shape[1]
