"""What the Gluon kernels' tensor descriptors (TMA) need of a tensor, shared by the launchers and the kernels'
modules."""
from __future__ import annotations

from torch import Tensor


def aligned(t: Tensor) -> bool:
    """TMA's needs: unit stride along the head dim, 16-byte aligned base, positive 16-byte multiples as the other
    strides (of dims longer than one: the others are not used, see :func:`box_strides`)."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(t.shape[i] == 1 or (t.stride(i) > 0 and (t.stride(i) * size) % 16 == 0) for i in (0, 1, 2))


def box_strides(t: Tensor) -> tuple:
    """Batch, row and head strides of ``t`` for a 4-D descriptor; a dim of length one (whose stride nothing reads,
    and may be anything) gets an aligned stand-in, the head dim, as descriptors check every stride."""
    stand_in = t.shape[-1]
    return tuple(t.stride(i) if t.shape[i] > 1 else stand_in for i in (0, 1, 2))
