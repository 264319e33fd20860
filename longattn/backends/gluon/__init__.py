"""Gluon kernels for Hopper (sm_90): passes of the ``"triton"`` backend written in Triton's lower-level dialect,
where Triton's own compiler cannot express the overlap Hopper needs (asynchronous ``wgmma``, TMA loads, warp
specialisation with per-partition registers).

``launch`` decides per launch whether the Gluon kernel takes it and falls back to the Triton kernel otherwise;
``fwd`` holds the forward kernel and ``bwd`` the dK/dV kernel, imported only on first use on a Hopper GPU
(Gluon is an experimental API of Triton, checked by name when imported; ``LONGATTN_GLUON=0`` turns it off).
:mod:`longattn.backends.triton.passes` registers the forward and dK/dV launchers for compute capability 9.0 in
:mod:`longattn.backends.registry`.
"""
