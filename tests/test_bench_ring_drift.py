"""The ring drift benchmark (``benchmarks/bench_ring_drift.py``): its one-device emulation of the ring (threads as
ranks, what the GPU drift table uses) computes what the ring computes over gloo processes. (The drift bar itself is a
library property, tested in ``test_distributed.py`` without the benchmark.)"""
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def ring_drift(request):
    sys.path.insert(0, str(BENCHMARKS))  # (spawned ranks inherit it and import the script by its name)
    request.addfinalizer(lambda: sys.path.remove(str(BENCHMARKS)))
    import bench_ring_drift

    return bench_ring_drift


def test_thread_ranks_compute_what_gloo_processes_compute(ring_drift):
    kw = dict(tokens=512, heads=4, kv_heads=2, head_dim=32, causal=True, backend="torch", timeout_s=120)
    processes = ring_drift.measure(4, **kw)
    threads = ring_drift.measure(4, transport="threads", **kw)
    assert set(threads) == set(ring_drift.QUANTITIES)
    # (the float64 error sums may differ in their last digits: another thread count)
    for name in ring_drift.QUANTITIES:
        assert threads[name] == pytest.approx(processes[name], rel=1e-9), name
    assert all(0 < rms < mx for mx, rms in processes.values())  # errors were measured, not zeros
