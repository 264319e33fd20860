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


def test_dispatch_rows_with_fa4_give_the_table_its_orders():
    """SDPA fastest at 1k, FA4 from 4k (ours second at 4k, third at 16k): two ranges split at the geometric middle of
    1k and 4k, the 4k and 16k orders merged where equal; grouped-query rows are not keyed."""
    from longattn.bench import dispatch_suite as D
    from longattn.bench.results import Row

    def row(impl, n, ms, workload="causal"):
        r = Row(suite="dispatch", impl=impl, workload=workload, n=n, batch=16384 // n, heads=16, head_dim=128,
                dtype="bfloat16", pass_="fwd")
        r.time_ms = ms
        return r

    rows = [row("sdpa", 1024, 1.0), row("fa4", 1024, 1.1), row("longattn-triton", 1024, 1.2),
            row("sdpa", 4096, 1.0), row("fa4", 4096, 0.9), row("longattn-triton", 4096, 1.1),
            row("sdpa", 16384, 1.0), row("fa4", 16384, 0.9), row("longattn-triton", 16384, 1.1),
            row("fa4", 4096, 5.0, "causal-gqa"), row("sdpa", 4096, 1.0, "causal-gqa")]
    assert D.derive_fa4_orders(rows, "sm90") == {
        ("sm90", "fwd", "causal", 128): ((2048, ("sdpa", "fa4", "triton")), (None, ("fa4", "sdpa", "triton")))}
