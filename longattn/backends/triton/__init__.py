"""The Triton backend: flash attention kernels on strided views, for CUDA GPUs (or the Triton interpreter).

``ops`` (the autograd Function and custom ops), ``launch`` (views, grids, launches), ``fwd`` and ``bwd`` (the
kernels), ``jit`` (the helpers they share), ``tiles`` (the tile table), ``lists`` (block lists). Importing the
package registers its passes in :mod:`longattn.backends.registry`.
"""
from longattn.backends import registry
from longattn.backends.triton import launch

registry.register("triton", "fwd")(launch.forward)
registry.register("triton", "dkdv")(launch.backward_dkdv)
registry.register("triton", "dq")(launch.backward_dq)

import longattn.backends.gluon  # noqa: E402,F401  (registers the Hopper passes written in Gluon)
