"""Plot block-sparse time against density, longattn and FlexAttention, from the Markdown tables of
benchmarks/bench_block_sparse.py.

    python tools/plot_block_sparse.py docs/bench/block_sparse_32k.md docs/bench/block_sparse_128k.md \
        --out docs/block_sparse_density.png
"""
from __future__ import annotations

import argparse
from collections import defaultdict


def read_rows(path):
    rows = []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0].endswith("k"):
            continue
        n, d, mask, dens, pass_, ours, dense, _, flex, _ = cells
        rows.append(dict(n=n, d=int(d), mask=mask, density=float(dens.rstrip("%")), pass_=pass_, ours=float(ours),
                         dense=float(dense), flex=float(flex)))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("tables", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for t in a.tables for r in read_rows(t)]
    panels = sorted({(r["n"], r["d"], r["pass_"]) for r in rows}, key=lambda x: (int(x[0][:-1]), x[1], x[2]))
    cols = 4
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4.2 * cols, 3.4 * -(-len(panels) // cols)),
                             squeeze=False)
    for ax, (n, d, pass_) in zip(axes.flat, panels):
        series = defaultdict(list)
        for r in rows:
            if (r["n"], r["d"], r["pass_"]) == (n, d, pass_):
                series[r["mask"]].append(r)
        for mask, style in (("random", "-"), ("local", "--")):
            pts = sorted(series.get(mask, []), key=lambda r: r["density"])
            if not pts:
                continue
            x = [r["density"] for r in pts]
            ax.plot(x, [r["ours"] for r in pts], style, marker="o", color="tab:blue", label=f"longattn {mask}")
            ax.plot(x, [r["flex"] for r in pts], style, marker="s", color="tab:green", label=f"Flex {mask}")
            dense = pts[0]["dense"]
        ax.axhline(dense, color="gray", lw=0.8, ls=":", label="longattn dense")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"N={n} D={d} {pass_.replace('_', '+')}", fontsize=10)
        ax.set_xlabel("density (%)")
        ax.set_ylabel("time (ms)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Block-sparse attention on an H100, bf16, H=16, blocks of 128: time against density")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
