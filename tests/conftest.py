"""Test configuration.

Without a CUDA GPU the Triton kernels are tested in the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before any kernel module is imported, so it is set here (``backend="auto"`` never picks the interpreter; only tests
that ask for ``backend="triton"`` run it).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
