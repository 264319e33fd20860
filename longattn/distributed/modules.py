"""``nn.Module`` front-ends of :func:`ring_dilated_attention` for sequence-parallel training.

Every rank of the group holds the same parameters and its contiguous shard of the sequence. The modules compute
this rank's shard of the output; parameter gradients are this rank's share, so sum them over the group (for
example ``dist.all_reduce(p.grad)`` for every parameter, or ``ContextParallel().all_reduce_gradients(module)``) before
the optimizer step. DDP over the same ranks averages them instead: right only where each rank's loss is its own
shard's mean, ``P`` times too small where it is the shard's sum over the global count.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence, Union

import torch.distributed as dist
from torch import Tensor, nn

from longattn import _validation as V
from longattn.distributed.options import ParallelOptions, check_options, host_checks_of
from longattn.distributed.shards import check_same_across_ranks, group_size_rank, shard_layout
from longattn.distributed.ring_dilated import _ring_dilated_attention
from longattn.nn._checks import check_layer_input, check_module_backend
from longattn.nn.dilated import MultiheadDilatedAttention


def _deepcopy_sharing_group(module: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a module holding a process group: the copy attends over the same group (a group is a
    handle on the ranks' connections; pickling one raises ``TypeError``), everything else copied as usual."""
    group = module.__dict__.get("group")
    if group is not None:
        memo[id(group)] = group
    new = module.__class__.__new__(module.__class__)
    memo[id(module)] = new
    new.__setstate__(copy.deepcopy(module.__dict__, memo))
    return new


class RingDilatedAttention(nn.Module):
    """Dilated attention of sharded ``q, k, v`` (``(B, n, H, D)`` each, see :func:`ring_dilated_attention`);
    ``deterministic``: bitwise-identical gradients from run to run (as there); ``options``: the
    :class:`~longattn.distributed.ParallelOptions` of the module's calls (``None``: the defaults)."""

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int], *, causal: bool = False,
                 head_split: bool = False, scale: Optional[float] = None,
                 group: Optional[dist.ProcessGroup] = None, backend: str = "auto", deterministic: bool = False,
                 options: Optional[ParallelOptions] = None):
        super().__init__()
        fn = "RingDilatedAttention"  # (the checks of longattn.nn.DilatedAttention, at construction as there)
        self.segment_lengths, self.dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
        self.causal, self.head_split = V.check_flag(causal, "causal", fn), V.check_flag(head_split, "head_split", fn)
        self.scale = None if scale is None else V.check_scale(scale, 1, fn=fn)
        self.group, self.backend = group, check_module_backend(backend, fn, "dilated attention")
        self.deterministic = V.check_flag(deterministic, "deterministic", fn)
        self.options = check_options(options, fn)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._attend(q, k, v)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, also_compared: Optional[dict] = None) -> Tensor:
        return _ring_dilated_attention(
            q, k, v, segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates, group=self.group,
            causal=self.causal, head_split=self.head_split, scale=self.scale, backend=self.backend,
            return_lse=False, cu_seqlens=None, deterministic=self.deterministic, options=self.options,
            also_compared=also_compared,
        )

    def __deepcopy__(self, memo: dict) -> "RingDilatedAttention":
        return _deepcopy_sharing_group(self, memo)

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
        check_module_backend(backend, "RingMultiheadDilatedAttention", "dilated attention")  # (named as this class)
        super().__init__(embed_dim, num_heads, segment_lengths, dilation_rates, backend=backend, **kwargs)
        self.group = group
        self.attention = RingDilatedAttention(self.attention.segment_lengths, self.attention.dilation_rates,
                                              causal=self.attention.causal, head_split=self.attention.head_split,
                                              group=group, backend=backend,
                                              deterministic=self.attention.deterministic, options=options)

    def __deepcopy__(self, memo: dict) -> "RingMultiheadDilatedAttention":
        return _deepcopy_sharing_group(self, memo)

    def _first_position(self, x: Tensor) -> int:
        _, rank = group_size_rank(self.group)
        return rank * x.shape[1]

    def forward(self, x: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """This rank's shard ``x`` ``(B, n, embed_dim)`` of the sequence -> its shard of the output. An input refused
        on some rank (shape, dtype, ``cu_seqlens``) raises ``ValueError`` on every rank of the group, naming it."""
        fn = "RingMultiheadDilatedAttention"
        try:
            if cu_seqlens is not None:
                raise ValueError(f"{fn}: packed batches (cu_seqlens) are not taken; call "
                                 "longattn.distributed.ring_dilated_attention(q, k, v, cu_seqlens=...) on this rank's "
                                 "projected rows, or run longattn.nn.MultiheadDilatedAttention on one rank")
            check_layer_input(x, self.embed_dim, self.q_proj.weight, fn)
            cut = shard_layout(x)  # (its projections cannot be told apart: the attention's own check misses them)
            if cut is not None and cut != "contiguous":
                raise ValueError(f"{fn}: x is a tensor shard() cut in the {cut!r} layout (shard(x)'s default), but "
                                 f"this module reads its input as the contiguous shard (its segments and rotary "
                                 f"positions), so the result would be wrong: pass shard(x, layout='contiguous')")
        except (TypeError, ValueError) as e:
            if dist.is_available() and dist.is_initialized() and group_size_rank(self.group)[0] > 1:
                # This rank's error in the exchange its peers make in their attention's check (the same kind of
                # exchange), so that they raise too instead of waiting there for the group's timeout.
                check_same_across_ranks(self.group, {}, fn=fn, local_error=str(e), differentiable=False,
                                        host_checks=host_checks_of(getattr(self.attention, "options", None)))
            raise
        return super().forward(x)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention call, also comparing across the ranks this module's options that change the result and no
        collective (a rank rotating by other angles, normalising with another eps or dropping out where its peers do
        not would otherwise give wrong rows silently)."""
        a = self.attention
        if isinstance(a, RingDilatedAttention):
            return a._attend(q, k, v, also_compared=self._compared_options())
        return a(q, k, v)  # (an attention module swapped in by the user)

    def _compared_options(self) -> dict:
        name = "RingMultiheadDilatedAttention."
        return {name + "rotary": self.rotary, name + "rotary_base": self.rotary_base if self.rotary else None,
                name + "layer_norm_eps": None if self.norm is None else self.norm.eps,
                name + "bias": self.q_proj.bias is not None,
                name + "dropout (in training mode)": self.dropout if self.training else 0.0}

    def prefill(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Optional[Tensor] = None) -> Tensor:
        """Not available: cached generation does not run across ranks (see :meth:`decode`)."""
        raise NotImplementedError(_NO_GENERATION.format("prefill"))

    def decode(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Union[int, Tensor],
               block_table: Optional[Tensor] = None) -> Tensor:
        """Not available: cached generation does not run across ranks. A model trained with this module generates
        with :class:`longattn.nn.MultiheadDilatedAttention` holding the same weights (``load_state_dict`` of this
        module's state), on one rank: its ``prefill`` and ``decode`` attend over the whole sequence."""
        raise NotImplementedError(_NO_GENERATION.format("decode"))


_NO_GENERATION = ("RingMultiheadDilatedAttention.{}: cached generation does not run across ranks (the module's "
                  "attention is a collective over shards, the KV cache is not sharded); load this module's state "
                  "into a longattn.nn.MultiheadDilatedAttention with the same arguments and generate with its "
                  "prefill and decode on one rank")
