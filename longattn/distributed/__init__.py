"""Attention over sequences split across the ranks of a ``torch.distributed`` process group.

- :func:`ring_attention`: exact (optionally causal) attention; key/value shards travel round the ring.
- :func:`ring_dilated_attention`: LongNet's distributed dilated attention (contiguous layout).
- :func:`ulysses_attention`, :func:`ulysses_dilated_attention`: the same by all-to-all (DeepSpeed-Ulysses): each
  rank attends over the whole sequence with ``1/P`` of the heads.
- :func:`hybrid_attention`: Ulysses inside groups of ranks, ring across them (USP); :func:`shard_hybrid` /
  :func:`unshard_hybrid` cut and gather its parts.
- :func:`shard` / :func:`unshard`: cut a full tensor into this rank's part / gather the parts back.
- :class:`RingDilatedAttention`, :class:`RingMultiheadDilatedAttention`: ``nn.Module`` front-ends.

See ``docs/distributed.md``.
"""
from longattn.distributed.shards import LAYOUTS, local_positions, shard, unshard
from longattn.distributed.ring import ring_attention
from longattn.distributed.ring_dilated import ring_dilated_attention
from longattn.distributed.ulysses import ulysses_attention, ulysses_dilated_attention
from longattn.distributed.hybrid import hybrid_attention, shard_hybrid, unshard_hybrid
from longattn.distributed.modules import RingDilatedAttention, RingMultiheadDilatedAttention

__all__ = [
    "ring_attention", "ring_dilated_attention", "ulysses_attention", "ulysses_dilated_attention", "shard", "unshard",
    "local_positions", "LAYOUTS", "hybrid_attention", "shard_hybrid", "unshard_hybrid",
    "RingDilatedAttention", "RingMultiheadDilatedAttention",
]
