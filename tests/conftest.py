"""Test configuration shared by the CPU test suite.

Without a CUDA GPU the Triton kernels are tested in the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before any kernel module is imported, so it is set here (``backend="auto"`` never picks the interpreter; only tests
that ask for ``backend="triton"`` run it). GPU-only tests live in ``tests/gpu/`` and skip themselves without CUDA.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same global torch random state."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def gen():
    """A seeded CPU ``torch.Generator`` for tests that draw their own inputs."""
    return torch.Generator().manual_seed(1234)
