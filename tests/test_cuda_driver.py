"""The copy engines' driver calls (longattn.distributed.cuda_driver) hand cuda-python's bindings what the CUDA
driver API defines, and name the call and the driver's error when it refuses; here on a stand-in of the bindings
(the real ones run in tests/gpu)."""
import enum
import types

import pytest

from longattn.distributed.cuda_driver import Driver


class _Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


def _bindings(fail: str = ""):
    calls = []

    class Memcpy2D:
        pass

    def call(name):
        def f(*args):
            calls.append((name, args))
            return (_Result.CUDA_ERROR_INVALID_VALUE if name == fail else _Result.CUDA_SUCCESS,)
        return f

    cu = types.SimpleNamespace(
        CUresult=_Result, CUDA_MEMCPY2D=Memcpy2D,
        CUmemorytype=types.SimpleNamespace(CU_MEMORYTYPE_DEVICE="device"),
        CUstreamWriteValue_flags=types.SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0),
        CUstreamWaitValue_flags=types.SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=0),
        cuGetErrorName=lambda err: (_Result.CUDA_SUCCESS, err.name.encode()),
        cuMemcpy2DAsync=call("cuMemcpy2DAsync"), cuStreamWriteValue64=call("cuStreamWriteValue64"),
        cuStreamWaitValue64=call("cuStreamWaitValue64"))
    return cu, calls


def test_strided_copy_passes_both_pitches_and_device_memory():
    cu, calls = _bindings()
    Driver(cu).memcpy2d(dst=4096, dst_pitch=512, src=8192, src_pitch=256, width=128, height=7, stream=99)
    (name, (c, stream)), = calls
    assert name == "cuMemcpy2DAsync" and stream == 99
    assert (c.srcDevice, c.srcPitch, c.dstDevice, c.dstPitch, c.WidthInBytes, c.Height) == (8192, 256, 4096, 512,
                                                                                          128, 7)
    assert c.srcMemoryType == c.dstMemoryType == "device"


def test_flags_are_written_and_waited_for_greater_or_equal():
    cu, calls = _bindings()
    d = Driver(cu)
    d.write(5, 1024, 2 ** 40)
    d.wait(6, 1024, 2 ** 40)
    assert calls == [("cuStreamWriteValue64", (5, 1024, 2 ** 40, 0)), ("cuStreamWaitValue64", (6, 1024, 2 ** 40, 0))]


@pytest.mark.parametrize("which", ["cuMemcpy2DAsync", "cuStreamWriteValue64", "cuStreamWaitValue64"])
def test_a_refused_call_raises_naming_the_call_and_the_error(which):
    cu, _ = _bindings(fail=which)
    d = Driver(cu)
    with pytest.raises(RuntimeError, match=f"{which} failed with CUDA_ERROR_INVALID_VALUE"):
        d.memcpy2d(0, 8, 0, 8, 8, 1, 0)
        d.write(0, 0, 1)
        d.wait(0, 0, 1)
