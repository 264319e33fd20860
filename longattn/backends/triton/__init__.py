"""The Triton backend: flash attention kernels on strided views, for CUDA GPUs (or the Triton interpreter).

``support`` (why a call cannot run here; imports no Triton), ``ops`` (the autograd Function, the custom ops and the
decode entry), ``passes`` (registers each pass in :mod:`longattn.backends.registry`; imported by ``ops``),
``launch`` (views, grids, launches), ``fwd`` and ``bwd`` (the kernels), ``jit`` (the helpers they share),
``tiles`` (the tile table), ``lists`` (block lists), ``decode`` and ``decode_launch`` (the KV-cache kernels and
their launch plans).
"""
