"""Registers the Triton backend's passes in :mod:`longattn.backends.registry`: the portable Triton kernels for
every GPU the backend runs on, then the Hopper passes written in Gluon (:mod:`longattn.backends.gluon`)."""
from longattn.backends import registry
from longattn.backends.gluon import launch as gluon_launch
from longattn.backends.triton import decode_launch, launch

registry.register("triton", "fwd")(launch.forward)
registry.register("triton", "dkdv")(launch.backward_dkdv)
registry.register("triton", "dq")(launch.backward_dq)
registry.register("triton", "decode")(decode_launch.decode)


@registry.register("triton", "bwd")
def no_fused_backward(*args, **kwargs) -> None:
    """The ``"bwd"`` pass (the whole backward in one pass) where no kernel covers it: None, so the backward runs
    the ``"dkdv"`` and ``"dq"`` passes."""
    return None


# the Hopper passes written in Gluon; each takes the launches it covers and hands the rest to the Triton kernel
registry.register("triton", "fwd", (9, 0))(gluon_launch.forward)
registry.register("triton", "bwd", (9, 0))(gluon_launch.fused_backward)  # None for the calls it does not cover
