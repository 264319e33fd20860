"""GPU, one device: the copy engines' driver calls through cuda-python (longattn.distributed.cuda_driver) copy
strided rows exactly, write and wait for 64-bit flags in stream order, and name the driver's error."""
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


def test_flag_write_then_wait_orders_two_streams(driver):
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    x = torch.zeros(1 << 20, device="cuda")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    big = 2 ** 40 + 3  # past 32 bits
    with torch.cuda.stream(consumer):
        driver.wait(consumer.cuda_stream, flag.data_ptr(), big)
        y = x.sum()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # the consumer must wait for this
        x.fill_(1.0)
        driver.write(producer.cuda_stream, flag.data_ptr(), big)
    consumer.synchronize()
    assert flag.item() == big and y.item() == x.numel()


def test_a_refused_copy_names_the_call(driver):
    a = torch.zeros(1024, device="cuda", dtype=torch.uint8)
    s = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cuMemcpy2DAsync failed with CUDA_ERROR_INVALID_VALUE"):
        driver.memcpy2d(a.data_ptr(), 16, a.data_ptr() + 512, 16, 64, 4, s.cuda_stream)  # width > pitch
