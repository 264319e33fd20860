"""The ``backend="torch"`` path: PyTorch operations on any device. :mod:`.chunked` runs attention calls
(differentiable, in chunks of bounded memory), :mod:`.decoding` KV-cache calls."""
from longattn.backends.torch.chunked import attention, backward, forward
from longattn.backends.torch.decoding import decode

__all__ = ["attention", "forward", "backward", "decode"]
