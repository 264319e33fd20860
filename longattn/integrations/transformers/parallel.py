"""Context parallelism for ``attn_implementation="longattn"``: inside ``with context_parallel(...)``, the plug-in's
attention runs the distributed attention of a :class:`longattn.distributed.ContextParallel` plan on this rank's shard
of the sequence instead of the single-device kernels. See ``docs/context_parallel.md``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist

_active = None  # the plan in force: process-wide, so autograd's threads (a recomputing backward) see it too


def active():
    """The :class:`~longattn.distributed.ContextParallel` plan in force, or None."""
    return _active


@contextlib.contextmanager
def context_parallel(group: Optional[dist.ProcessGroup] = None, mode: str = "ring", *,
                     ring_group: Optional[dist.ProcessGroup] = None,
                     ulysses_group: Optional[dist.ProcessGroup] = None, mesh=None, layout: Optional[str] = None,
                     plan=None, options=None) -> Iterator:
    """Run ``attn_implementation="longattn"`` across the ranks of a process group while the block lasts.

    The arguments are :class:`longattn.distributed.ContextParallel`'s (``mode``: ``"ring"``, ``"ulysses"`` or
    ``"hybrid"``; ``options``: a :class:`longattn.distributed.ParallelOptions`, how its attention runs), or ``plan``,
    such a plan built before. Yields the plan, whose
    :meth:`~longattn.distributed.ContextParallel.shard_batch` cuts a batch for this rank::

        with context_parallel(group=g, mode="ring") as cp:
            out = model(**cp.shard_batch({"input_ids": ids, "labels": ids}))
            out.loss.backward()                  # this rank's sum over the whole sequence's count of targets
            cp.all_reduce_gradients(model)       # the whole sequence's gradients, on every rank
            loss = cp.reduce_loss(out.loss)      # the whole sequence's loss

    Inside the block every ``"longattn"`` attention call (all ranks call the model together) takes this rank's rows
    of one long sequence: ``position_ids`` must be the rows' global positions (each document's in a packed batch;
    an unpacked row's may all be shifted by one offset ``>= 0``, the same on every rank; the rotary embeddings read
    them; ``shard_batch`` gives them, and a mismatch raises ``ValueError``), and masking is the global causal mask.
    Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) run in the plan's distributed attention (soft-capping
    of a packed batch with ``mode="ulysses"`` only). Refused with ``ValueError``: padding masks, sliding windows,
    soft-capping of a packed batch with a ring or hybrid plan, a KV cache holding earlier tokens, and
    ``"longattn_dilated"``/``"longattn_block_sparse"``. The setting is process-wide (not per thread) and ends with
    the block: run the backward inside it too (gradient checkpointing recomputes the attention there).
    """
    global _active
    if plan is None:
        from longattn.distributed import ContextParallel

        plan = ContextParallel(group, mode, ring_group=ring_group, ulysses_group=ulysses_group, mesh=mesh,
                               layout=layout, options=options)
    elif any(x is not None for x in (group, ring_group, ulysses_group, mesh, layout, options)) or mode != "ring":
        raise ValueError("context_parallel: pass plan (a ContextParallel) or its arguments, not both")
    else:
        from longattn.distributed import ContextParallel

        if not isinstance(plan, ContextParallel):
            raise TypeError(f"context_parallel: plan must be a longattn.distributed.ContextParallel, got "
                            f"{type(plan).__name__}")
    previous, _active = _active, plan
    try:
        yield plan
    finally:
        _active = previous
