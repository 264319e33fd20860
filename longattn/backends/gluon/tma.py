"""What the Gluon kernels' tensor descriptors (TMA) need of a tensor, shared by the launchers and the kernels'
modules."""
from __future__ import annotations

from typing import Optional

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


def bhnd_descriptor(t: Tensor, rows: int, layout, cols: Optional[int] = None):
    """A host-side TMA descriptor (Gluon's ``TensorDescriptor``) of ``t`` ``(B, N, H, D)`` read as ``(B, H, N, D)``,
    in boxes of ``rows`` rows of one batch row and head by ``cols`` columns (default all of D), with ``t``'s own
    strides (:func:`box_strides`); ``layout`` the shared-memory layout (a ``gl.constexpr`` or the layout itself). The
    kernels' loads and stores then take coordinates ``[b, h, row, col]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, N, H, D = t.shape
    sb, sn, sh = box_strides(t)
    return TensorDescriptor(t, [B, H, N, D], [sb, sh, sn, 1], [1, 1, rows, D if cols is None else cols],
                            getattr(layout, "value", layout))


def matrix_descriptor(t: Tensor, box: tuple, layout):
    """A host-side TMA descriptor of the row-major matrix ``t`` ``(rows, cols)``, in boxes of ``box = (rows,
    cols)`` (the backward's statistics: two rows of ``BLOCK_M`` columns)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(box), getattr(layout, "value", layout))
