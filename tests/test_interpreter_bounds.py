"""The CPU suite's bounds check of interpreted kernels (tests/_interpreter_bounds.py) catches a load or store past
a kernel's tensors and lets masked-off lanes and in-bounds views through."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's check")


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)
    return copy


def test_the_check_is_installed_and_catches_a_read_past_a_tensor():
    from _interpreter_bounds import install

    assert install(), "this Triton's interpreter lacks the hooks the check wraps"
    copy = _copy_kernel()
    base = torch.arange(12.0)
    x, y = base[4:8], torch.empty(8)  # x: a view whose storage runs on both sides of it
    copy[(1,)](x, y, 4, BLOCK=8)  # lanes 4..7 masked off
    assert torch.equal(y[:4], x)
    copy[(1,)](x, y, 8, BLOCK=8)  # past x's own elements, still inside its storage: not a fault of memory
    with pytest.raises(Exception, match="outside its tensor arguments"):
        copy[(1,)](torch.arange(4.0), y, 8, BLOCK=8)
