"""Attention over sequences split across the ranks of a ``torch.distributed`` process group.

- :func:`ring_attention`: exact (optionally causal) attention; key/value shards travel round the ring.
- :func:`ring_dilated_attention`: LongNet's distributed dilated attention (contiguous layout).
- :func:`ulysses_attention`, :func:`ulysses_dilated_attention`: the same by all-to-all (DeepSpeed-Ulysses): each
  rank attends over the whole sequence with ``1/P`` of the heads.
- :func:`hybrid_attention`: Ulysses inside groups of ranks, ring across them (USP); :func:`shard_hybrid` /
  :func:`unshard_hybrid` cut and gather its parts.
- :func:`shard` / :func:`unshard`: cut a full tensor into this rank's part / gather the parts back (a packed batch:
  ``cu_seqlens=``; :func:`local_cu_seqlens` bounds its documents in a shard).
- :class:`RingDilatedAttention`, :class:`RingMultiheadDilatedAttention`: ``nn.Module`` front-ends.
- :class:`ContextParallel`: training a model on a sequence split over the ranks (shard a batch, reduce the loss
  and the gradients); see ``docs/context_parallel.md``.
- :class:`ParallelOptions`: how the calls run (the blocks' transport, Ulysses' head groups, how the cross-rank
  check exchanges, the copy engines' timeout), passed to every function as ``options=``.

See ``docs/distributed.md``.
"""
from longattn.distributed.options import ParallelOptions
from longattn.distributed.shards import LAYOUTS, local_cu_seqlens, local_positions, shard, unshard
from longattn.distributed.ring import ring_attention
from longattn.distributed.ring_dilated import ring_dilated_attention
from longattn.distributed.ulysses import ulysses_attention, ulysses_dilated_attention
from longattn.distributed.hybrid import hybrid_attention, shard_hybrid, unshard_hybrid
from longattn.distributed.modules import RingDilatedAttention, RingMultiheadDilatedAttention
from longattn.distributed.context_parallel import ContextParallel

__all__ = [
    "ring_attention", "ring_dilated_attention", "ulysses_attention", "ulysses_dilated_attention", "shard", "unshard",
    "local_positions", "local_cu_seqlens", "LAYOUTS", "hybrid_attention", "shard_hybrid", "unshard_hybrid",
    "RingDilatedAttention", "RingMultiheadDilatedAttention", "ContextParallel", "ParallelOptions",
]
