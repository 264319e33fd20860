"""What the Gluon kernels' tensor descriptors (TMA) need of a tensor, shared by the launchers and the kernels'
modules."""
from __future__ import annotations

from torch import Tensor


def aligned(t: Tensor) -> bool:
    """TMA's needs: unit stride along the head dim, 16-byte aligned base, positive 16-byte multiples as the other
    strides (of dims longer than one: the others are not used, see :func:`box_strides`)."""
    stride, shape = t.stride(), t.shape
    if stride[-1] != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()  # (written out: a launch asks for four tensors)
    return ((shape[0] == 1 or (stride[0] > 0 and stride[0] * size % 16 == 0))
            and (shape[1] == 1 or (stride[1] > 0 and stride[1] * size % 16 == 0))
            and (shape[2] == 1 or (stride[2] > 0 and stride[2] * size % 16 == 0)))


def box_strides(t: Tensor) -> tuple:
    """Batch, row and head strides of ``t`` for a 4-D descriptor; a dim of length one (whose stride nothing reads,
    and may be anything) gets an aligned stand-in, the head dim, as descriptors check every stride."""
    stride, shape = t.stride(), t.shape
    d = shape[-1]
    return (stride[0] if shape[0] > 1 else d, stride[1] if shape[1] > 1 else d, stride[2] if shape[2] > 1 else d)
