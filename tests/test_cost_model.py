"""The cost model of attention across GPUs (``longattn.distributed.cost_model``): its limits, and its predictions
against the efficiencies measured on 2 and 4 H200s (``docs/distributed.md``, "Cost model")."""
import dataclasses
import math

import pytest

from longattn.distributed import cost_model as cm

INFINITE = dataclasses.replace(cm.H100, nvlink_gbs=math.inf, ib_gbs=math.inf, hbm_gbs=math.inf)
SCHEMES = {"ring": cm.ring, "ulysses": cm.ulysses, "hybrid": cm.hybrid}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("P", [2, 8, 64, 512])
def test_infinite_bandwidth_gives_efficiency_one(scheme, P):
    a = cm.Attention(tokens=P * 4096, heads=512, kv_heads=8)
    for pass_ in cm.PASSES:
        assert SCHEMES[scheme](a, P, INFINITE, pass_) == pytest.approx(1.0, abs=1e-12)
        assert SCHEMES[scheme](a, P, cm.H100, pass_) < 1.0  # finite links cost something


def test_ring_is_compute_bound_until_the_shard_transfer_exceeds_a_step():
    """Without merges, a ring step lasts max(compute, transfer): the efficiency is 1 while the shard moves faster
    than a step computes, then falls as compute / transfer."""
    a = cm.Attention(tokens=8 * 16384, heads=16, kv_heads=16, causal=False)
    step = cm.single_gpu_seconds(a, cm.H100) / 8 ** 2
    shard = 2 * (a.tokens / 8) * a.kv_heads * a.head_dim * a.bytes_per_element
    equal = shard / step / 1e9  # the NVLink bandwidth at which transfer and compute take the same time
    for ratio in (4.0, 1.0, 0.5, 0.25):
        m = dataclasses.replace(cm.H100, merge_passes=0.0, nvlink_gbs=equal * ratio)
        transfer = shard / (m.nvlink_gbs * 1e9)
        want = 8 * step / (step + 7 * max(step, transfer))  # T_1 / (P T_P), T_1 = P**2 steps
        assert cm.ring(a, 8, m) == pytest.approx(want, rel=1e-9)
        assert (cm.ring(a, 8, m) == pytest.approx(1.0)) == (ratio >= 1.0)


def test_more_gpus_than_a_node_cross_infiniband():
    a = cm.Attention(tokens=64 * 4096, heads=64, kv_heads=64)
    assert cm.ring(a, 64) < cm.ring(a, 8)  # the ring's slowest hop is InfiniBand past one node
    assert cm.hybrid(a, 64) > cm.ring(a, 64)  # Ulysses inside the node shrinks what crosses it


def test_ulysses_needs_the_heads_divisible():
    a = cm.Attention(tokens=1 << 20, heads=64, kv_heads=8)
    assert cm.ulysses(a, 512) is None and cm.ulysses(a, 64) is not None
    assert cm.hybrid(a, 512) is not None  # Ulysses inside the node only
    assert cm.hybrid(a, 16, ulysses_size=3) is None


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="nvlink_gbs"):
        cm.Machine(nvlink_gbs=0)
    with pytest.raises(ValueError, match="kv_heads"):
        cm.Attention(tokens=1024, heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="P must be"):
        cm.ring(cm.Attention(tokens=1024), 0)
    with pytest.raises(ValueError, match="pass_"):
        cm.ring(cm.Attention(tokens=1024), 2, pass_="bwd")


# Measured scaling efficiencies T_1 / (P T_P), bf16, H = Hk = 16, D = 128, zigzag layout: docs/distributed.md,
# "Cost model" (2 x H200, 2026-11-26, and 4 x H200, 2026-11-22). (scheme, P, N, causal, pass) -> efficiency
MEASURED = {
    ("ulysses", 2, 65536, False, "fwd"): 0.90, ("ring", 2, 65536, False, "fwd"): 0.90,
    ("ulysses", 2, 65536, False, "fwd_bwd"): 0.94, ("ring", 2, 65536, False, "fwd_bwd"): 0.90,
    ("ulysses", 2, 65536, True, "fwd"): 0.86, ("ring", 2, 65536, True, "fwd"): 0.90,
    ("ulysses", 2, 65536, True, "fwd_bwd"): 0.90, ("ring", 2, 65536, True, "fwd_bwd"): 0.87,
    ("ulysses", 2, 131072, False, "fwd"): 0.95, ("ring", 2, 131072, False, "fwd"): 0.96,
    ("ulysses", 2, 131072, False, "fwd_bwd"): 0.97, ("ring", 2, 131072, False, "fwd_bwd"): 0.96,
    ("ulysses", 2, 131072, True, "fwd"): 0.93, ("ring", 2, 131072, True, "fwd"): 1.01,
    ("ulysses", 2, 131072, True, "fwd_bwd"): 0.95, ("ring", 2, 131072, True, "fwd_bwd"): 0.97,
    ("ring", 4, 131072, False, "fwd"): 0.905, ("ring", 4, 131072, False, "fwd_bwd"): 0.921,
    ("ring", 4, 131072, True, "fwd"): 0.876, ("ring", 4, 131072, True, "fwd_bwd"): 0.949,
    ("ring", 4, 524288, False, "fwd"): 0.941, ("ring", 4, 524288, False, "fwd_bwd"): 0.997,
    ("ring", 4, 524288, True, "fwd"): 0.953, ("ring", 4, 524288, True, "fwd_bwd"): 0.999,
}


@pytest.mark.parametrize("key", MEASURED, ids=lambda k: "-".join(map(str, k)))
def test_predictions_bound_the_measured_efficiencies(key):
    """The model, with H200 parameters, is an upper bound of the measured efficiency (within 0.03, the spread of
    repeated timings) and no more than 0.13 above it: what it leaves out (per-block kernels slower than the
    single-GPU one, which was cuDNN's on 2 GPUs; launches; copies) cost the measured runs up to 12%."""
    scheme, P, N, causal, pass_ = key
    predicted = SCHEMES[scheme](cm.Attention(tokens=N, heads=16, kv_heads=16, causal=causal), P, cm.H200, pass_)
    assert MEASURED[key] - 0.03 <= predicted <= MEASURED[key] + 0.13, predicted
