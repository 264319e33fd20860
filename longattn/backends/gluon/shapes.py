"""What the Gluon kernels take, where both their launchers (``launch.py``, and the fused backward's own in
``bwd_fused.py``) read it: the input dtypes, and the fused backward's tiles per head dim, hence its head dims.
Imports no Triton: ``launch.py`` imports the kernels' modules only on first use."""
from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16)

# The fused backward (bwd_fused.py: dQ, dK and dV in one kernel; bwd_fused_wide.py at D=256): (BLOCK_M query rows per
# block, SUB_N: a program owns 2 * SUB_N keys, SUB_N per consumer below D=256; at D=256 both consumers read all of
# them) per head dim; it takes these head dims and no other.
FUSED_BWD_TILES = {64: (64, 64), 128: (64, 64), 256: (64, 32)}
FUSED_BWD_HEAD_DIMS = tuple(sorted(FUSED_BWD_TILES))
FUSED_BWD_GRAD_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)  # None: the inputs' dtype
# Head dims whose dense calls it can run with dQ added in a fixed order (bwd_fused.py's turn counters; D=256's kernel,
# bwd_fused_wide.py, has none).
DETERMINISTIC_BWD_HEAD_DIMS = (64, 128)

# The 128 x 128 backward (bwd_wide_tile.py: 128 query rows x 128 keys a step, dense calls): its head dims, and its
# query rows a step (the blocks of its row statistics).
WIDE_BWD_HEAD_DIMS = (64,)
WIDE_BWD_BLOCK_M = 128
