"""Time two versions of the kernels against each other on the same GPU: this checkout and another source tree.

    mkdir ab_tree && git archive <branch> longattn | tar -x -C ab_tree    # the other version, e.g. a branch
    python tools/ab_trees.py --tree ab_tree [--rounds 2] [--workloads causal4k_d64 dense16k_d128 ...]

(Through the device tool, keep ``ab_tree`` inside the checkout, untracked but not git-ignored, so that it travels
with the working tree; delete it afterwards.)

Each workload runs in alternating subprocesses (A, B, A, B, ...), each timing forward and forward+backward with
interleaved do_bench rounds, so that the GPU's state drifts over both versions alike. Prints one line per workload:
median ms of A and B and the ratio A/B (> 1: B is faster). Workloads are those of tools/tune_backward.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workloads(device="cuda"):
    """The workloads of tools/tune_backward.py. ``longattn`` is imported first, so that the version on
    PYTHONPATH is the one that runs (tune_backward puts this checkout at the front of sys.path)."""
    import longattn  # noqa: F401

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tune_backward import workloads as table

    return table(device)


def child(names, rounds):
    """Runs in the subprocess: time the named workloads with whatever ``longattn`` is first on sys.path."""
    import torch

    from longattn.bench.interleaved import make_step, time_interleaved

    import longattn

    out = {"longattn": longattn.__file__}
    table = workloads()
    for name in names:
        d, fn, (b, n, h) = table[name]
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
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
                                                      "causal4k_d128", "dilated128k", "sparse32k_d128_10"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="A/B subprocess pairs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.workloads, a.rounds)
    sys.path.insert(0, ROOT)  # the parent only lists workloads, from this checkout
    known = set(workloads("cpu"))
    if set(a.workloads) - known or not a.tree:
        raise SystemExit(f"--tree is required; workloads must be among {sorted(known)}")
    tree_b = os.path.abspath(a.tree)
    runs = {"A": [], "B": []}
    for _ in range(a.repeats):
        runs["A"].append(run_child(None, a.workloads, a.rounds))
        runs["B"].append(run_child(tree_b, a.workloads, a.rounds))
    print(f"A = {runs['A'][0]['longattn']}, B = {runs['B'][0]['longattn']}; median over {a.repeats} alternating "
          f"runs of {a.rounds} interleaved rounds")
    for name in a.workloads:
        for mode in ("fwd", "fwd_bwd"):
            ta = statistics.median(r[name][mode] for r in runs["A"])
            tb = statistics.median(r[name][mode] for r in runs["B"])
            print(f"{name:>16} {mode:>7}: A {ta:9.4f} ms  B {tb:9.4f} ms  A/B {ta / tb:.3f}", flush=True)


if __name__ == "__main__":
    main()
