"""Gluon kernels for Hopper (sm_90): passes of the ``"triton"`` backend written in Triton's lower-level dialect,
where Triton's own compiler cannot express the overlap Hopper needs (asynchronous ``wgmma``, TMA loads, warp
specialisation with per-partition registers).

``launch`` decides per launch (or call) whether a Gluon kernel takes it and falls back to the Triton kernels
otherwise; ``fwd`` holds the forward kernel and ``bwd_fused`` the fused backward (dQ, dK and dV in one kernel), both
imported only on first use on a Hopper GPU (Gluon is an experimental API of Triton, checked by name when imported;
``LONGATTN_GLUON=0`` turns it off); ``tma`` the descriptor rules they share. :mod:`longattn.backends.triton.passes`
registers the forward (``"fwd"``) and the fused backward (``"bwd"``) for compute capability 9.0 in
:mod:`longattn.backends.registry`. The float8 path of the forward kernel is routed to only for the head dims in
``launch.FP8_HEAD_DIMS`` (none: it measured slower than the Triton FP8 forward; docs/kernel_notes.md), which the
GPU tests set to exercise it.
"""
