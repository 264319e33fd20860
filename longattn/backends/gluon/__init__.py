"""Gluon kernels for Hopper (sm_90): passes of the ``"triton"`` backend written in Triton's lower-level dialect,
where Triton's own compiler cannot express the overlap Hopper needs (asynchronous ``wgmma``, TMA loads, warp
specialisation with per-partition registers).

``launch`` runs the kernels on the launches (or calls) the planner (:mod:`longattn.backends.triton.planner`) gives
them; ``fwd`` holds the forward kernel and ``bwd_fused`` the fused backward (dQ, dK and dV in one kernel), both
imported only on first use on a Hopper GPU (Gluon is an experimental API of Triton, checked by name when imported;
``LONGATTN_GLUON=0`` or ``longattn.routing(gluon=False)`` turns it off); ``tma`` the descriptor rules they share.
Nothing here imports the Triton backend (``backends/kernel_args.py`` holds what both launchers share). The float8
path of the forward kernel takes the head dims of ``launch.FP8_KERNEL_HEAD_DIMS`` (64, 128 and 256); the routing's
``fp8_head_dims`` says which of them are routed to it.
"""
