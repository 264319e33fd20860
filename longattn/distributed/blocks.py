"""What the sequence-parallel schemes share around their blocks: the score modifications of a call, checked and
compared across ranks (:class:`ScoreMods`, :func:`with_score_mods`), packed shards checked
(:func:`packed_cu_seqlens`, :func:`check_packed_mods`), and partial results merged by log-sum-exp
(:func:`merge_into`), and the backend of a ring's blocks checked before the ring starts (:func:`check_block_backend`).
Used by the ring (:mod:`~longattn.distributed.ring`), Ulysses, the hybrid and the dilated ring alike; none of it
communicates.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from torch import Tensor

from longattn import _validation as V
from longattn import runner
from longattn.call import AttentionCall, merge_partial


def check_block_backend(backend: str, q: Tensor, scale: float, fn: str) -> None:
    """Raise the ``ValueError`` the first block of a ring would raise for ``backend`` on tensors like ``q`` (the
    blocks run explicit passes: ``backend='fa4'`` has none, ``'triton'`` needs a GPU and supported shapes). Called
    among a call's option checks, so that every rank raises before any sends: raised inside the ring, the error
    would leave the other ranks' messages posted and the group's next collective waiting."""
    runner.choose(backend, q, AttentionCall(scale), fn=fn)


class ScoreMods(NamedTuple):
    """The score modifications of a sequence-parallel call, checked: ``softcap`` (0: off), ALiBi slopes ``alibi``
    ``(B, Hq)`` (a row per sequence of a packed batch) or None, attention ``sinks`` ``(Hq,)`` or None (as
    :func:`longattn.flash_attention` takes them)."""

    softcap: float = 0.0
    alibi: Optional[Tensor] = None
    sinks: Optional[Tensor] = None

    def heads(self, first: int, n: int) -> "ScoreMods":
        """Those of query heads ``[first, first + n)`` (a Ulysses rank's heads); sinks sliced keep their graph."""
        return ScoreMods(self.softcap, *(None if t is None else t[..., first:first + n] for t in self[1:]))

    def kwargs(self) -> dict:
        """As the keyword arguments of :func:`longattn.flash_attention` and the sequence-parallel functions."""
        return dict(softcap=self.softcap, alibi_slopes=self.alibi, sinks=self.sinks)


def with_score_mods(options: dict, local_error: Optional[str], q: Tensor, fn: str, *, softcap, alibi_slopes,
                    sinks) -> Tuple[dict, ScoreMods, Optional[str]]:
    """The score modifications checked after the other options (``options``, or the error ``local_error``):
    ``(options with them, the modifications, None)`` or ``({}, no modifications, the error)``.

    The ranks compare them as they take effect: ``softcap``, and the values of ``alibi_slopes`` (one row per
    sequence) and ``sinks``, read to the host (a tensor's repr rounds them).
    """
    if local_error is not None:
        return {}, ScoreMods(), local_error
    cu, hq = options.get("cu_seqlens"), q.shape[-2]
    try:
        mods = ScoreMods(V.check_softcap(softcap, fn=fn),
                         V.check_alibi(alibi_slopes, q.shape[0] if cu is None else len(cu) - 1, hq, q.device, fn=fn),
                         V.check_sinks(sinks, hq, q.device, fn=fn))
    except (TypeError, ValueError) as e:
        return {}, ScoreMods(), str(e)
    values = {name: None if t is None else t.tolist() for name, t in (("alibi_slopes", mods.alibi),
                                                                       ("sinks", mods.sinks))}
    return {**options, "softcap": mods.softcap, **values}, mods, None


def rows_ordered(options: dict, mods: ScoreMods) -> bool:
    """Whether a call's result depends on the order of its rows (causal masking, ALiBi's distances, a packed batch's
    documents; ``options`` as :func:`with_score_mods` returns them): where shards read in another layout than they
    were cut in would give a wrong result (:func:`longattn.distributed.shards.cut_error`)."""
    return bool(options["causal"]) or mods.alibi is not None or options["cu_seqlens"] is not None


def check_packed_mods(mods: ScoreMods, fn: str) -> None:
    """Packed batches over a ring (:mod:`longattn.distributed.ring_varlen`) take attention sinks only."""
    for name, given in (("softcap", mods.softcap), ("alibi_slopes", mods.alibi is not None)):
        if given:
            raise NotImplementedError(f"{fn}: {name} is not supported with cu_seqlens (packed batches over a ring) "
                                      f"yet; use ulysses_attention, or batches of equal lengths")


def merge_into(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge a partial result ``(out, lse)`` into the accumulators ``(out_acc, lse_acc)`` (views, float32 or float64)
    in place, by :func:`longattn.call.merge_partial`. ``lse_acc``/``lse`` are shaped like ``out[..., 0]``."""
    merged, merged_lse = merge_partial(out_acc, lse_acc, out, lse)
    out_acc.copy_(merged)
    lse_acc.copy_(merged_lse)


def packed_cu_seqlens(q: Tensor, k: Tensor, v: Tensor, cu_seqlens, world: int, fn: str) -> List[int]:
    """Check packed shards ``(total/P, H, D)`` and the global ``cu_seqlens``; returns its boundaries."""
    V.check_packed_inputs(q, k, v, fn=fn)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{fn}: self-attention needs k and v shards as long as q's, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    return V.check_cu_seqlens(cu_seqlens, world * q.shape[0], "cu_seqlens", fn, q.device)
