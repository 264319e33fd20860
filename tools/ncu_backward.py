"""Nsight Compute of our routed Gluon backward (the fused kernel, or the 128 x 128 tile at D=64) against
FlashAttention-4's sm90 backward on one shape (one GPU, FA4 and ``ncu`` installed): kernel time, instructions, SM
and issue utilisation, the main stall reasons per issued instruction, and the instruction mix by opcode, side by
side.

    python tools/ncu_backward.py [--d 128] [--n 4096] [--causal] [--deterministic] [--source [--impls ours fa4]]

B·N = 16k, heads·D = 2048, bf16. Each implementation runs in a child process under ``ncu``; the profiled kernel is
the fourth backward launch (three warm-up steps first). ``--deterministic``: both backwards in their deterministic
mode (``deterministic=True``), against the default's columns of a run without it. ``--child ours|fa4`` is that
child (internal).

``--source``: where each kernel's time goes instruction by instruction instead (``SourceCounters``' warp-state
sampling, the SASS page exported as CSV): the stall reasons' shares of all samples, every loop (a backward branch)
with its samples per execution of its first instruction, and the instructions with the most samples and their main
stall reasons. How the thirty-second session of 2026-12-03 split a causal program's time into its query loops and
its fixed part.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import subprocess
import sys
import tempfile

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


def _ncu(which: str, d: int, n: int, causal: bool, deterministic: bool, *options: str) -> list:
    """The command that runs ``ncu`` with ``options`` on the ``which`` child's fourth backward launch."""
    return (["ncu", "--launch-skip", "3", "--launch-count", "1", "--kernel-name", f"regex:{KERNELS[which]}",
             *options, sys.executable, os.path.abspath(__file__), "--child", which, "--d", str(d), "--n", str(n)]
            + (["--causal"] if causal else []) + (["--deterministic"] if deterministic else []))


def profile(which: str, d: int, n: int, causal: bool, deterministic: bool) -> dict:
    stalls = [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
    cmd = _ncu(which, d, n, causal, deterministic, "--metrics", ",".join([*METRICS.values(), *stalls, OPCODES]),
               "--print-metric-instances", "details", "--csv", "--page", "raw")
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


def source_profile(which: str, d: int, n: int, causal: bool, deterministic: bool) -> list:
    """The ``which`` kernel's instructions as :func:`parse_source_page` gives them (ncu's source page: warp-state
    sampling per SASS instruction)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "source")
        run = subprocess.run(_ncu(which, d, n, causal, deterministic, "--section", "SourceCounters", "--section",
                                  "WarpStateStats", "--import-source", "no", "-f", "-o", report),
                             capture_output=True, text=True)
        page = subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "source", "--csv", "--print-source=sass"],
                              capture_output=True, text=True).stdout
    rows = parse_source_page(page)
    if not rows:
        raise SystemExit(f"ncu gave no source page for {which}:\n{run.stdout[-1500:]}{run.stderr[-1500:]}")
    return rows


def parse_source_page(page: str) -> list:
    """The rows of ncu's ``--page source --csv`` export: ``(offset, sass, samples, executed, {stall: samples},
    branch target offset or None)``, offsets from the kernel's first instruction."""
    rows = list(csv.reader(io.StringIO(page)))
    head = next((i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"]), None)
    if head is None:
        return []
    names = rows[head]
    col = {name: i for i, name in enumerate(names)}
    stalls = [name for name in names if name.startswith("stall_") and "Not Issued" not in name]
    out, base = [], None
    for r in rows[head + 1:]:
        if len(r) < len(names) or not r[0].startswith("0x"):
            continue
        addr = int(r[0], 16)
        base = addr if base is None else base
        count = lambda name: int(r[col[name]].replace(",", "") or 0)  # noqa: E731
        sass = r[1].strip()
        branch = re.search(r"\bBRA\s+0x([0-9a-f]+)", sass)
        out.append((addr - base, sass, count("Warp Stall Sampling (All Samples)"), count("Instructions Executed"),
                    {name[6:]: count(name) for name in stalls}, int(branch.group(1), 16) - base if branch else None))
    return out


def summarize_source(rows: list, top: int = 20) -> str:
    """Stall shares, loops and the hottest instructions of :func:`source_profile`'s rows, as markdown."""
    total = sum(r[2] for r in rows) or 1
    reasons: dict = {}
    for r in rows:
        for name, c in r[4].items():
            reasons[name] = reasons.get(name, 0) + c
    lines = ["stall reasons (share of all samples): " + ", ".join(
        f"{name} {c / total:.3f}" for name, c in sorted(reasons.items(), key=lambda x: -x[1])[:10] if c), "",
        "| loop (offsets) | instructions | share of samples | executions of its first | samples / execution |",
        "|---|---|---|---|---|"]
    for off, _, _, _, _, target in rows:
        if target is None or target >= off:
            continue  # not a backward branch
        body = [r for r in rows if target <= r[0] <= off]
        samples, first = sum(r[2] for r in body), body[0][3]
        if samples / total >= 0.005:
            lines.append(f"| {target:06x}-{off:06x} | {len(body)} | {samples / total:.3f} | {first} | "
                         f"{samples / first if first else float('nan'):.3f} |")
    lines += ["", "| offset | share | executed | instruction | main stalls |", "|---|---|---|---|---|"]
    for off, sass, samples, executed, st, _ in sorted(rows, key=lambda r: -r[2])[:top]:
        main = ", ".join(f"{k} {v}" for k, v in sorted(st.items(), key=lambda x: -x[1])[:3] if v)
        lines.append(f"| {off:06x} | {samples / total:.3f} | {executed} | `{sass[:60]}` | {main} |")
    return "\n".join(lines)


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
