"""Which kernel ``backend="auto"`` runs for a call that both PyTorch's SDPA and longattn's kernels compute exactly.

Data, not timing at run time: one entry per device class, pass, causal, grouped-query heads and head-dim bucket,
each the faster of SDPA's default kernel and ours in ``longattn bench``'s dispatch suite on that device
(``docs/benchmarks.md`` has the measurement behind every entry). A call no entry covers (an unmeasured GPU or head
dim) runs SDPA: a user must never lose speed by calling longattn, and an unmeasured kernel of ours promises nothing.
Calls SDPA cannot compute (windows, N != M causal, the log-sum-exp, dilated and block-sparse attention; decode with
paged or float8 caches, lengths per sequence, several new tokens) never look here: they run our kernels. The
``decode`` pass keys one new token against a contiguous cache (``causal`` is then irrelevant: False).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from longattn.backends.device import capability

SDPA, TRITON, FA4 = "sdpa", "triton", "fa4"
HEAD_DIM_BUCKETS = (64, 128, 256)  # a head dim is looked up under the smallest bucket at least as large

# (device class, pass, causal, grouped, head-dim bucket) -> SDPA or TRITON.
# sm90: H100 80GB HBM3, torch 2.11.0+cu130 (cuDNN 9.19), triton 3.6.0, bf16, N = 1k, 4k, 16k: SDPA's default
# (cuDNN) was faster than our kernels on every kind of call, 0.40x-1.00x (docs/bench/dispatch_h100.md).
MEASURED: Dict[Tuple[str, str, bool, bool, int], str] = {
    ("sm90", "fwd", False, False, 64): SDPA,
    ("sm90", "fwd", False, False, 128): SDPA,
    ("sm90", "fwd", False, False, 256): SDPA,
    ("sm90", "fwd", False, True, 64): SDPA,
    ("sm90", "fwd", False, True, 128): SDPA,
    ("sm90", "fwd", False, True, 256): SDPA,
    ("sm90", "fwd", True, False, 64): SDPA,
    ("sm90", "fwd", True, False, 128): SDPA,
    ("sm90", "fwd", True, False, 256): SDPA,
    ("sm90", "fwd", True, True, 64): SDPA,
    ("sm90", "fwd", True, True, 128): SDPA,
    ("sm90", "fwd", True, True, 256): SDPA,
    ("sm90", "fwd_bwd", False, False, 64): SDPA,
    ("sm90", "fwd_bwd", False, False, 128): SDPA,
    ("sm90", "fwd_bwd", False, False, 256): SDPA,
    ("sm90", "fwd_bwd", False, True, 64): SDPA,
    ("sm90", "fwd_bwd", False, True, 128): SDPA,
    ("sm90", "fwd_bwd", False, True, 256): SDPA,
    ("sm90", "fwd_bwd", True, False, 64): SDPA,
    ("sm90", "fwd_bwd", True, False, 128): SDPA,
    ("sm90", "fwd_bwd", True, False, 256): SDPA,
    ("sm90", "fwd_bwd", True, True, 64): SDPA,
    ("sm90", "fwd_bwd", True, True, 128): SDPA,
    ("sm90", "fwd_bwd", True, True, 256): SDPA,
    # decode: one new token against a contiguous bf16 cache of a known length (an int cache_seqlens), the calls SDPA
    # computes exactly. H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-26, GQA 32/8 and 64/8, D=128, B 1-64,
    # caches 2k-256k: SDPA's default 1.01-1.14x faster than our split-KV kernel on every row (docs/benchmarks.md).
    ("sm90", "decode", False, True, 128): SDPA,
}


# Where FlashAttention-4 is installed (backends/fa4.py), the same question among three: (device class, pass, FA4's
# kind of call (fa4.kind_of), head-dim bucket) -> ((fewer keys than this, order), ..., (None, order)), each order the
# implementations fastest first; the first of them that computes the call runs it. H200, torch 2.11.0+cu130
# (cuDNN), triton 3.6.0, flash-attn-4 4.0.0b36, bf16, batch*N = 16k, heads*D = 2048 (docs/benchmarks.md, session of
# 2026-11-29): FA4 fastest everywhere but SDPA's default at N = 1k forwards (there our kernels beat FA4 at D=64
# causal) and our kernels with soft-capping. Dense and causal
# rows measured with and without grouped-query heads (the same order); window, sinks, packed and soft-capping only
# at D=128: other head dims keep the table above.
_FWD_SHORT = 2048  # keys: the N = 1k rows below, the N = 4k and 16k rows above
_PACKED_SHORT = 2048  # keys of the longest document: the batch of 1k-token documents below, of 16k ones above
WITH_FA4: Dict[Tuple[str, str, str, int], Tuple[Tuple[Optional[int], Tuple[str, ...]], ...]] = {
    ("sm90", "fwd", "dense", 64): ((_FWD_SHORT, (SDPA, FA4, TRITON)), (None, (FA4, SDPA, TRITON))),
    ("sm90", "fwd", "causal", 64): ((_FWD_SHORT, (SDPA, TRITON, FA4)), (None, (FA4, SDPA, TRITON))),
    ("sm90", "fwd", "dense", 128): ((_FWD_SHORT, (SDPA, FA4, TRITON)), (None, (FA4, SDPA, TRITON))),
    ("sm90", "fwd", "causal", 128): ((_FWD_SHORT, (SDPA, FA4, TRITON)), (None, (FA4, SDPA, TRITON))),
    ("sm90", "fwd_bwd", "dense", 64): ((None, (FA4, SDPA, TRITON)),),
    # D=64 causal N=1k forward+backward is host-bound: FA4 through longattn, once it no longer asked FA4 for a
    # log-sum-exp nobody read, 0.816 ms against FA4 called directly 0.822 and SDPA's default 0.900 (docs/benchmarks.md,
    # eighth session of 2026-11-29; before, 0.83-1.25 in four leases). Without grouped-query heads only.
    ("sm90", "fwd_bwd", "causal", 64): ((None, (FA4, SDPA, TRITON)),),
    ("sm90", "fwd_bwd", "dense", 128): ((None, (FA4, SDPA, TRITON)),),
    ("sm90", "fwd_bwd", "causal", 128): ((None, (FA4, SDPA, TRITON)),),
    ("sm90", "fwd", "window", 128): ((None, (FA4, TRITON)),),
    ("sm90", "fwd_bwd", "window", 128): ((None, (FA4, TRITON)),),
    ("sm90", "fwd", "sinks", 128): ((None, (FA4, TRITON)),),
    ("sm90", "fwd_bwd", "sinks", 128): ((None, (FA4, TRITON)),),
    ("sm90", "fwd", "packed", 128): ((None, (FA4, TRITON)),),
    # packed forward+backward, GQA 16/4, 64k tokens, long-tailed documents (docs/benchmarks.md, same session): of 202
    # documents of at most 1k tokens ours 3.33 ms against FA4's 3.45 (FA4 faster in the forward, slower in the
    # backward); of 27 documents up to 16k tokens FA4 20.7 ms against ours 22.4. Unmeasured between: FA4.
    ("sm90", "fwd_bwd", "packed", 128): ((_PACKED_SHORT, (TRITON, FA4)), (None, (FA4, TRITON))),
    ("sm90", "fwd", "softcap", 128): ((None, (TRITON, FA4)),),
    ("sm90", "fwd_bwd", "softcap", 128): ((None, (TRITON, FA4)),),
}


def order_with_fa4(device: str, pass_: str, kind: str, head_dim: int, keys: int) -> Tuple[str, ...]:
    """The measured order, fastest first, of SDPA's default, FA4 and our kernels for one kind of call FA4 computes
    (``pass_``: ``"fwd"`` or ``"fwd_bwd"``; ``kind``: :func:`longattn.backends.fa4.kind_of`; ``keys``: the keys of
    the longest sequence), or ``()`` where :data:`WITH_FA4` has no entry (FA4, unmeasured there, is then not
    chosen). A head dim is looked up under its bucket only if it is the bucket itself: FA4's tiles change with it."""
    for below, order in WITH_FA4.get((device, pass_, kind, head_dim), ()):
        if below is None or keys < below:
            return order
    return ()


def device_class(device: torch.device) -> str:
    """``"cpu"``, or ``"sm<major><minor>"`` for a CUDA device (``"sm90"`` for H100 and H200)."""
    if device.type != "cuda":
        return device.type
    major, minor = capability(device)  # (read once per device)
    return f"sm{major}{minor}"


def head_dim_bucket(head_dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    return HEAD_DIM_BUCKETS[-1]


def choice(device: str, pass_: str, causal: bool, grouped: bool, head_dim: int) -> str:
    """:data:`SDPA` or :data:`TRITON` for one kind of call (without FA4) (``pass_`` is ``"fwd"``, ``"fwd_bwd"`` or
    ``"decode"``)."""
    return MEASURED.get((device, pass_, causal, grouped, head_dim_bucket(head_dim)), SDPA)
