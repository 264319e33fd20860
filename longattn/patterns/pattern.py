"""``BlockSparsePattern``: a block mask with its block size, and its kernel block lists converted once per device."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from longattn import _validation as V
from longattn._tracing import export_flag
from longattn.backends.device import interpret_mode
from longattn.patterns._grid import Grid, check_int

if TYPE_CHECKING:  # pragma: no cover
    from longattn.backends.triton.lists import BlockLists


def _device_key(device: Union[str, torch.device, None]) -> torch.device:
    """A canonical device (``"cuda"`` becomes ``cuda:<current>``) so cache keys do not depend on spelling."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _version_of(t: Tensor) -> Optional[int]:
    """``t``'s version counter, which every in-place write bumps; None (not checked) for an inference tensor, which
    has none, and under ``torch.compile`` tracing, which cannot read it."""
    return None if torch.compiler.is_compiling() or t.is_inference() else t._version


def _trackable(mask: Tensor) -> Tensor:
    """``mask``, or for an inference tensor (made under ``torch.inference_mode()``, which has no version counter: an
    in-place write into it cannot be seen) a copy made outside inference mode, whose writes can be. The pattern then
    keeps the mask as it was when taken, on every backend (without the copy, the Triton route kept the old mask's
    block lists while the PyTorch backend read the written mask)."""
    if torch.compiler.is_compiling() or not mask.is_inference():
        return mask
    with torch.inference_mode(False):
        return mask.clone()


_WRITTEN = -1  # a mask's recorded version once it was written in place (no version counter has it): refused for good


def _check_seq_lens(seq_lens, block_size: Tuple[int, int], mask: Tensor, fn: str, minimum: int) -> Tuple[int, int]:
    """``seq_lens`` as a pair ``(N, M)`` of ints ``>= minimum`` whose block grid is the mask's."""
    if not isinstance(seq_lens, (tuple, list)) or len(seq_lens) != 2:
        raise TypeError(f"{fn}: seq_lens must be a pair (N, M) of ints or None, got {seq_lens!r}")
    n, m = (check_int(int(x) if isinstance(x, torch.SymInt) else x, "seq_lens", fn, minimum) for x in seq_lens)
    grid = Grid(n, m, *block_size, 1, mask.device)
    if (grid.q_blocks, grid.k_blocks) != tuple(mask.shape[-2:]):
        raise ValueError(f"{fn}: seq_lens={tuple(seq_lens)} with block_size={block_size} needs a "
                         f"({grid.q_blocks}, {grid.k_blocks}) block grid; the mask has {tuple(mask.shape[-2:])}")
    return n, m


def _check_versions(made: List[Tuple[Tensor, int]]) -> None:
    """``RuntimeError`` naming the first mask of ``made`` whose version is no longer the one recorded."""
    for mask, version in made:
        if mask._version != version:
            raise RuntimeError(f"BlockSparsePattern: its mask {tuple(mask.shape)} on {mask.device} was modified "
                               f"in place after the pattern was made, and the pattern's cached conversions (block "
                               f"lists, device copies) would silently keep the old mask; build a new "
                               f"BlockSparsePattern for the new mask")


# The check as a node of a torch.compile graph: an operator of its own (not torch.library.custom_op, whose Python
# autograd wrapper made each run of the node 11 us against 3 us on a 2-core CPU), kept for what it raises; tagged
# unsafe for CUDA graphs (mode="reduce-overhead"), whose replays would skip its Python body: inductor runs it
# outside them (a graph partition, or no CUDA graph where its version cannot partition).
_LIB = torch.library.Library("longattn", "FRAGMENT")
_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)
_LIB.define("masks_unchanged(Tensor[] masks, int[] versions) -> ()", tags=() if _UNSAFE is None else (_UNSAFE,))


def _masks_unchanged(masks: List[Tensor], versions: List[int]) -> None:
    """:func:`_check_versions` as a node of a ``torch.compile`` graph (run with the graph's inputs, the masks
    themselves, whose version counters they share)."""
    _check_versions(list(zip(masks, versions)))


_LIB.impl("masks_unchanged", _masks_unchanged, "CompositeExplicitAutograd")
torch.library.register_fake("longattn::masks_unchanged", lambda masks, versions: None, lib=_LIB)
torch.fx.node.has_side_effect(torch.ops.longattn.masks_unchanged.default)


def _compiling_not_exporting() -> bool:
    """Whether ``torch.compile`` (not ``torch.export``, whose program keeps the block lists as constants, a snapshot
    as of its export, as it keeps a module's parameters) traces this call. False where PyTorch cannot tell the two
    apart (before 2.5: no ``torch.compiler.is_exporting``). It reads the flag that ``torch.export`` sets, not
    ``is_exporting()``: Dynamo up to PyTorch 2.11 traces that call as a constant True in ``torch.compile`` too, which
    left every compiled call without its check."""
    if getattr(torch.compiler, "is_exporting", None) is None:
        return False
    flag = export_flag()
    return not (torch.compiler.is_exporting() if flag is None else flag)


class BlockSparsePattern:
    """A bool block mask ``(B or 1, H or 1, q_blocks, k_blocks)`` bundled with its block size.

    Args:
        mask: bool tensor; query block ``a`` may attend to key block ``b`` where True (see
            :func:`longattn.block_sparse_attention`). Read-only once wrapped: conversions are cached, and a use of
            the pattern after an in-place write to its mask (or to a device copy's) is a ``RuntimeError``. A mask
            made under ``torch.inference_mode()`` (an inference tensor, whose writes cannot be detected) is copied:
            the pattern keeps it as it was, and later writes into the tensor given do not reach the pattern.
        block_size: ``block_q = block_k``, or a pair ``(block_q, block_k)``.
        seq_lens: the ``(N, M)`` the mask was built for, if known. It must fit the mask's grid. With it the block
            lists tell full blocks (no per-element mask needed) from partial ones; without it every allowed block
            is treated as partial, which is correct for any lengths of that grid but slower.

    :meth:`block_lists` converts the mask into the kernels' :class:`~longattn.backends.triton.lists.BlockLists` once per
    ``(device, causal)`` and caches the result, so a model can reuse one pattern across layers and steps (calls
    traced by ``torch.compile`` convert it inside their graph on every run and cache nothing);
    :meth:`to` returns the pattern on another device, sharing those caches.
    """

    def __init__(self, mask: Tensor, block_size: Union[int, Tuple[int, int]] = 128, *,
                 seq_lens: Optional[Tuple[int, int]] = None):
        fn = "BlockSparsePattern"
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{fn}: mask must be a bool torch.Tensor, got "
                            f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
        if mask.dim() != 4:
            raise ValueError(f"{fn}: mask must have 4 dims (B or 1, H or 1, q_blocks, k_blocks), got shape "
                             f"{tuple(mask.shape)}")
        self._block_size = V.check_block_size(block_size, fn)
        if seq_lens is not None:
            seq_lens = _check_seq_lens(seq_lens, self._block_size, mask, fn, 1)
        self._seq_lens = seq_lens
        mask = _trackable(mask)
        self._mask = mask
        self._copies: Dict[torch.device, "BlockSparsePattern"] = {_device_key(mask.device): self}
        self._lists: Dict[Tuple[torch.device, bool, Optional[Tuple[int, int]]], BlockLists] = {}
        self._full: Optional[bool] = None
        # the masks of this pattern and its device copies, with their versions when made (shared by the copies)
        self._made: List[Tuple[Tensor, Optional[int]]] = [(mask, _version_of(mask))]

    def __getstate__(self) -> dict:
        """The pattern's state for a copy or a pickle, a mask already written in place marked as such
        (:data:`_WRITTEN`): the copy's mask is a new tensor whose version counter starts afresh, and without the mark
        the copy (and, for ``copy.copy``, which shares the list, the original too) would take the written mask as
        unchanged and keep the old mask's block lists."""
        if not torch.compiler.is_compiling():
            self._made[:] = [(mask, _WRITTEN if version is not None and _version_of(mask) != version else version)
                             for mask, version in self._made]
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        """A copied or unpickled pattern (``copy.deepcopy``, ``torch.save``/``load`` of a module holding it): its
        masks are new tensors, whose version counters start afresh, so their versions are taken anew (a mask
        written in place before the copy stays refused, :meth:`__getstate__`)."""
        self.__dict__.update(state)
        made = state.get("_made", [(self._mask, None)])
        made[:] = [(mask, version if version == _WRITTEN else _version_of(mask)) for mask, version in made]
        self._made = made

    def _check_unchanged(self) -> None:
        """``RuntimeError`` where the mask, or a device copy's, was written in place since the pattern took it: the
        cached block lists, device copies and :attr:`is_full` would silently stay the old mask's (and backends would
        disagree: the PyTorch backend reads the mask itself). Under ``torch.compile`` tracing, which reads no version
        counter, the check is a node of the graph (:func:`_masks_unchanged`), made on every run of the compiled
        code: a graph traced after an eager call holds the block lists that call cached (one traced before converts
        the mask in the graph, :meth:`_block_lists`)."""
        made = [(mask, version) for mask, version in self._made if version is not None]
        if torch.compiler.is_compiling():
            if made and _compiling_not_exporting():
                torch.ops.longattn.masks_unchanged.default([mask for mask, _ in made], [v for _, v in made])
            return
        _check_versions(made)

    @property
    def mask(self) -> Tensor:
        """The bool block mask ``(B or 1, H or 1, q_blocks, k_blocks)``."""
        return self._mask

    @property
    def block_size(self) -> Tuple[int, int]:
        """``(block_q, block_k)``."""
        return self._block_size

    @property
    def seq_lens(self) -> Optional[Tuple[int, int]]:
        """``(N, M)`` the pattern was built for, or None if unknown."""
        return self._seq_lens

    @property
    def device(self) -> torch.device:
        return self._mask.device

    @property
    def is_full(self) -> bool:
        """Whether every block pair is allowed: then a call is plain (or causal) attention and runs the dense
        kernels, which walk key ranges instead of block lists. Computed once (one device sync)."""
        self._check_unchanged()
        return self._all_allowed()

    def _all_allowed(self) -> bool:
        """:attr:`is_full` without the mask check, which the caller made."""
        if self._full is None:
            self._full = bool(self._mask.all().item())
        return self._full

    def _dense_kernels(self) -> bool:
        """:attr:`is_full`, as the Triton route reads it to pick the dense kernels, without the mask check, which
        the caller made (:meth:`to`: one check a call, a node of the graph under ``torch.compile``); under
        ``torch.compile`` tracing, where reading the mask is a graph break (which ``fullgraph=True`` refuses), False
        until an eager call has computed it: the block lists serve any mask, at 0.81-0.93x the dense kernels' speed
        where it allows every block pair (docs/kernel_notes.md)."""
        if self._full is None and torch.compiler.is_compiling():
            return False
        return self._all_allowed()

    @property
    def density(self) -> float:
        """Fraction of the mask's entries that are True: allowed block pairs over all block pairs of the grid,
        averaged over the stored batch and head dims. Every block pair counts once, including the smaller ones at
        a ragged end; the causal band is not taken into account (see :attr:`causal_density`)."""
        return int(self._mask.sum().item()) / self._mask.numel() if self._mask.numel() else 0.0

    @property
    def causal_density(self) -> float:
        """Allowed block pairs among those a causal call can visit (the pairs the bottom-right causal band does
        not hide entirely): the fraction of a causal dense kernel's blocks that a causal call visits. Needs
        :attr:`seq_lens`."""
        if self._seq_lens is None:
            raise ValueError("BlockSparsePattern.causal_density: needs seq_lens, which this pattern was built "
                             "without")
        visible = Grid(*self._seq_lens, *self._block_size, 1, self.device).causal()
        total = visible.sum() * self._mask.shape[0] * self._mask.shape[1]
        return float(((self._mask & visible).sum() / total).item()) if total else 0.0

    def to(self, device: Union[str, torch.device]) -> "BlockSparsePattern":
        """This pattern with its mask on ``device`` (the copy is made once; block-list caches are shared)."""
        self._check_unchanged()
        return self._to(device)

    def _to(self, device: Union[str, torch.device]) -> "BlockSparsePattern":
        """:meth:`to` without the mask check, which the caller made."""
        key = _device_key(device)
        copy = self._copies.get(key)
        if copy is None:
            copy = BlockSparsePattern.__new__(BlockSparsePattern)
            copy._mask = _trackable(self._mask.to(key))
            copy._block_size, copy._seq_lens, copy._full = self._block_size, self._seq_lens, self._full
            copy._copies, copy._lists, copy._made = self._copies, self._lists, self._made
            if torch.compiler.is_compiling():  # (not kept: see _block_lists)
                return copy
            self._made.append((copy._mask, _version_of(copy._mask)))
            self._copies[key] = copy
        return copy

    def block_lists(self, device: Union[str, torch.device, None] = None, *, causal: bool = False,
                    seq_lens: Optional[Tuple[int, int]] = None, backward: bool = True) -> BlockLists:
        """The kernels' block lists of the mask for calls with this ``causal``, on ``device`` (default: the mask's
        device), computed on the first call and cached.

        The lists are exactly those :func:`longattn.backends.triton.lists.block_lists_from_mask` gives for
        ``(block_size, lengths, causal)``, the lengths being :attr:`seq_lens` or, for a pattern built without them, the
        ``seq_lens=(N, M)`` given here; they are valid only for inputs of those lengths. With no lengths at all
        every allowed block is listed as partial (masked by the kernels), which is valid for any lengths.
        ``backward=False`` may leave out the transposed lists, which only the backward reads (a cached conversion
        with them serves too).
        """
        causal = V.check_flag(causal, "causal", "BlockSparsePattern.block_lists")
        self._check_unchanged()
        return self._block_lists(device, causal, seq_lens, backward)

    def _block_lists(self, device: Union[str, torch.device, None], causal: bool,
                     seq_lens: Optional[Tuple[int, int]], backward: bool) -> BlockLists:
        """:meth:`block_lists` without the mask check, which the caller made."""
        if self._seq_lens is not None:
            if seq_lens is not None and tuple(seq_lens) != self._seq_lens:
                raise ValueError(f"BlockSparsePattern.block_lists: seq_lens={tuple(seq_lens)} differs from the "
                                 f"pattern's {self._seq_lens}")
            seq_lens = self._seq_lens
        elif seq_lens is not None:  # lists for lengths of another grid would be silently wrong
            seq_lens = _check_seq_lens(seq_lens, self._block_size, self._mask, "BlockSparsePattern.block_lists", 0)
        key = (_device_key(self.device if device is None else device), bool(causal), seq_lens)
        lists = self._lists.get(key)
        if lists is None and not backward:
            lists = self._lists.get(key + ("forward",))
        if lists is None:
            if key[0].type != "cuda" and not interpret_mode():
                raise ValueError("BlockSparsePattern.block_lists: block lists are the Triton kernels' form and are "
                                 "built by a Triton kernel: they need a CUDA device (or TRITON_INTERPRET=1)")
            from longattn.backends.triton.lists import block_lists_from_mask

            mask = self._to(key[0]).mask
            if seq_lens is None:
                lists = block_lists_from_mask(mask, backward=backward)
            else:
                lists = block_lists_from_mask(mask, self._block_size, seq_lens, bool(causal), backward=backward)
            # Lists (and device copies) made inside a torch.compile graph are its outputs, not kept here: under CUDA
            # graphs (mode="reduce-overhead") the next replay writes over an output, so a kept one would be
            # refused by PyTorch's check on the next call, or read stale by an eager one. Traced calls convert
            # the mask in the graph on every run; eager calls (or one before compiling) fill the cache.
            if not torch.compiler.is_compiling():
                self._lists[key if backward else key + ("forward",)] = lists
        return lists

    def __repr__(self) -> str:
        """The mask's shape, block size, lengths, density and device; the density left out for a mask whose values
        cannot be read (on the ``meta`` device, or fake under tracing)."""
        density = f", density={self.density:.3f}" if V.has_values(self._mask) else ""
        return (f"BlockSparsePattern(shape={tuple(self._mask.shape)}, block_size={self._block_size}, "
                f"seq_lens={self._seq_lens}{density}, device={self.device})")
