"""PNG plots of a run (matplotlib, the optional ``bench`` extra): time and memory against N (log-log) and TFLOP/s
by implementation. Without matplotlib, :func:`make_plots` returns no files and a note saying so.

Every implementation has one colour and one marker in every plot (:func:`style`). Panels are one pass (row) by one
workload (column). Where a line's values lie on an earlier line of its panel (``backend="auto"`` running SDPA's
kernel, two SDPA backends choosing the same CPU kernel), decided point by point (:func:`point_depths`), its
markers there are hollow and larger and its segments between two such points dashed (the dashes in the gaps of the
lines under it), so every line stays visible; elsewhere it is drawn as any line. The TFLOP/s bars have a log axis:
the sparse workloads' few TFLOP/s show beside dense attention's hundreds. The legend sits below the panels, outside
every axes; a run marked unstable says so on every figure.
"""
from __future__ import annotations

import math
import textwrap
import zlib
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from longattn.bench.results import Row

# One colour and marker per implementation, the same in every plot of every run.
COLORS = {
    "longattn": "#1f77b4", "longattn-triton": "#ff7f0e", "sdpa": "#2ca02c", "sdpa-flash": "#d62728",
    "sdpa-cudnn": "#9467bd", "sdpa-efficient": "#8c564b", "sdpa-math": "#e377c2", "flex": "#bcbd22",
    "materialized": "#7f7f7f", "composition": "#17becf",
}
MARKERS = {
    "longattn": "o", "longattn-triton": "s", "sdpa": "^", "sdpa-flash": "v", "sdpa-cudnn": "D",
    "sdpa-efficient": "P", "sdpa-math": "X", "flex": "*", "materialized": "<", "composition": ">",
}
_OTHER_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
_OTHER_MARKERS = ("h", "p", "8", "d", "H")
COINCIDE = 0.03  # lines whose values differ by less than this (relative) at some N lie on each other there
PASS_TITLES = {"fwd": "forward", "fwd_bwd": "forward+backward"}


def style(impl: str) -> Tuple[str, str]:
    """``(colour, marker)`` of an implementation: fixed for the known ones, derived from the name otherwise."""
    if impl in COLORS:
        return COLORS[impl], MARKERS[impl]
    h = zlib.crc32(impl.encode())
    return _OTHER_COLORS[h % len(_OTHER_COLORS)], _OTHER_MARKERS[h % len(_OTHER_MARKERS)]


def _order(impl: str):
    names = list(COLORS)
    return (names.index(impl), "") if impl in names else (len(names), impl)


def _series(rows: Sequence[Row], value) -> Dict[str, List[Tuple[int, float]]]:
    """``impl -> sorted [(N, value)]`` over the ok rows with a value."""
    out: Dict[str, List[Tuple[int, float]]] = {}
    for r in rows:
        y = value(r)
        if r.ok and y:
            out.setdefault(r.impl, []).append((r.n, y))
    return {k: sorted(v) for k, v in out.items()}


def point_depths(series: Dict[str, List[Tuple[int, float]]], impls: Sequence[str]) -> Dict[str, List[int]]:
    """For each line of ``series`` in drawing order ``impls``, at each of its points, the number of earlier lines
    with an equal value (within :data:`COINCIDE`) at that N: two lines meeting at one N overlap there only."""
    values = {impl: dict(series[impl]) for impl in impls}
    return {impl: [sum(1 for other in impls[:i] if n in values[other]
                       and abs(math.log(y / values[other][n])) < COINCIDE) for n, y in series[impl]]
            for i, impl in enumerate(impls)}


def _draw_line(ax, impl: str, points: List[Tuple[int, float]], depths: List[int], slots: int) -> None:
    """One implementation's line: solid with filled markers where it lies on no earlier line; where it does
    (``depths[i]`` lines under point ``i``), hollow larger markers, and dashes in the k-th slot of the dash period
    on a segment whose two ends both lie on k or more lines (the solid line under all in slot 0)."""
    color, marker = style(impl)
    for i in range(len(points) - 1):
        k = min(depths[i], depths[i + 1])
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        ax.plot([x0, x1], [y0, y1], color=color, label=f"_{impl} segment", zorder=2 + k,
                linestyle=(3.0 * (slots - k), (3.0, 3.0 * (slots - 1))) if k else "-")
    for k in sorted(set(depths)):
        xs, ys = zip(*(p for p, d in zip(points, depths) if d == k))
        ax.plot(xs, ys, color=color, marker=marker, linestyle="none", label=impl, markersize=5 + 4 * k,
                markerfacecolor="none" if k else color, markeredgewidth=1.2 if k else 1.0, zorder=2 + k)


def _legend_below(fig, handles, labels, panel_rows: int, panel_h: float, title: str,
                  warnings: Sequence[str] = ()) -> None:
    """Put the title, any warnings under it, and the figure's legend under its panels: the figure grows by the
    legend's and the warnings' height, the panels keep theirs."""
    longest = max(len(label) for label in labels)
    ncol = max(1, min(len(labels), int(fig.get_figwidth() / (0.6 + 0.065 * longest))))
    legend_h = 0.3 + 0.24 * math.ceil(len(labels) / max(ncol, 1))
    warnings = [line for w in warnings for line in textwrap.wrap(w, width=int(fig.get_figwidth() * 12))]
    title_h = 0.45 + 0.2 * len(warnings)
    height = panel_rows * panel_h + legend_h + title_h
    fig.set_figheight(height)
    fig.tight_layout(rect=(0, legend_h / height, 1, 1 - title_h / height))
    fig.suptitle(title, y=1 - 0.08 / height, va="top")
    if warnings:
        fig.text(0.5, 1 - 0.4 / height, "\n".join(warnings), ha="center", va="top", color="#b00000", fontsize=9)
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8,
               frameon=False)


def loglog_figure(plt, rows: Sequence[Row], value, ylabel: str, title: str, warnings: Sequence[str] = ()):
    """A grid of log-log panels, one pass per row and one workload per column, of ``value(row)`` against N; None
    when no row has a value. ``warnings``: lines shown under the title (an unstable machine)."""
    kinds = sorted({r.workload for r in rows})
    passes = [p for p in PASS_TITLES if any(r.pass_ == p for r in rows)]
    if not any(_series(rows, value).values()) or not passes:
        return None
    panel_w, panel_h = 4.4, 3.4
    fig, axes = plt.subplots(len(passes), len(kinds), figsize=(panel_w * len(kinds), panel_h * len(passes)),
                             squeeze=False)
    same_as: Dict[str, Dict[str, List[str]]] = {}  # impl -> {X: workloads where it ran X's kernel}
    drawn_impls, overlaid = set(), False
    for row_axes, pass_ in zip(axes, passes):
        for ax, kind in zip(row_axes, kinds):
            panel = [r for r in rows if r.workload == kind and r.pass_ == pass_]
            copies = {r.impl: r.same_as for r in panel if r.same_as}
            series = _series(panel, value)
            # rows repeating another's kernel go last, so that they are the ones drawn on top, dashed
            impls = sorted(series, key=lambda i: (i in copies, _order(i)))
            depths = point_depths(series, impls)
            slots = max((max(d) for d in depths.values()), default=0) + 1
            for impl in impls:
                _draw_line(ax, impl, series[impl], depths[impl], slots)
                drawn_impls.add(impl)
                overlaid |= any(depths[impl])
                if impl in copies:
                    kinds_of = same_as.setdefault(impl, {}).setdefault(copies[impl], [])
                    if kind not in kinds_of:
                        kinds_of.append(kind)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{kind}, {PASS_TITLES[pass_]}", fontsize=10)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    from matplotlib.lines import Line2D

    impls = sorted(drawn_impls, key=_order)
    handles = [Line2D([], [], color=style(i)[0], marker=style(i)[1], linestyle="-") for i in impls]
    labels = [i + "".join(f" (same kernel as {x} on {', '.join(k)})" for x, k in same_as.get(i, {}).items())
              for i in impls]
    if overlaid:
        handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="none", markersize=8,
                              linestyle="--"))
        labels.append("dashed, hollow: on top of an equal line (at those points)")
    _legend_below(fig, handles, labels, len(passes), panel_h, title, warnings)
    return fig


def tflops_figure(plt, rows: Sequence[Row], warnings: Sequence[str] = ()):
    """TFLOP/s of each implementation on each workload at the largest N of the speed suite, on a log axis (None
    without rows). A missing case has no bar."""
    speed = [r for r in rows if r.suite == "speed" and r.ok and r.tflops]
    if not speed:
        return None
    n_max = {kind: max(r.n for r in speed if r.workload == kind) for kind in {r.workload for r in speed}}
    kinds = sorted(n_max)
    impls = sorted({r.impl for r in speed}, key=_order)
    lowest = min(r.tflops for r in speed)
    panel_h = 4.0
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(kinds) * 2), panel_h), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for ax, pass_ in zip(axes[0], ("fwd", "fwd_bwd")):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for x, kind in enumerate(kinds):
                match = [r.tflops for r in speed if r.impl == impl and r.workload == kind and r.pass_ == pass_
                         and r.n == n_max[kind]]
                if match:
                    xs.append(x + i * width)
                    ys.append(match[0])
            ax.bar(xs, ys, width, label=impl, color=style(impl)[0])
        ax.set_yscale("log")
        ax.set_ylim(bottom=lowest / 3)  # the floor below the smallest bar, so that it shows
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(kinds))])
        ax.set_xticklabels([f"{k}\nN={n_max[k]}" for k in kinds], fontsize=8)
        ax.set_ylabel("TFLOP/s (log)")
        ax.set_title(PASS_TITLES[pass_])
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = _unique_legend(axes[0])
    _legend_below(fig, handles, labels, 1, panel_h, "Throughput by implementation (largest N of the speed suite)",
                  warnings)
    return fig


def _unique_legend(axes) -> Tuple[list, list]:
    """Legend entries of the panels, each implementation once (a panel may lack some)."""
    seen: Dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    names = sorted(seen, key=_order)
    return [seen[n] for n in names], names


def _save(plt, fig, path: Path) -> bool:
    if fig is None:
        return False
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_plots(rows: Sequence[Row], out_dir, warnings: Sequence[str] = ()) -> Tuple[List[str], str]:
    """Draw the plots into ``out_dir``: ``(paths written, note)``; the note explains plots not drawn.
    ``warnings`` (the unstable-machine warning of the run) go on every figure."""
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
    title = "Time against N (batch 1)" if time_rows and time_rows[0].suite == "scaling" else "Time against N"
    if _save(plt, loglog_figure(plt, time_rows, lambda r: r.time_ms, "time (ms)", title, warnings),
             out / "time_vs_n.png"):
        written.append(str(out / "time_vs_n.png"))
    mem_rows = [r for r in rows if r.suite == "memory"]
    if _save(plt, loglog_figure(plt, mem_rows, lambda r: r.mb_per_token, "MB per token (beyond inputs)",
                                "Peak memory per token against N", warnings), out / "memory_vs_n.png"):
        written.append(str(out / "memory_vs_n.png"))
    if _save(plt, tflops_figure(plt, rows, warnings), out / "tflops.png"):
        written.append(str(out / "tflops.png"))
    note = "" if written else "No plots: the suites run produced no timed or memory rows to draw."
    return written, note
