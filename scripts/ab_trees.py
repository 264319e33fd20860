"""Time two versions of the kernels against each other on the same GPU: this checkout and another source tree.

    mkdir ab_tree && git archive <branch> longattn | tar -x -C ab_tree    # the other version, e.g. a branch
    python scripts/ab_trees.py --tree ab_tree [--rounds 2] [--workloads causal4k_d64 dense16k_d128 ...]

(Through the device tool, keep ``ab_tree`` inside the checkout, untracked but not git-ignored, so that it travels
with the working tree; delete it afterwards.)

Each workload runs in alternating subprocesses (A, B, A, B, ...), each timing forward and forward+backward with
interleaved do_bench rounds, so that the GPU's state drifts over both versions alike. Prints one line per workload:
median ms of A and B and the ratio A/B (> 1: B is faster). Workloads: dense/causal flash attention at D=64/128 and
N=1k/4k/16k (batch*N = 16k, heads*D = 2048), dilated attention at 128k, block-sparse at 32k (10% random).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workloads():
    w = {f"{'causal' if c else 'dense'}{n // 1024}k_d{d}": ("flash", d, n, c)
         for d in (64, 128) for c in (False, True) for n in (1024, 4096, 16384)}
    w["dilated128k_d64"] = ("dilated", 64, 131072, False)
    w["sparse32k_d64"] = ("sparse", 64, 32768, False)
    w["sparse32k_d128"] = ("sparse", 128, 32768, False)
    return w


def child(names, rounds):
    """Runs in the subprocess: time the named workloads with whatever ``longattn`` is first on sys.path."""
    import torch

    import longattn
    from benchmarks.common import make_step, time_interleaved
    from longattn import patterns as P

    out = {}
    for name in names:
        kind, d, n, causal = workloads()[name]
        if kind == "flash":
            shape = (16384 // n, n, 2048 // d, d)

            def fn(q, k, v):
                return longattn.flash_attention(q, k, v, causal=causal, backend="triton")
        elif kind == "dilated":
            shape = (1, n, 16, d)

            def fn(q, k, v):
                return longattn.dilated_attention(q, k, v, segment_lengths=(2048, 4096, 8192, 16384),
                                                  dilation_rates=(1, 2, 4, 8), backend="triton")
        else:
            shape = (1, n, 16, d)
            pattern = (P.Random(0.1, seed=0) | P.Local(0)).build(n, block_size=128, heads=16, device="cuda")

            def fn(q, k, v):
                return longattn.block_sparse_attention(q, k, v, block_mask=pattern, backend="triton")
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out[name] = time_interleaved({m: make_step(fn, q, k, v, m) for m in ("fwd", "fwd_bwd")}, rounds=rounds)
        del q, k, v
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps(out), flush=True)


def run_child(tree, names, rounds):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rounds", str(rounds), "--workloads", *names]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree or ROOT)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"child for tree {tree or 'this checkout'} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tree", help="directory holding the other version's longattn/ package")
    p.add_argument("--workloads", nargs="+", default=["causal1k_d64", "causal4k_d64", "dense4k_d64", "dense16k_d128",
                                                      "causal4k_d128", "dilated128k_d64", "sparse32k_d128"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="A/B subprocess pairs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.workloads, a.rounds)
    unknown = set(a.workloads) - set(workloads())
    if unknown or not a.tree:
        raise SystemExit(f"--tree is required; workloads must be among {sorted(workloads())}")
    tree_b = os.path.abspath(a.tree)
    runs = {"A": [], "B": []}
    for _ in range(a.repeats):
        runs["A"].append(run_child(None, a.workloads, a.rounds))
        runs["B"].append(run_child(tree_b, a.workloads, a.rounds))
    print(f"A = this checkout, B = {a.tree}; median over {a.repeats} alternating runs of {a.rounds} interleaved rounds")
    for name in a.workloads:
        for mode in ("fwd", "fwd_bwd"):
            ta = statistics.median(r[name][mode] for r in runs["A"])
            tb = statistics.median(r[name][mode] for r in runs["B"])
            print(f"{name:>16} {mode:>7}: A {ta:9.4f} ms  B {tb:9.4f} ms  A/B {ta / tb:.3f}", flush=True)


if __name__ == "__main__":
    main()
