"""``nn.Module`` front-ends of :func:`ring_dilated_attention` for sequence-parallel training.

Every rank of the group holds the same parameters and its contiguous shard of the sequence. The modules compute
this rank's shard of the output; parameter gradients are this rank's share, so sum them over the group (for
example ``dist.all_reduce(p.grad)`` for every parameter, or DDP over the same ranks) before the optimizer step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist
from torch import Tensor, nn

from longattn.distributed.ring_dilated import ring_dilated_attention


class RingDilatedAttention(nn.Module):
    """Dilated attention of sharded ``q, k, v`` (``(B, n, H, D)`` each, see :func:`ring_dilated_attention`)."""

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int], *, causal: bool = False,
                 head_split: bool = False, scale: Optional[float] = None,
                 group: Optional[dist.ProcessGroup] = None, backend: str = "auto"):
        super().__init__()
        if len(segment_lengths) != len(dilation_rates):
            raise ValueError(
                f"segment_lengths and dilation_rates must have the same length, got {len(segment_lengths)} and "
                f"{len(dilation_rates)}"
            )
        self.segment_lengths = tuple(int(w) for w in segment_lengths)
        self.dilation_rates = tuple(int(r) for r in dilation_rates)
        self.causal, self.head_split, self.scale = bool(causal), bool(head_split), scale
        self.group, self.backend = group, backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ring_dilated_attention(
            q, k, v, segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates, group=self.group,
            causal=self.causal, head_split=self.head_split, scale=self.scale, backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
                f"causal={self.causal}, head_split={self.head_split}")


class RingMultiheadDilatedAttention(nn.Module):
    """LongNet multi-head dilated self-attention over a sequence split contiguously across ``group``.

    Input and output ``(B, n, embed_dim)``: this rank's shard. Queries have ``num_heads`` heads, keys and values
    ``num_kv_heads`` (default ``num_heads``; must divide it). With ``layer_norm`` the attention output is
    normalized (LayerNorm over ``embed_dim``) before the output projection, as LongNet's sub-LN.
    """

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int],
                 dilation_rates: Sequence[int], *, num_kv_heads: Optional[int] = None, bias: bool = True,
                 layer_norm: bool = True, causal: bool = False, head_split: bool = False,
                 group: Optional[dist.ProcessGroup] = None, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must be positive and divide num_heads ({num_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        kw = {"device": device, "dtype": dtype}
        kv_dim = self.head_dim * num_kv_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.norm = nn.LayerNorm(embed_dim, **kw) if layer_norm else None
        self.attention = RingDilatedAttention(segment_lengths, dilation_rates, causal=causal, head_split=head_split,
                                              group=group, backend=backend)

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None) -> Tensor:
        """Self-attention of the shard ``query`` (``key``/``value`` default to ``query``), ``(B, n, embed_dim)``."""
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (batch, seq, {self.embed_dim}), got shape {tuple(query.shape)}")
        key = query if key is None else key
        value = key if value is None else value
        B, n, _ = query.shape
        q = self.q_proj(query).view(B, n, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(B, key.shape[1], self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(B, value.shape[1], self.num_kv_heads, self.head_dim)
        out = self.attention(q, k, v).reshape(B, n, self.embed_dim)
        if self.norm is not None:
            out = self.norm(out)
        return self.out_proj(out)
