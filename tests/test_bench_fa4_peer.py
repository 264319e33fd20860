"""The benchmark's FlashAttention-4 peer and what ``longattn`` (auto) says it ran, on the CPU: FA4 is a GPU peer of
the flash workloads only, and the auto row names the backend of the call's plan (``longattn.explain``)."""
import torch

from longattn.bench import peers
from longattn.bench.workloads import Workload


def test_fa4_peer_is_a_gpu_peer_of_flash_workloads():
    fa4 = peers.Fa4()
    assert "fa4" in peers.PEER_NAMES
    assert fa4.applies("dense") and fa4.applies("window") and not fa4.applies("dilated")
    w = Workload("causal", 256, 1, 2, 64, causal=True)
    assert fa4.unsupported(w, torch.device("cpu"), torch.float16) == "GPU only"
    assert peers.AUTO_PEERS["fa4"] == "fa4"


def test_the_auto_row_names_the_backend_its_plan_runs():
    auto = peers.LongAttn()
    cpu = torch.device("cpu")
    assert auto.kernel(Workload("causal", 256, 1, 2, 64, causal=True), cpu, torch.float32) == "sdpa"
    assert auto.kernel(Workload("window", 256, 1, 2, 64, causal=True, window=(32, 0)), cpu, torch.float32) == "torch"
    assert auto.same_kernel_as(Workload("dense", 256, 1, 2, 64), cpu, torch.float32, "fwd") == "sdpa"
