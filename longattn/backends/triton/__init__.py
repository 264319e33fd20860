"""The Triton backend: flash attention kernels on strided views, for CUDA GPUs (or the Triton interpreter).

``support`` (why a call cannot run here; imports no Triton), ``entry`` (the autograd Function, the custom ops and the
decode entry; it runs what ``planner`` names), ``planner`` (the ordered candidate kernels of each pass, their reasons,
the plans by signature), ``launch`` (views, grids, launches), ``fwd`` and ``bwd`` (the kernels), ``jit`` (the helpers they share),
``tiles`` (the tile table), ``lists`` (block lists), ``fp8_layout`` (FP8 values made sequence-major),
``decode_kernels`` and ``decode_launch`` (the KV-cache kernels and
their launch plans).
"""
