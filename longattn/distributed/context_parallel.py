"""Context parallelism for training a model on one sequence split over the ranks of a process group.

:class:`ContextParallel` is the plan every rank builds the same way: which ranks hold the sequence (one ``group``,
or a ring group and a Ulysses group), which distributed attention runs (``mode``: :func:`ring_attention`,
:func:`ulysses_attention` or :func:`hybrid_attention`) and how the sequence is cut (``layout``). From the whole
batch, which every rank passes, :meth:`ContextParallel.shard_batch` gives this rank's tokens, positions and
next-token labels; the model's attention calls :meth:`ContextParallel.attention` on its shards (the transformers
plug-in does so inside ``longattn.integrations.transformers.context_parallel``); :meth:`ContextParallel.reduce_loss`
and :meth:`ContextParallel.all_reduce_gradients` turn the ranks' local results into those of one process running the
whole sequence. See ``docs/context_parallel.md``.

The loss: a mean over the predicted tokens of the *whole* sequence is ``sum of the ranks' sums / global count``.
:meth:`shard_batch` shifts the labels for next-token prediction before cutting (each shard's last token keeps its
target, the first token of the next shard) and counts the global targets (``num_items_in_batch``), so each rank's loss
is ``its sum / global count``; the ranks' losses and parameter gradients add up to the whole sequence's.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longattn import _validation as V
from longattn.distributed.hybrid import hybrid_attention, hybrid_groups, shard_hybrid
from longattn.distributed.options import ParallelOptions, check_options
from longattn.distributed.ring import ring_attention
from longattn.distributed.shards import LAYOUTS, check_same_across_ranks, collective_device, group_size_rank, shard
from longattn.distributed.ulysses import ulysses_attention


class Scheme(NamedTuple):
    """A sequence-parallel scheme as :class:`ContextParallel` runs it (data: a new scheme is a row of
    :data:`SCHEMES`)."""

    attention: Callable  # the distributed attention function
    grid: bool  # two groups (ring_group x ulysses_group, or a 2-D mesh) instead of one group
    layout: str  # the layout of an unpacked sequence when the plan names none (passed to the function explicitly)
    packed_layout: str  # the layout of a packed batch when the plan names none
    packed_softcap: bool  # whether it soft-caps a packed batch
    shard: Callable  # (plan, x, layout, dim) -> this rank's part of x (an unpacked batch, or a contiguous packed one)

    def groups(self, plan: "ContextParallel") -> Dict[str, Any]:
        """The attention function's group arguments for ``plan``."""
        if self.grid:
            return {"ring_group": plan.ring_group, "ulysses_group": plan.ulysses_group}
        return {"group": plan.group}


def _shard_group(plan: "ContextParallel", x: Tensor, layout: str, dim: int) -> Tensor:
    return shard(x, plan.group, layout, dim)


def _shard_grid(plan: "ContextParallel", x: Tensor, layout: str, dim: int) -> Tensor:
    return shard_hybrid(x, plan.ring_group, plan.ulysses_group, layout, dim)


SCHEMES: Dict[str, Scheme] = {
    "ring": Scheme(ring_attention, grid=False, layout="zigzag", packed_layout="balanced", packed_softcap=False,
                   shard=_shard_group),
    "ulysses": Scheme(ulysses_attention, grid=False, layout="contiguous", packed_layout="contiguous",
                      packed_softcap=True, shard=_shard_group),
    "hybrid": Scheme(hybrid_attention, grid=True, layout="zigzag", packed_layout="contiguous", packed_softcap=False,
                     shard=_shard_grid),
}
MODES = tuple(SCHEMES)
IGNORE_INDEX = -100
TOKEN_KEYS = ("input_ids", "inputs_embeds")
BATCH_KEYS = TOKEN_KEYS + ("attention_mask", "position_ids", "labels", "shift_labels", "cu_seq_lens_q",
                           "cu_seq_lens_k", "max_length_q", "max_length_k")


class ContextParallel:
    """How a sequence is split over ranks for training, and the attention that runs on the shards.

    Args:
        group: the ranks of ``mode="ring"`` or ``"ulysses"`` (default: the world).
        mode: ``"ring"`` (:func:`~longattn.distributed.ring_attention`), ``"ulysses"``
            (:func:`~longattn.distributed.ulysses_attention`, the query heads divisible by the group size) or
            ``"hybrid"`` (:func:`~longattn.distributed.hybrid_attention`: Ulysses inside ``ulysses_group``, ring
            across ``ring_group``).
        ring_group, ulysses_group: this rank's two groups of ``mode="hybrid"``; or ``mesh``, a 2-D ``DeviceMesh``
            (dimension 0 the ring, 1 Ulysses).
        layout: how an unpacked sequence is cut, ``"zigzag"`` or ``"contiguous"``; ``None``: the scheme's
            (``"zigzag"`` for ring and hybrid, ``"contiguous"`` for Ulysses; the plan passes it to both its cut and
            its calls). A packed batch
            (several documents in one row) is cut contiguously, as the distributed functions need, except with
            ``mode="ring"`` and ``layout=None``: there in the ``"balanced"`` layout of
            :func:`~longattn.distributed.shard` (documents dealt out whole where that balances the causal work, the
            longest cut in ``2P`` chunks), which :func:`~longattn.distributed.ring_attention` takes.
        options: how the plan's attention runs (:class:`~longattn.distributed.ParallelOptions`: the transport,
            Ulysses' head groups, how the cross-rank checks exchange, the copy engines' timeout), passed to every
            call; ``None``: the defaults. The same on every rank.

    :meth:`attention` passes logit soft-capping and attention sinks through to the distributed function (all three
    take both), except soft-capping of a packed batch, which only ``mode="ulysses"`` runs.

    Every rank of the group(s) builds the plan with the same arguments (the attention calls check it). Raises
    ``RuntimeError`` if ``torch.distributed`` is not initialized.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, mode: str = "ring", *,
                 ring_group: Optional[dist.ProcessGroup] = None, ulysses_group: Optional[dist.ProcessGroup] = None,
                 mesh=None, layout: Optional[str] = None, options: Optional[ParallelOptions] = None):
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"ContextParallel: mode must be one of {MODES}, got {mode!r}")
        if layout is not None and (not isinstance(layout, str) or layout not in LAYOUTS):
            raise ValueError(f"ContextParallel: layout must be None or one of {LAYOUTS}, got {layout!r}")
        self.options = check_options(options, "ContextParallel")
        self.scheme = SCHEMES[mode]
        if self.scheme.grid:
            if group is not None:
                raise ValueError(f"ContextParallel: mode={mode!r} takes ring_group and ulysses_group (or mesh), not "
                                 "group")
            ring_group, ulysses_group = hybrid_groups(ring_group, ulysses_group, mesh, "ContextParallel")
            self.groups = (ulysses_group, ring_group)  # (Ulysses first: the order of the checks)
        else:
            if ring_group is not None or ulysses_group is not None or mesh is not None:
                raise ValueError(f"ContextParallel: mode={mode!r} splits over group; ring_group, ulysses_group and "
                                 "mesh are for " + " or ".join(f"mode={m!r}" for m, s in SCHEMES.items() if s.grid))
            self.groups = (group,)
        self.mode, self.group, self.ring_group, self.ulysses_group = mode, group, ring_group, ulysses_group
        self.layout = layout
        # a batch cut by shard_batch that no attention of this plan has seen yet: a model whose attention is not the
        # plan's (another attn_implementation, a call outside the plan's block) attends within each shard only
        self._unattended = False
        self.size = 1
        for g in self.groups:
            self.size *= group_size_rank(g, "ContextParallel: group")[0]

    def __repr__(self) -> str:
        extra = "" if self.options == ParallelOptions() else f", options={self.options!r}"
        return f"ContextParallel(mode={self.mode!r}, size={self.size}, layout={self.layout!r}{extra})"

    def layout_for(self, packed: bool) -> str:
        """The layout of an unpacked sequence, or of a packed batch: the scheme's packed layout (``"balanced"`` for a
        ring plan) without a layout, else ``"contiguous"`` (raises ``ValueError`` if the plan's layout is
        ``"zigzag"``)."""
        if not packed:
            return self.layout or self.scheme.layout
        if self.layout not in (None, "contiguous"):
            raise ValueError(f"context parallelism: a packed batch (cu_seq_lens_q/k, or position_ids restarting) is "
                             f"cut contiguously (a ring plan without a layout: balanced); the plan's layout must be "
                             f"None or 'contiguous', got {self.layout!r}")
        return self.scheme.packed_layout if self.layout is None else "contiguous"

    def multiple(self, packed: bool = False) -> int:
        """What the sequence length must be a multiple of: the ranks, twice that for the zigzag layout."""
        return self.size * (2 if self.layout_for(packed) == "zigzag" else 1)

    def take(self, x: Tensor, dim: int = 1, packed: bool = False, *, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """This rank's part of the full tensor ``x`` along ``dim`` (every rank passes the same ``x``):
        :func:`~longattn.distributed.shard` or :func:`~longattn.distributed.shard_hybrid` in the plan's layout.
        ``cu_seqlens``: ``x`` is a packed batch with these global boundaries (``packed`` then need not be given;
        the balanced layout needs them)."""
        layout = self.layout_for(packed or cu_seqlens is not None)
        if layout == "balanced":
            if cu_seqlens is None:
                raise ValueError("ContextParallel.take: a packed batch in the balanced layout needs its cu_seqlens")
            return shard(x, self.group, layout, dim, cu_seqlens=cu_seqlens)
        return self.scheme.shard(self, x, layout, dim)

    def positions(self, n_local: int, cu_seqlens: Optional[Tensor] = None, device=None) -> Tensor:
        """The ``position_ids`` (int64 ``(n_local,)``) of this rank's rows as :meth:`shard_batch` gives them by
        default: their global positions, or with ``cu_seqlens`` (a packed batch) their positions in their
        documents."""
        rows = self.take(torch.arange(n_local * self.size, device=device), 0, cu_seqlens=cu_seqlens)
        return rows if cu_seqlens is None else _in_documents(rows, cu_seqlens)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: Optional[float] = None,
                  backend: str = "auto", cu_seqlens: Optional[Tensor] = None, softcap: float = 0.0,
                  sinks: Optional[Tensor] = None) -> Tensor:
        """This rank's shard of attention over the whole sequence: ``q (B, n, Hq, D)``, ``k``/``v (B, n, Hk, D)``
        this rank's rows (with ``cu_seqlens``, the global boundaries of a packed batch: ``(n, H, D)``). ``softcap``
        and ``sinks ((Hq,))``: logit soft-capping and attention sinks, as in :func:`longattn.flash_attention` (the
        gradient of ``sinks`` is this rank's share: :meth:`all_reduce_gradients` sums it). A packed batch is
        soft-capped by ``mode="ulysses"`` only (``ValueError`` otherwise). Collective (every rank of the plan calls
        it); differentiable. ``cu_seqlens``, host reads: its values are read on the host on every call for a CPU
        tensor, once per tensor object, version counter and data pointer for a CUDA one; a write into the same
        memory that bypasses the version counter (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is
        not seen (see :func:`longattn.remember_host_reads`)."""
        if cu_seqlens is not None and softcap and not self.scheme.packed_softcap:
            able = " or ".join(repr(m) for m, s in SCHEMES.items() if s.packed_softcap)
            raise ValueError(f"ContextParallel.attention: logit soft-capping (softcap={softcap}) of a packed batch "
                             f"(cu_seqlens) runs with mode={able} only, not mode={self.mode!r}; use a Ulysses "
                             f"plan, or unpacked batches")
        layout = self.layout_for(cu_seqlens is not None)
        self._unattended = False
        return self.scheme.attention(q, k, v, **self.scheme.groups(self), layout=layout, causal=causal, scale=scale,
                                     backend=backend, cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks,
                                     options=self.options)

    def shard_batch(self, batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> Dict[str, Any]:
        """This rank's part of a whole training batch (every rank passes the same one), for ``model(**part)``.

        ``batch`` holds ``input_ids`` or ``inputs_embeds`` ``(B, N, ...)``, and optionally ``labels`` (unshifted,
        as transformers' causal LMs take them) or ``shift_labels`` (already shifted), ``position_ids`` (default
        ``0 .. N-1``; with ``cu_seq_lens_q/k``, each document's ``0 .. length - 1`` as :meth:`positions` gives
        them), an ``attention_mask`` without zeros (padding is refused: pack the batch instead), and a packed
        batch's ``cu_seq_lens_q``/``cu_seq_lens_k`` (or ``position_ids`` restarting at each document, as
        ``DataCollatorWithFlattening`` gives them; then ``B`` must be 1). An unpacked batch's ``position_ids`` may
        start past 0 (a window of a longer text: ``c .. c + N - 1``, one ``c >= 0`` per row). ``N`` must be a
        multiple of :meth:`multiple`.

        Returns ``input_ids``/``inputs_embeds`` and ``position_ids`` cut for this rank; with labels, ``labels`` and
        ``shift_labels``, both this rank's part of the labels shifted over the whole sequence (``ignore_index`` at
        the last position), and ``num_items_in_batch``, the whole sequence's count of targets: transformers'
        causal-LM loss then returns this rank's sum over the global count. For a packed batch also the global
        ``cu_seq_lens_q``/``cu_seq_lens_k`` (one tensor) and any ``max_length_q/k`` given.
        """
        fn = "ContextParallel.shard_batch"
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"{fn}: ignore_index must be an int, got {ignore_index!r}")
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if unknown:
            raise ValueError(f"{fn}: unknown batch keys {unknown}; allowed: {list(BATCH_KEYS)}")
        given = [key for key in TOKEN_KEYS if batch.get(key) is not None]
        if len(given) != 1:
            raise ValueError(f"{fn}: the batch must hold exactly one of input_ids and inputs_embeds, got {given}")
        tokens = batch[given[0]]
        if not isinstance(tokens, Tensor) or tokens.dim() < 2:
            raise ValueError(f"{fn}: {given[0]} must be a tensor (batch, seq, ...)")
        rows, n = tokens.shape[:2]
        mask = batch.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError(f"{fn}: attention_mask has zeros (a padded batch); context parallelism takes no padding: "
                             f"pack the sequences into one row instead (DataCollatorWithFlattening)")
        position_ids = batch.get("position_ids")
        if position_ids is not None and (not isinstance(position_ids, Tensor) or position_ids.dim() != 2
                                         or position_ids.shape[1] != n or position_ids.shape[0] not in (1, rows)):
            raise ValueError(f"{fn}: position_ids must be ({rows} or 1, {n}) like the tokens, got "
                             f"{tuple(position_ids.shape) if isinstance(position_ids, Tensor) else position_ids!r}")
        cu = _documents(batch, position_ids, n, fn)
        packed = cu is not None
        if position_ids is None:  # one process's positions: 0 .. N-1, or each document's from 0 (as the collator's)
            position_ids = torch.arange(n, device=tokens.device)
            position_ids = (position_ids if cu is None else _in_documents(position_ids, cu))[None]
        if packed and rows != 1:
            raise ValueError(f"{fn}: a packed batch (cu_seq_lens_q/k, or position_ids restarting inside a row) must "
                             f"be one row (1, total), got {rows} rows")
        multiple = self.multiple(packed)
        if n % multiple:
            raise ValueError(f"{fn}: the sequence length ({n}) must be a multiple of {multiple} ({self.size} ranks"
                             f"{', zigzag layout' if multiple != self.size else ''}); pad it (a packed batch: append a "
                             f"document whose labels are {ignore_index})")
        out: Dict[str, Any] = {given[0]: self.take(tokens, 1, packed, cu_seqlens=cu),
                               "position_ids": self.take(position_ids, 1, packed, cu_seqlens=cu)}
        labels = _shifted_labels(batch, tokens, ignore_index, fn)
        if labels is not None:
            out["labels"] = out["shift_labels"] = self.take(labels, 1, packed, cu_seqlens=cu)
            out["num_items_in_batch"] = (labels != ignore_index).sum()
        if packed:
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
            out.update({key: batch[key] for key in ("max_length_q", "max_length_k") if key in batch})
        self._unattended = True
        return out

    def _unattended_error(self, fn: str) -> Optional[str]:
        """Why this rank's loss or gradients are not the whole sequence's (None when nothing says so): a batch was
        cut by :meth:`shard_batch` and no attention of this plan (:meth:`attention`) ran since."""
        if not self._unattended:
            return None
        return (f"{fn}: a batch was cut by shard_batch but no attention of this plan has run since, so the model "
                "attended within each rank's shard only and its loss and gradients are not the whole sequence's: "
                "run the model inside `with context_parallel(...)` with attn_implementation=\"longattn\" (a model "
                "built from a config object another model shares may have been switched to another "
                "implementation), or call ContextParallel.attention from a model's own attention")

    def reduce_loss(self, loss: Tensor) -> Tensor:
        """The whole sequence's loss from this rank's (``its sum / global count``): the sum over the ranks,
        detached, on every rank (collective). ``ValueError`` (on every rank, before any communication) if a batch
        was cut by :meth:`shard_batch` and no attention of this plan ran since: that loss is not the whole
        sequence's."""
        error = self._unattended_error("ContextParallel.reduce_loss")
        if error is not None:  # (every rank cut the same batch and ran the same model: all raise here)
            raise ValueError(error)
        return self._sum(loss.detach().clone())

    def all_reduce_gradients(self, parameters: Union[nn.Module, Iterable[Tensor]]) -> None:
        """Sum the ``.grad`` of ``parameters`` (a module's, or the tensors given) over the ranks, in place
        (collective; every rank passes the same parameters): after each rank's ``loss.backward()``, the gradient of
        the whole sequence's loss. A parameter without a gradient on every rank keeps none; one that has a gradient
        on some ranks only (a mixture-of-experts' expert no token of this rank's shard was routed to, a layer
        skipped on one rank) counts as zeros where it has none, and every rank gets the sum, as one process
        running the whole sequence would. Costs one all-reduce of a flag per parameter besides the gradients'.
        Raises ``ValueError`` on every rank if the ranks pass different numbers of parameters, or if a batch was cut
        by :meth:`shard_batch` and no attention of this plan ran since (those gradients are not the whole
        sequence's)."""
        fn = "ContextParallel.all_reduce_gradients"
        params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        bad = next((type(p).__name__ for p in params if not isinstance(p, Tensor)), None)
        error = (f"{fn}: parameters must be tensors (or an nn.Module), got a {bad}" if bad is not None
                 else self._unattended_error(fn))
        self.check_together(error, fn, same={"number of parameters": len(params)})
        if not params:
            return
        # whether some rank holds a gradient of each parameter: ranks skipping different parameters would pair
        # unrelated all-reduces (a wrong sum where the shapes match, a hang or a crash where they do not)
        held = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                            device=collective_device(self.groups[0]))
        self._sum(held, op=dist.ReduceOp.MAX)
        for p, some in zip(params, held.tolist()):
            if not some:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._sum(p.grad)

    def check_together(self, local_error: Optional[str], fn: str, same: Optional[Mapping[str, Any]] = None) -> None:
        """Raise ``ValueError`` on every rank of the plan if ``local_error`` (this rank's finding, or None) is not
        None on some rank, naming each failing rank's, or if the values of ``same`` (name to value, compared by
        ``repr``) differ across the ranks, naming each rank's (collective: one all-gather of two integers per
        group)."""
        for g in self.groups:  # a failure found inside the first group becomes this rank's error in the next
            try:
                check_same_across_ranks(g, {}, fn=fn, options=same, local_error=local_error,
                                        host_checks=self.options.host_checks)
            except ValueError as e:
                local_error = str(e)
        if local_error is not None:
            raise ValueError(local_error)

    def _sum(self, t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        for g in self.groups:
            dist.all_reduce(t, op=op, group=g)
        return t


def _in_documents(rows: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The positions of the global ``rows`` (int64) of a packed batch in their documents (``cu_seqlens``)."""
    starts = cu_seqlens.to(device=rows.device, dtype=torch.int64)
    return rows - starts[torch.searchsorted(starts, rows, right=True) - 1]


def _documents(batch: Mapping[str, Any], position_ids: Optional[Tensor], n: int, fn: str) -> Optional[Tensor]:
    """The global ``cu_seqlens`` of a packed batch of ``n`` rows: the batch's ``cu_seq_lens_q/k`` (checked), else
    where ``position_ids`` restart (transformers' rule for packed batches); None for an unpacked one."""
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k):
            raise ValueError(f"{fn}: cu_seq_lens_q and cu_seq_lens_k must be given together and be equal "
                             f"(self-attention over the same documents)")
        V.check_cu_seqlens(cu_q, n, "cu_seq_lens_q", fn)
        return cu_q
    if position_ids is None:
        return None
    restarts = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if not bool(restarts.any()):
        return None
    if position_ids.shape[0] != 1:
        raise ValueError(f"{fn}: a packed batch (position_ids restarting inside a row) must be one row (1, total), "
                         f"got position_ids of shape {tuple(position_ids.shape)}")
    starts = restarts[0].nonzero().squeeze(1) + 1
    return torch.cat([starts.new_zeros(1), starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)


def _shifted_labels(batch: Mapping[str, Any], tokens: Tensor, ignore_index: int, fn: str) -> Optional[Tensor]:
    """The batch's next-token targets ``(B, N)``: ``shift_labels`` as given, or ``labels`` shifted left by one over
    the whole sequence with ``ignore_index`` at the end (what transformers' causal-LM loss does on one process)."""
    labels, shifted = batch.get("labels"), batch.get("shift_labels")
    if labels is not None and shifted is not None:
        raise ValueError(f"{fn}: pass labels (unshifted) or shift_labels (shifted), not both")
    given = shifted if shifted is not None else labels
    if given is None:
        return None
    if not isinstance(given, Tensor) or tuple(given.shape) != tuple(tokens.shape[:2]):
        name = "shift_labels" if shifted is not None else "labels"
        raise ValueError(f"{fn}: {name} must be a tensor of shape {tuple(tokens.shape[:2])} like the tokens, got "
                         f"{tuple(given.shape) if isinstance(given, Tensor) else type(given).__name__}")
    if shifted is not None:
        return shifted
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)
