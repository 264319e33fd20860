"""Which kernel ``backend="auto"`` runs for a call that both PyTorch's SDPA and longattn's kernels compute exactly.

Data, not timing at run time: one entry per device class, pass, causal, grouped-query heads and head-dim bucket,
each the faster of SDPA's default kernel and ours in ``longattn bench``'s dispatch suite on that device
(``docs/benchmarks.md`` has the measurement behind every entry). A call no entry covers (an unmeasured GPU or head
dim) runs SDPA: a user must never lose speed by calling longattn, and an unmeasured kernel of ours promises nothing.
Calls SDPA cannot compute (windows, N != M causal, the log-sum-exp, dilated and block-sparse attention) never look
here: they run our kernels.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

SDPA, TRITON = "sdpa", "triton"
HEAD_DIM_BUCKETS = (64, 128, 256)  # a head dim is looked up under the smallest bucket at least as large

# (device class, pass, causal, grouped, head-dim bucket) -> SDPA or TRITON
MEASURED: Dict[Tuple[str, str, bool, bool, int], str] = {}


def device_class(device: torch.device) -> str:
    """``"cpu"``, or ``"sm<major><minor>"`` for a CUDA device (``"sm90"`` for H100 and H200)."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def head_dim_bucket(head_dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    return HEAD_DIM_BUCKETS[-1]


def choice(device: str, pass_: str, causal: bool, grouped: bool, head_dim: int) -> str:
    """:data:`SDPA` or :data:`TRITON` for one kind of call (``pass_`` is ``"fwd"`` or ``"fwd_bwd"``)."""
    return MEASURED.get((device, pass_, causal, grouped, head_dim_bucket(head_dim)), SDPA)
