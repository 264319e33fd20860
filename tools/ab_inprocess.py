"""Time this checkout's Triton kernels against another version of the package in ONE process, interleaved.

    mkdir ab_tree && git archive <rev> longattn | tar -x -C ab_tree       # the other version
    python tools/ab_inprocess.py --tree ab_tree [--rounds 5] [--tables flash dilated] [--head-dims 128] [--modes fwd]

(Through the device tool, keep ``ab_tree`` inside the checkout, untracked but not git-ignored, so that it travels
with the working tree; delete it afterwards.)

The other tree's package is copied to a temporary folder as ``longattn_base`` (imports and custom-op names
rewritten), so both versions live in one process and take turns in every round of ``do_bench`` on the same
inputs: the GPU's drift falls on both alike. Workloads: the flash table (bf16, batch * N = 16k, heads * D = 2048,
D = 64/128, causal or not, N = 1k/4k/16k) and the dilated table (B = 1, H = 16, D = 64, segments 2048-16384,
rates 1-8, N = 32k/128k/1M), forward and forward+backward, and the FP8 table (``--tables fp8``: float8 q, k, v
quantized per tensor, N = 4k/16k or ``--fp8-lengths``, the forward only), and the packed table (``--tables
packed``: 64k tokens of log-uniform document lengths from 64 up to 1k, 8k or 16k tokens, GQA with 2048 query and 512
key/value channels, causal or not). Prints a markdown table with base/new (> 1: this checkout is faster).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def renamed_copy(tree: str) -> str:
    """``tree/longattn`` copied to a temporary folder as the package ``longattn_base``; returns the folder."""
    out = tempfile.mkdtemp(prefix="ab_base_")
    dst = os.path.join(out, "longattn_base")
    shutil.copytree(os.path.join(tree, "longattn"), dst)
    for root, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                src = open(path).read()
                src = re.sub(r"\blongattn\.", "longattn_base.", src)
                src = re.sub(r"from longattn import", "from longattn_base import", src)
                src = re.sub(r"^import longattn$", "import longattn_base", src, flags=re.M)
                src = src.replace('"longattn::', '"longattn_base::').replace('"longattn.', '"longattn_base.')
                src = src.replace('Library("longattn"', 'Library("longattn_base"')  # (operator namespaces)
                open(path, "w").write(src)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", required=True, help="folder holding the other version's longattn/")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tables", nargs="+", default=["flash", "dilated"], choices=["flash", "dilated", "fp8", "packed"])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], help="the flash table's head dims")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    p.add_argument("--fp8-lengths", nargs="+", type=int, default=[4096, 16384], help="the FP8 table's N")
    a = p.parse_args()
    sys.path.insert(0, renamed_copy(a.tree))
    import torch

    import longattn
    import longattn_base
    from longattn.bench.interleaved import make_step, time_interleaved

    segs, rates = (2048, 4096, 8192, 16384), (1, 2, 4, 8)
    cases = []
    if "flash" in a.tables:
        for d in a.head_dims:
            for causal in (False, True):
                for n in (1024, 4096, 16384):
                    cases.append((f"flash D={d} causal={causal} N={n}", (16384 // n, n, 2048 // d, d),
                                  lambda m, causal=causal: lambda q, k, v: m.flash_attention(
                                      q, k, v, causal=causal, backend="triton")))
    if "dilated" in a.tables:
        for n in (32768, 131072, 1 << 20):
            cases.append((f"dilated N={n}", (1, n, 16, 64), lambda m: lambda q, k, v: m.dilated_attention(
                q, k, v, segment_lengths=segs, dilation_rates=rates, backend="triton")))
    rows = []

    def ab(name: str, mode: str, new, base) -> None:
        """Time the two versions' steps taking turns; keep and print the row."""
        ms = time_interleaved({"new": new, "base": base}, rounds=a.rounds)
        rows.append((name, mode, ms["new"], ms["base"]))
        print(f"{name} {mode}: new {ms['new']:.3f} ms, base {ms['base']:.3f} ms", flush=True)

    def ab_steps(name: str, make, q, k, v) -> None:
        """:func:`ab` of ``make(package)``'s attention in every mode asked for."""
        for mode in a.modes:
            ab(name, mode, make_step(make(longattn), q, k, v, mode), make_step(make(longattn_base), q, k, v, mode))

    if "packed" in a.tables:
        from longattn.bench.varlen_suite import document_lengths
        for high in (1024, 8192, 16384):
            lens = document_lengths(65536, high=high)
            cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
            for d in a.head_dims:
                q = torch.randn(65536, 2048 // d, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(65536, 512 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                for causal in (False, True):
                    def make(m, causal=causal, cu=cu):
                        return lambda q, k, v: m.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                        causal=causal, backend="triton")
                    ab_steps(f"packed {len(lens)} docs up to {high} D={d} causal={causal}", make, q, k, v)
    for name, shape, make in cases:
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ab_steps(name, make, q, k, v)
        del q, k, v
        torch.cuda.empty_cache()
    if "fp8" in a.tables:  # the forward only (FP8 has no backward): q, k, v quantized per tensor
        for d in a.head_dims:
            for causal in (False, True):
                for n in a.fp8_lengths:
                    (q, qd), (k, kd), (v, vd) = (longattn.quantize_fp8(torch.randn(
                        16384 // n, n, 2048 // d, d, device="cuda", dtype=torch.bfloat16)) for _ in range(3))

                    def step(m, causal=causal, q=q, k=k, v=v, qd=qd, kd=kd, vd=vd):
                        def run():
                            with torch.no_grad():
                                m.flash_attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                        return run

                    ab(f"fp8 D={d} causal={causal} N={n}", "fwd", step(longattn), step(longattn_base))
    print("\n| case | pass | new ms | base ms | base/new |\n|---|---|---|---|---|")
    for name, mode, new, base in rows:
        print(f"| {name} | {mode} | {new:.3f} | {base:.3f} | {base / new:.3f} |")


if __name__ == "__main__":
    main()
