"""GPU, one device: the copy engines' driver calls through cuda-python (longattn.distributed.cuda_driver) copy
strided rows exactly, write and wait for 64-bit flags in stream order, and name the driver's error."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def driver():
    from longattn.distributed import cuda_driver
    try:
        return cuda_driver.load()
    except ImportError as e:
        pytest.skip(str(e))


def test_strided_rows_copied_exactly(driver):
    src = torch.randn(37, 3, 200, device="cuda", dtype=torch.bfloat16)
    dst = torch.zeros(37, 5, 200, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    row = 200 * 2
    # head 1 of src into head 3 of dst: 37 rows of 400 bytes, pitches 3*400 and 5*400
    driver.memcpy2d(dst[:, 3].data_ptr(), 5 * row, src[:, 1].data_ptr(), 3 * row, row, 37, s.cuda_stream)
    s.synchronize()
    assert torch.equal(dst[:, 3], src[:, 1])
    assert not dst[:, [0, 1, 2, 4]].any()


_ORDERING_PROBE = """
import torch
from longattn.distributed import cuda_driver
driver = cuda_driver.load()
flag = torch.zeros(1, dtype=torch.int64, device="cuda")
x = torch.zeros(1 << 20, device="cuda")
# Every kernel below launched once first: the first launch of a kernel in a process (measured: with
# CUDA_MODULE_LOADING=EAGER too) can wait on the host for the whole device, which includes the wait queued below,
# whose write this same host queues only afterwards: a deadlock of this program, not of the flags
# (tools/probe_stream_flags.py shows both)
torch.cuda._sleep(1000)
x.fill_(0.0)
x.sum()
torch.cuda.synchronize()
producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
big = 2 ** 40 + 3  # past 32 bits
with torch.cuda.stream(consumer):  # the wait is queued first, as the copy-engine transport queues a peer's
    driver.wait(consumer.cuda_stream, flag.data_ptr(), big)
    y = x.sum()
with torch.cuda.stream(producer):
    torch.cuda._sleep(50_000_000)  # the consumer must wait for this
    x.fill_(1.0)
    driver.write(producer.cuda_stream, flag.data_ptr(), big)
consumer.synchronize()
assert flag.item() == big and y.item() == x.numel(), (flag.item(), y.item())
print("ordered")
"""


def test_flag_write_then_wait_orders_two_streams(driver):
    """A 64-bit flag waited for on one stream and written later on another orders them. In a child process with a
    time limit: a stream waiting on a flag that is never written waits forever, which must fail this test, not
    hold the whole GPU suite."""
    _run_probe(_ORDERING_PROBE, "ordered",
               "a flag wait queued on one stream before its write on another did not end in 120 s "
               f"(CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}): "
               "the copy-engine transport's waits would hang the same way")


def _run_probe(code: str, printed: str, on_timeout: str) -> None:
    """Run ``code`` in a child process with this checkout on its path and a 120 s limit (a wait that never ends
    must fail the test, not hold the GPU suite); it must exit 0 having printed ``printed``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(on_timeout)
    assert done.returncode == 0 and printed in done.stdout, done.stdout + done.stderr


def test_a_refused_copy_names_the_call(driver):
    a = torch.zeros(1024, device="cuda", dtype=torch.uint8)
    s = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cuMemcpy2DAsync failed with CUDA_ERROR_INVALID_VALUE"):
        driver.memcpy2d(a.data_ptr(), 16, a.data_ptr() + 512, 16, 64, 4, s.cuda_stream)  # width > pitch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_of_an_aborted_call_become_nan_on_the_gpu(dtype):
    """``poison`` (a call's end): a flag written with the abort mark by a stream memory operation makes the
    results NaN; the next call's number leaves them alone (bitwise), with no host wait in between."""
    pytest.importorskip("triton")
    from longattn.distributed import copy_engine, cuda_driver, poison
    try:
        drv = cuda_driver.load()
    except ImportError as e:
        pytest.skip(str(e))
    mark = 9 + copy_engine.ABORTED
    flags = torch.full((3 * copy_engine.SLOTS,), 9, dtype=torch.int64, device="cuda")
    out = torch.randn(3, 1000, 7, device="cuda", dtype=dtype)
    keep = out.clone()
    poison.poison(flags, mark, [out])
    drv.write(torch.cuda.current_stream().cuda_stream, flags[70:].data_ptr(), 10)  # the next call's number
    poison.poison(flags, mark, [out])
    assert torch.equal(out, keep)
    drv.write(torch.cuda.current_stream().cuda_stream, flags[100:].data_ptr(), mark)
    poison.poison(flags, mark, [out])
    assert bool(out.isnan().all())


_RETIRED_PROBE = """
import torch
from longattn.distributed import copy_engine, cuda_driver
driver, rt = cuda_driver.load(), copy_engine.RUNTIME
n = 1 << 18
flag = torch.zeros(1, dtype=torch.int64, device="cuda")
sent = torch.zeros(n, device="cuda")
warm = torch.full((n,), 1.0, device="cuda")  # (every kernel below launched once first, as in the probe above)
sent.copy_(warm)
flag.fill_(0)
del warm
torch.cuda.synchronize()
side = torch.cuda.Stream()
src = torch.full((n,), 3.0, device="cuda")  # a tensor of the call, made on the caller's stream
side.wait_stream(torch.cuda.current_stream())
driver.wait(side.cuda_stream, flag.data_ptr(), 1)  # the side stream waits for a peer before it sends src
rt.memcpy2d(sent.data_ptr(), 4 * n, src.data_ptr(), 4 * n, 4 * n, 1, side)
rt.retire([src], [side], joined=False)  # the call aborted: its tensors go while the copy is still queued
del src
other = torch.empty(n, device="cuda")  # the caller's next tensor, written before the peer's flag comes
other.fill_(7.0)
flag.fill_(1)
torch.cuda.synchronize()
assert bool((sent == 3.0).all()), sent.unique().tolist()
print("kept")
"""


def test_an_aborted_calls_tensors_stay_out_of_the_allocator_until_the_side_streams_are_done(driver):
    """After an abort the caller's stream does not wait for the side streams (they may wait for a peer's flag), so
    ``retire(..., joined=False)`` records the call's tensors on them: a tensor the caller makes next does not get
    the memory a queued copy still reads (without it, the copy sends the new tensor's 7s instead of the 3s). In a
    child process with a time limit, as the flag test above."""
    _run_probe(_RETIRED_PROBE, "kept", "a copy queued behind a flag wait did not end in 120 s")
