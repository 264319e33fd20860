"""The three CUDA driver calls of the copy-engine transfers (:mod:`longattn.distributed.copy_engine`), through
cuda-python's typed bindings (``cuda.bindings.driver``; ``pip install cuda-python``): a strided device-to-device
copy on a stream (``cuMemcpy2DAsync``, which runs on a copy engine) and a 64-bit flag written or waited for by a
stream (``cuStreamWriteValue64`` / ``cuStreamWaitValue64``). Where the bindings do not import, :func:`load` says
why and the copy engines are not offered (NCCL carries the transfers).

Flags are 64-bit: the driver's greater-or-equal wait compares cyclically (``(int64)(*addr - value) >= 0``), which
over 64 bits no call count reaches; over 32 bits a slot left unwritten for 2^31 calls would look written.
"""
from __future__ import annotations

from typing import Optional


def _bindings():
    """``cuda.bindings.driver`` (cuda-python >= 12.6), or the older ``cuda.cuda``."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6
    return driver


class Driver:
    """The driver calls on raw addresses and stream handles (integers, as PyTorch gives them). Each raises
    ``RuntimeError`` naming the call and the driver's error where the driver refuses it."""

    def __init__(self, cu=None):
        self.cu = cu if cu is not None else _bindings()

    def check(self, what: str, result) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if err != self.cu.CUresult.CUDA_SUCCESS:
            got = self.cu.cuGetErrorName(err)
            name = got[1].decode() if got[0] == self.cu.CUresult.CUDA_SUCCESS and got[1] else str(err)
            raise RuntimeError(f"copy engine transfer: {what} failed with {name}")

    def memcpy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                 stream: int) -> None:
        """Copy ``height`` rows of ``width`` bytes from ``src`` (rows ``src_pitch`` bytes apart) to ``dst``
        (``dst_pitch`` apart), device memory to device memory, queued on ``stream``."""
        cu = self.cu
        c = cu.CUDA_MEMCPY2D()
        c.srcMemoryType = c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.srcDevice, c.srcPitch = src, src_pitch
        c.dstDevice, c.dstPitch = dst, dst_pitch
        c.WidthInBytes, c.Height = width, height
        self.check("cuMemcpy2DAsync", cu.cuMemcpy2DAsync(c, stream))

    def write(self, stream: int, address: int, value: int) -> None:
        """``*address = value`` (64 bits) once ``stream`` reaches it, after the stream's earlier writes."""
        flag = self.cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.check("cuStreamWriteValue64", self.cu.cuStreamWriteValue64(stream, address, value, flag))

    def wait(self, stream: int, address: int, value: int) -> None:
        """``stream`` waits until ``*address >= value`` (64 bits)."""
        flag = self.cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.check("cuStreamWaitValue64", self.cu.cuStreamWaitValue64(stream, address, value, flag))


_DRIVER: Optional[Driver] = None


def load() -> Driver:
    """The process's :class:`Driver`, made on first use; ``ImportError`` (saying what to install) where the
    bindings do not import."""
    global _DRIVER
    if _DRIVER is None:
        try:
            _DRIVER = Driver()
        except ImportError as e:
            raise ImportError("longattn's copy-engine transfers call the CUDA driver through cuda-python "
                              f"(pip install cuda-python), which does not import here: {e}") from e
    return _DRIVER
