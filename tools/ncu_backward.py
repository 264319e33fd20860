"""Nsight Compute of our routed Gluon backward (the fused kernel, or the 128 x 128 tile at D=64) against
FlashAttention-4's sm90 backward on one shape (one GPU, FA4 and ``ncu`` installed): kernel time, instructions, SM
and issue utilisation, the main stall reasons per issued instruction, and the instruction mix by opcode, side by
side.

    python tools/ncu_backward.py [--d 128] [--n 4096] [--causal] [--deterministic]

B·N = 16k, heads·D = 2048, bf16. Each implementation runs in a child process under ``ncu``; the profiled kernel is
the fourth backward launch (three warm-up steps first). ``--deterministic``: both backwards in their deterministic
mode (``deterministic=True``), against the default's columns of a run without it. ``--child ours|fa4`` is that
child (internal).
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import subprocess
import sys

KERNELS = {"ours": "bwd_fused|bwd_wide_tile", "fa4": "BackwardSm90"}  # ours: the routed Gluon backward
METRICS = {
    "kernel time (us, ncu clocks)": "gpu__time_duration.sum",
    "instructions (M)": "sm__inst_executed.sum",
    "SM throughput (%)": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "issue slots busy (%)": "smsp__issue_active.avg.pct_of_peak_sustained_elapsed",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
}
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "wait", "mio_throttle", "math_pipe_throttle",
          "dispatch_stall", "not_selected", "lg_throttle", "no_instruction")
OPCODES = "sass__inst_executed_per_opcode"


def child(which: str, d: int, n: int, causal: bool, deterministic: bool) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    import longattn
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    if which == "fa4":
        import flash_attn.cute as fa4
        step = lambda: fa4.flash_attn_func(q, k, v, causal=causal,  # noqa: E731
                                           deterministic=deterministic)[0].backward(do)
    else:
        step = lambda: longattn.flash_attention(q, k, v, causal=causal, backend="triton",  # noqa: E731
                                                deterministic=deterministic).backward(do)
    for _ in range(4):
        step()
    torch.cuda.synchronize()


def profile(which: str, d: int, n: int, causal: bool, deterministic: bool) -> dict:
    stalls = [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
    cmd = ["ncu", "--launch-skip", "3", "--launch-count", "1", "--kernel-name", f"regex:{KERNELS[which]}",
           "--metrics", ",".join([*METRICS.values(), *stalls, OPCODES]), "--print-metric-instances", "details",
           "--csv", "--page", "raw", sys.executable, os.path.abspath(__file__), "--child", which, "--d", str(d),
           "--n", str(n)] + (["--causal"] if causal else []) + (["--deterministic"] if deterministic else [])
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    rows = [r for r in csv.reader(io.StringIO(out)) if len(r) > 5]
    if len(rows) < 3:
        raise SystemExit(f"ncu found no {which} kernel:\n{out[-2000:]}")
    row = dict(zip(rows[0], rows[2]))
    num = lambda key: float(row[key].split(" ")[0].replace(",", ""))  # noqa: E731
    got = {name: num(key) for name, key in METRICS.items()}
    got["kernel time (us, ncu clocks)"] /= 1e3
    got["instructions (M)"] /= 1e6
    got.update({f"stall {s}": num(key) for s, key in zip(STALLS, stalls)})
    got["opcodes"] = {op: int(c.replace(",", "")) / 1e6
                      for op, c in re.findall(r"([A-Z][A-Z0-9_.]*)\s*[:=]\s*([\d,]+)", row[OPCODES])}
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--child", choices=sorted(KERNELS))
    a = p.parse_args()
    if a.child:
        return child(a.child, a.d, a.n, a.causal, a.deterministic)
    res = {w: profile(w, a.d, a.n, a.causal, a.deterministic) for w in ("ours", "fa4")}
    print(f"\nD={a.d}, N={a.n}, causal={a.causal}, deterministic={a.deterministic}\n\n"
          "| | ours | FA4 | ours / FA4 |\n|---|---|---|---|")
    for key in [*METRICS, *(f"stall {s}" for s in STALLS)]:
        o, f = res["ours"][key], res["fa4"][key]
        print(f"| {key} | {o:.2f} | {f:.2f} | {o / f if f else float('inf'):.2f} |")
    ops = res["ours"]["opcodes"], res["fa4"]["opcodes"]
    names = sorted(set(ops[0]) | set(ops[1]), key=lambda x: -(ops[0].get(x, 0) + ops[1].get(x, 0)))[:30]
    print("\n| opcode (M executed) | ours | FA4 | ours - FA4 |\n|---|---|---|---|")
    for x in names:
        print(f"| {x} | {ops[0].get(x, 0):.1f} | {ops[1].get(x, 0):.1f} | {ops[0].get(x, 0) - ops[1].get(x, 0):+.1f} |")


if __name__ == "__main__":
    main()
