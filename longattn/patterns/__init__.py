"""Block-sparse attention patterns: block masks for :func:`longattn.block_sparse_attention`.

- Pattern objects, composable with ``|`` and ``&``: :class:`Dense`, :class:`Causal`, :class:`Local`,
  :class:`GlobalTokens`, :class:`Dilated`, :class:`Hierarchical`, :class:`Random`, :class:`Union`,
  :class:`Intersection`. ``pattern.mask(n, m, block_size=..., heads=..., device=...)`` draws the bool block mask
  ``(1, heads, ceil(n / block_q), ceil(m / block_k))``; ``pattern.build(...)`` wraps it in a
  :class:`BlockSparsePattern`.
- The same as plain functions returning masks: :func:`dense`, :func:`causal`, :func:`local`,
  :func:`global_tokens`, :func:`dilated`, :func:`hierarchical`, :func:`random`, and :func:`union` /
  :func:`intersection` of masks.
- :func:`adaptive`: content-adaptive top-k key blocks per query block from mean-pooled ``q`` and ``k``.
- :class:`BlockSparsePattern`: a mask with its block size that caches its conversion to the kernels' block lists.

Windows, segments and global counts are in blocks; queries are aligned with keys bottom-right, as the kernels'
causal mask (query ``i`` at key position ``i + M - N``). See ``docs/patterns.md``.
"""
from longattn.patterns.adaptive import adaptive, block_means
from longattn.patterns.builders import (Causal, Dense, Dilated, GlobalTokens, Hierarchical, Intersection, Local,
                                        Pattern, Random, Union, causal, dense, dilated, global_tokens, hierarchical,
                                        intersection, local, random, union)
from longattn.patterns.pattern import BlockSparsePattern

__all__ = [
    "Pattern", "Dense", "Causal", "Local", "GlobalTokens", "Dilated", "Hierarchical", "Random", "Union",
    "Intersection", "dense", "causal", "local", "global_tokens", "dilated", "hierarchical", "random", "union",
    "intersection", "adaptive", "block_means", "BlockSparsePattern",
]
