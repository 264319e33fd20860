"""Block-sparse attention modules: :class:`BlockSparseAttention` and :class:`MultiheadBlockSparseAttention`."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from longattn import _validation as V
from longattn._empty import empty_attention, is_empty
from longattn.nn._checks import check_dropout, check_layer_input, check_module_backend
from longattn.functional import block_sparse_attention
from longattn.patterns import BlockSparsePattern
from longattn.patterns.builders import Pattern, PatternBuilder

PatternSource = Union[BlockSparsePattern, Callable[[int, int, torch.device], BlockSparsePattern]]


def _check_pattern(pattern) -> None:
    """``TypeError`` unless ``pattern`` is a :class:`BlockSparsePattern` or a callable building one."""
    if not isinstance(pattern, BlockSparsePattern) and not callable(pattern):
        hint = (f" (for a Pattern, pass {pattern!r}.builder(block_size=...) or {pattern!r}.build(N, M, "
                f"block_size=...))" if isinstance(pattern, Pattern) else "")
        raise TypeError("BlockSparseAttention: pattern must be a BlockSparsePattern or a callable (N, M, device) "
                        f"-> BlockSparsePattern, got {type(pattern).__name__}{hint}")


class BlockSparseAttention(nn.Module):
    """:func:`longattn.block_sparse_attention` with a fixed pattern, as a module.

    Args:
        pattern: a :class:`~longattn.patterns.BlockSparsePattern` (built for one ``(N, M)``), or a callable
            ``(N, M, device) -> BlockSparsePattern`` that builds one for each input length, e.g.
            ``(Local(4) | GlobalTokens(1)).builder(block_size=128)``. Built patterns are cached per
            ``(N, M, device)`` (the 32 most recently used), so their device copies and block lists are made once;
            assigning another ``pattern`` drops them.
        causal: bottom-right aligned causal mask on top of the pattern.
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        deterministic: bitwise-identical gradients from run to run (see :func:`longattn.block_sparse_attention`).

    ``forward(q, k, v)``: q ``(B, N, Hq, D)``, k and v ``(B, M, Hk, D)``; returns ``(B, N, Hq, D)``.
    """

    cache_size = 32

    def __init__(self, pattern: PatternSource, *, causal: bool = False, scale: Optional[float] = None,
                 backend: str = "auto", deterministic: bool = False):
        super().__init__()
        self.pattern = pattern  # (checked, :meth:`__setattr__`)
        causal = V.check_flag(causal, "causal", "BlockSparseAttention")
        if scale is not None:
            V.check_scale(scale, 1, fn="BlockSparseAttention")
        check_module_backend(backend, "BlockSparseAttention", "block-sparse attention")
        self.deterministic = V.check_flag(deterministic, "deterministic", "BlockSparseAttention")
        self.causal = causal
        self.scale = scale
        self.backend = backend

    def __setattr__(self, name: str, value) -> None:
        """``pattern`` is checked, and assigning one (a wider window during training, say) drops the patterns built
        by the previous one, which would otherwise keep serving the lengths they were built for. Here rather than in
        a property: ``nn.Module`` registers a module value (a builder that is an ``nn.Module``) without calling a
        property's setter."""
        if name == "pattern":
            _check_pattern(value)
            super().__setattr__("_built", OrderedDict())
        super().__setattr__(name, value)

    def pattern_for(self, n: int, m: int, device: torch.device) -> BlockSparsePattern:
        """The pattern used for ``N = n`` queries and ``M = m`` keys on ``device``."""
        if isinstance(self.pattern, BlockSparsePattern):
            return self.pattern.to(device)
        key = (n, m, torch.device(device))
        built = self._built.get(key)
        if built is None:
            built = self.pattern(n, m, device)
            if not isinstance(built, BlockSparsePattern):
                raise TypeError(f"BlockSparseAttention: the pattern callable must return a BlockSparsePattern, got "
                                f"{type(built).__name__}")
            built = built.to(device)
            self._built[key] = built
            if len(self._built) > self.cache_size:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end(key)
        return built

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
            V.check_attention_inputs(q, k, v, fn="BlockSparseAttention")  # raises the precise error
        if is_empty(q, k):  # no pattern to build for an empty sequence: nothing attends
            V.check_attention_inputs(q, k, v, fn="BlockSparseAttention")
            return empty_attention(q, k, v)[0]
        pattern = self.pattern_for(q.shape[1], k.shape[1], q.device)
        return block_sparse_attention(q, k, v, block_mask=pattern, causal=self.causal, scale=self.scale,
                                      backend=self.backend, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"pattern={self.pattern!r}, causal={self.causal}, scale={self.scale}, backend={self.backend!r}"
                + (", deterministic=True" if self.deterministic else ""))


class MultiheadBlockSparseAttention(nn.Module):
    """Self-attention layer: q/k/v projections, :class:`BlockSparseAttention`, output projection.

    Args:
        embed_dim: model width ``E``; ``num_heads`` must divide it (``head_dim = E // num_heads``).
        num_heads: query heads ``Hq``.
        pattern: as for :class:`BlockSparseAttention`; its head dim must be 1 or ``num_heads``.
        num_kv_heads: key/value heads ``Hk`` (grouped-query attention), dividing ``num_heads``; default
            ``num_heads``.
        bias: biases in the projections.
        causal: bottom-right aligned causal mask on top of the pattern.
        dropout: dropout probability on the attention output before the output projection (training only; the
            kernels have no attention-weight dropout).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        deterministic: bitwise-identical gradients of the attention from run to run (see
            :func:`longattn.block_sparse_attention`).

    ``forward(x)``: ``(B, N, E)`` -> ``(B, N, E)``, batch first and the output alone, as
    :class:`longattn.nn.MultiheadDilatedAttention`'s.
    """

    def __init__(self, embed_dim: int, num_heads: int, pattern: PatternSource, *, num_kv_heads: Optional[int] = None,
                 bias: bool = True, causal: bool = False, dropout: float = 0.0, backend: str = "auto",
                 deterministic: bool = False, device=None, dtype=None):
        super().__init__()
        fn = "MultiheadBlockSparseAttention"
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not V._is_int(val) or val < 1:
                raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"{fn}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if embed_dim // num_heads > V.MAX_HEAD_DIM:
            raise ValueError(f"{fn}: head_dim = embed_dim // num_heads = {embed_dim // num_heads} exceeds "
                             f"{V.MAX_HEAD_DIM}; use more heads")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not V._is_int(num_kv_heads) or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{fn}: num_kv_heads must be a positive int dividing num_heads ({num_heads}), got "
                             f"{num_kv_heads!r}")
        dropout = check_dropout(dropout, fn)
        bias, causal, deterministic = (V.check_flag(val, name, fn) for name, val in (
            ("bias", bias), ("causal", causal), ("deterministic", deterministic)))
        if isinstance(pattern, BlockSparsePattern) and pattern.mask.shape[1] not in (1, num_heads):
            raise ValueError(f"{fn}: pattern has a mask for {pattern.mask.shape[1]} heads; it must have 1 (shared) or "
                             f"num_heads={num_heads}")
        if isinstance(pattern, PatternBuilder) and pattern.heads not in (1, num_heads):
            raise ValueError(f"{fn}: pattern builds masks for heads={pattern.heads}; it must be 1 (shared) or "
                             f"num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        kv_dim = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        check_module_backend(backend, fn, "block-sparse attention")  # (named as this class)
        self.attention = BlockSparseAttention(pattern, causal=causal, backend=backend, deterministic=deterministic)
        self.dropout = float(dropout)

    def forward(self, x: Tensor) -> Tensor:
        check_layer_input(x, self.embed_dim, self.q_proj.weight, "MultiheadBlockSparseAttention")
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        out = self.attention(q, k, v).reshape(b, n, self.embed_dim)
        out = nn.functional.dropout(out, self.dropout, self.training)
        return self.out_proj(out)

    def reset_parameters(self) -> None:
        """The projections' initialisation at construction (``nn.Linear``'s own), e.g. after ``to_empty`` of a
        module built on the meta device."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            proj.reset_parameters()

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"dropout={self.dropout}")
