"""A first-order cost model of attention across GPUs: the predicted scaling efficiency of ring attention, Ulysses
and the hybrid of the two, from stated machine parameters (no GPU needed; pure Python).

Efficiency is ``T_1 / (P T_P)`` (as ``docs/distributed.md`` measures it): ``T_1`` the attention of the whole
sequence on one GPU, ``T_P`` the time of the slowest of ``P`` GPUs sharing it. The model counts what cannot shrink
with ``P``: every GPU computes ``1/P`` of the attention at the single-GPU rate (the layouts balance the work), and
waits for what its links cannot move during that compute.

- **ring** (:func:`ring`, zigzag layout): ``P`` steps, each computing ``1/P**2`` of the attention (``T / P**2``: an
  ``(N/P)**2`` block, half visible when causal) while the next key/value shard (``2 (N/P) Hk D`` elements) moves to
  the neighbour; a step lasts the longer of the two. A step also merges its partial output into float32
  accumulators (``merge_passes`` passes of ``(N/P) Hq D`` floats through device memory), which the transfer
  cannot hide. The backward's steps move the shard and its float32 dK/dV accumulator. Past one node the ring's
  slowest hop crosses InfiniBand.
- **Ulysses** (:func:`ulysses`): one all-to-all of q, k, v before the attention and one of the output after it
  (the backward: two more, of the same sizes), counted as not overlapped with compute (the implementation overlaps
  them with other head groups' kernels, but on 2 H100s the transfers beside a kernel then slowed both about as much
  as they hid, docs/distributed.md); ``(P - 1)/P`` of each rank's data
  leaves it, over NVLink inside a node and over InfiniBand for the ranks of other nodes. Needs ``Hq % P == 0``
  (``None`` otherwise).
- **hybrid** (:func:`hybrid`): Ulysses inside groups of ``U`` GPUs (a node), a ring across the ``R = P / U``
  groups: the all-to-alls of Ulysses with ``U`` ranks, then a ring of ``R`` steps on ``Hq / U`` heads (each
  step ``T / (P R)`` of compute against a shard of ``2 (N/R) c Hk/U`` elements over InfiniBand, ``c`` the
  key/value head copies ``U / gcd(Hk, U)``).

Not modelled: kernel rates that change with the block size (smaller blocks run slower), launch and host overheads,
the network's latency, and contention between the two directions of a link. The model is an upper bound of what a
tuned implementation reaches; ``docs/distributed.md`` compares it with the measured figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

PASSES = ("fwd", "fwd_bwd")


@dataclass(frozen=True)
class Machine:
    """The machine's stated parameters (defaults: NVIDIA H100 SXM, 8 per node, one 400 Gb/s NIC per GPU).

    ``attention_tflops``: the attention forward's sustained rate on one GPU, in TFLOP/s of visible query-key pairs
    (``4 D`` FLOPs per pair and head). ``backward_ratio``: backward time over forward time for the same attention
    (about 2.5 for FlashAttention-style kernels). ``nvlink_gbs`` / ``ib_gbs``: GB/s per GPU and direction inside a
    node / across nodes. ``hbm_gbs``: device memory bandwidth, GB/s. ``gpus_per_node``: GPUs linked by NVLink.
    ``merge_passes``: float32 passes through device memory per element of a ring step's partial output (reading
    the accumulator and the partial, writing the merged result).
    """

    attention_tflops: float = 550.0
    backward_ratio: float = 2.5
    nvlink_gbs: float = 450.0
    ib_gbs: float = 50.0
    hbm_gbs: float = 3350.0
    gpus_per_node: int = 8
    merge_passes: float = 5.0

    def __post_init__(self):
        for name in ("attention_tflops", "nvlink_gbs", "ib_gbs", "hbm_gbs"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Machine: {name} must be > 0 (math.inf allowed), got {value!r}")
        if not self.backward_ratio >= 0 or not self.merge_passes >= 0:
            raise ValueError(f"Machine: backward_ratio and merge_passes must be >= 0, got {self.backward_ratio!r} "
                             f"and {self.merge_passes!r}")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ValueError(f"Machine: gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")


H100 = Machine()
H200 = Machine(hbm_gbs=4800.0)


@dataclass(frozen=True)
class Attention:
    """The attention of one sequence: ``tokens`` (N, the whole sequence), ``heads`` (Hq), ``kv_heads`` (Hk),
    ``head_dim`` (D), ``causal``, and ``bytes_per_element`` of q, k, v and the output (2 for bf16); batch 1 (a
    batch of B sequences scales compute and traffic alike)."""

    tokens: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    causal: bool = True
    bytes_per_element: int = 2

    def __post_init__(self):
        for name in ("tokens", "heads", "kv_heads", "head_dim", "bytes_per_element"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Attention: {name} must be an int >= 1, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Attention: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def flops(self) -> float:
        """Forward FLOPs: ``4 N**2 Hq D``, half when causal."""
        return 4.0 * self.tokens ** 2 * self.heads * self.head_dim * (0.5 if self.causal else 1.0)


def _check(P: int, pass_: str) -> None:
    if not (isinstance(P, int) and P >= 1):
        raise ValueError(f"P must be an int >= 1, got {P!r}")
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")


def single_gpu_seconds(a: Attention, m: Machine, pass_: str = "fwd") -> float:
    """``T_1``: the attention on one GPU (forward, or forward and backward)."""
    _check(1, pass_)
    forward = a.flops() / (m.attention_tflops * 1e12)
    return forward * (1 + m.backward_ratio) if pass_ == "fwd_bwd" else forward


def _ring_steps(compute: float, message: float, partial: float, steps: int, link_gbs: float, m: Machine) -> float:
    """``steps`` ring steps of ``compute`` seconds, each but the first waiting for the longer of its compute plus
    the merge of its float32 partial result (``partial`` bytes, ``merge_passes`` passes) and the transfer of the
    ``message`` bytes the step before sent on."""
    merge = m.merge_passes * partial / (m.hbm_gbs * 1e9)
    return compute + (steps - 1) * max(compute + merge, message / (link_gbs * 1e9))


def ring(a: Attention, P: int, m: Machine = H100, pass_: str = "fwd") -> float:
    """Predicted efficiency ``T_1 / (P T_P)`` of ring attention (zigzag layout) on ``P`` GPUs."""
    _check(P, pass_)
    n, b = a.tokens / P, a.bytes_per_element
    total = single_gpu_seconds(a, m, "fwd")
    step = total / P ** 2
    link = m.nvlink_gbs if P <= m.gpus_per_node else m.ib_gbs
    shard = 2 * n * a.kv_heads * a.head_dim * b  # keys and values
    partial = n * a.heads * a.head_dim * 4  # a step's float32 partial output (forward) or dQ (backward)
    seconds = _ring_steps(step, shard, partial, P, link, m)
    if pass_ == "fwd_bwd":
        seconds += _ring_steps(step * m.backward_ratio, shard * (b + 4) / b, partial, P, link, m)
    return single_gpu_seconds(a, m, pass_) / (P * seconds)


def _all_to_all_seconds(per_rank_bytes: float, group: int, m: Machine) -> float:
    """One all-to-all in which each of ``group`` ranks holds ``per_rank_bytes`` and keeps ``1/group`` of them: the
    part for ranks of its node over NVLink, the part for other nodes over InfiniBand, both at once."""
    local = min(group, m.gpus_per_node)
    inside = per_rank_bytes * (local - 1) / group / (m.nvlink_gbs * 1e9)
    across = per_rank_bytes * (group - local) / group / (m.ib_gbs * 1e9)
    return max(inside, across)


def _ulysses_traffic(a: Attention, rows: float, group: int) -> float:
    """Bytes a rank holds for Ulysses' all-to-alls over ``group`` ranks, forward: q, k, v (key/value heads
    repeated ``c = group / gcd(Hk, group)`` times) and the output."""
    c = group // math.gcd(a.kv_heads, group)
    return rows * (2 * a.heads + 2 * c * a.kv_heads) * a.head_dim * a.bytes_per_element


def ulysses(a: Attention, P: int, m: Machine = H100, pass_: str = "fwd") -> Optional[float]:
    """Predicted efficiency of Ulysses on ``P`` GPUs; None when ``P`` does not divide the query heads."""
    _check(P, pass_)
    if a.heads % P:
        return None
    comm = _all_to_all_seconds(_ulysses_traffic(a, a.tokens / P, P), P, m)
    one = single_gpu_seconds(a, m, pass_)
    seconds = one / P + comm * (2 if pass_ == "fwd_bwd" else 1)
    return one / (P * seconds)


def hybrid(a: Attention, P: int, m: Machine = H100, pass_: str = "fwd",
           ulysses_size: Optional[int] = None) -> Optional[float]:
    """Predicted efficiency of the hybrid on ``P`` GPUs: Ulysses inside groups of ``ulysses_size`` GPUs (default:
    a node, or ``P`` if smaller), a ring across the ``P / ulysses_size`` groups. None when the group size does not
    divide ``P`` or the query heads."""
    _check(P, pass_)
    u = min(P, m.gpus_per_node) if ulysses_size is None else ulysses_size
    if not (isinstance(u, int) and u >= 1) or P % u or a.heads % u:
        return None
    r = P // u
    comm = _all_to_all_seconds(_ulysses_traffic(a, a.tokens / P, u), u, m)
    total = single_gpu_seconds(a, m, "fwd")
    c = u // math.gcd(a.kv_heads, u)
    rows = a.tokens / r
    shard = 2 * rows * (c * a.kv_heads / u) * a.head_dim * a.bytes_per_element
    partial = rows * (a.heads / u) * a.head_dim * 4
    link = m.nvlink_gbs if P <= m.gpus_per_node else m.ib_gbs
    seconds = comm + _ring_steps(total / (P * r), shard, partial, r, link, m)
    if pass_ == "fwd_bwd":
        b = a.bytes_per_element
        seconds += comm + _ring_steps(total / (P * r) * m.backward_ratio, shard * (b + 4) / b, partial, r, link, m)
    return single_gpu_seconds(a, m, pass_) / (P * seconds)


def predictions(a: Attention, P: int, m: Machine = H100) -> Dict[str, Optional[float]]:
    """``{"ring fwd": ..., "ring fwd_bwd": ..., "ulysses fwd": ..., ...}`` for the three schemes and both passes."""
    return {f"{name} {pass_}": fn(a, P, m, pass_) for name, fn in (("ring", ring), ("ulysses", ulysses),
                                                                     ("hybrid", hybrid)) for pass_ in PASSES}
