"""PNG plots of a run (matplotlib, the optional ``bench`` extra): time and memory against N (log-log) and TFLOP/s
by implementation. Without matplotlib, :func:`make_plots` returns no files and a note saying so."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from longattn.bench.results import Row


def _series(rows: Sequence[Row], value) -> Dict[Tuple[str, str], List[Tuple[int, float]]]:
    """``(impl, pass) -> sorted [(N, value)]`` over the ok rows with a value."""
    out: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
    for r in rows:
        y = value(r)
        if r.ok and y:
            out.setdefault((r.impl, r.pass_), []).append((r.n, y))
    return {k: sorted(v) for k, v in out.items()}


def _colors(plt, impls) -> Dict[str, str]:
    """One color per implementation, the same in every panel (longattn first)."""
    order = sorted(set(impls), key=lambda name: (name != "longattn", name))
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    return {name: cycle[i % len(cycle)] for i, name in enumerate(order)}


def _loglog_grid(plt, rows: Sequence[Row], value, ylabel: str, title: str, path: Path) -> bool:
    kinds = sorted({r.workload for r in rows})
    if not kinds:
        return False
    color = _colors(plt, [r.impl for r in rows])
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.2 * len(kinds), 4.2), squeeze=False)
    drawn = False
    for ax, kind in zip(axes[0], kinds):
        series = _series([r for r in rows if r.workload == kind], value)
        for (impl, pass_), pts in sorted(series.items(), key=lambda kv: (kv[0][0] != "longattn", kv[0])):
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", color=color[impl], linestyle="-" if pass_ == "fwd" else "--",
                    label=f"{impl} {pass_}")
            drawn = True
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(kind)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if any(r.pass_ == "fwd_bwd" for r in rows):
            ax.text(0.01, 0.01, "solid: forward, dashed: forward+backward", transform=ax.transAxes, fontsize=7,
                    alpha=0.7)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _tflops_bars(plt, rows: Sequence[Row], path: Path) -> bool:
    """TFLOP/s of each implementation on each workload at the largest N of the speed suite."""
    speed = [r for r in rows if r.suite == "speed" and r.ok and r.tflops]
    if not speed:
        return False
    n_max = {kind: max(r.n for r in speed if r.workload == kind) for kind in {r.workload for r in speed}}
    kinds = sorted(n_max)
    color = _colors(plt, [r.impl for r in speed])
    impls = list(color)
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(kinds) * 2), 4.5), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for ax, pass_ in zip(axes[0], ("fwd", "fwd_bwd")):
        for i, impl in enumerate(impls):
            ys = []
            for kind in kinds:
                match = [r.tflops for r in speed if r.impl == impl and r.workload == kind and r.pass_ == pass_
                         and r.n == n_max[kind]]
                ys.append(match[0] if match else 0.0)
            ax.bar([x + i * width for x in range(len(kinds))], ys, width, label=impl, color=color[impl])
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(kinds))])
        ax.set_xticklabels([f"{k}\nN={n_max[k]}" for k in kinds], fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(pass_)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Throughput by implementation (largest N of the speed suite)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_plots(rows: Sequence[Row], out_dir) -> Tuple[List[str], str]:
    """Draw the plots into ``out_dir``: ``(paths written, note)``; the note explains plots not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "Plots skipped: matplotlib is not installed (pip install 'longattn[bench]')."
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    timed = [r for r in rows if r.suite in ("scaling", "speed") and (r.suite == "speed" or r.sweep == "N")]
    # scaling has the longest N range; fall back to the speed suite when scaling did not run
    time_rows = [r for r in timed if r.suite == "scaling"] or [r for r in timed if r.suite == "speed"]
    if _loglog_grid(plt, time_rows, lambda r: r.time_ms, "time (ms)", "Time against N (batch 1)"
                    if time_rows and time_rows[0].suite == "scaling" else "Time against N", out / "time_vs_n.png"):
        written.append(str(out / "time_vs_n.png"))
    mem_rows = [r for r in rows if r.suite == "memory"]
    if _loglog_grid(plt, mem_rows, lambda r: r.mb_per_token, "MB per token (beyond inputs)",
                    "Peak memory per token against N", out / "memory_vs_n.png"):
        written.append(str(out / "memory_vs_n.png"))
    if _tflops_bars(plt, rows, out / "tflops.png"):
        written.append(str(out / "tflops.png"))
    note = "" if written else "No plots: the suites run produced no timed or memory rows to draw."
    return written, note
