"""Test configuration shared by the CPU test suite.

Without a CUDA GPU the Triton kernels are tested in the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before any kernel module is imported, so it is set here (``backend="auto"`` never picks the interpreter; only tests
that ask for ``backend="triton"`` run it), with a bounds check of every load and store the interpreted kernels make
(``tests/_interpreter_bounds.py``). GPU-only tests live in ``tests/gpu/`` and skip themselves without CUDA.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # every interpreted load and store inside the kernel's tensors
    from _interpreter_bounds import install as _install_bounds_check

    _install_bounds_check()


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same global torch random state."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def gen():
    """A seeded CPU ``torch.Generator`` for tests that draw their own inputs."""
    return torch.Generator().manual_seed(1234)


# Modules whose every test is slow on a 2-core CPU (Gluon and Triton compilations for sm_90, spawned process
# groups of 4-8 ranks): marked `slow`, so `python -m pytest -q -m "not slow"` is the quick subset (the README says how
# long each takes). CI runs everything.
SLOW_MODULES = ("test_gluon_fwd_compile.py", "test_gluon_bwd_fused_compile.py", "test_triton_shared_memory.py",
                "test_sp_world8.py", "test_sp_dead_rank.py", "test_gpu_sp_check_smoke.py", "test_context_parallel.py",
                "test_distributed.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
