"""Draw the block masks of the pattern library into docs/patterns/*.png (used by docs/patterns.md).

Usage: python tools/draw_patterns.py [--out docs/patterns]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from longattn import patterns as P  # noqa: E402

N, BLOCK = 32 * 128, 128  # a 32 x 32 block grid


def periodic_sequence(n: int, periods_in_blocks, seed: int) -> torch.Tensor:
    """(1, n, 1, D) sinusoidal features plus noise: the pooled score of two blocks is high when their distance is
    near a multiple of a period, so adaptive selection has structure to find."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float32)[:, None] / BLOCK
    freq = 2 * torch.pi / torch.tensor(periods_in_blocks, dtype=torch.float32)[None, :]
    feats = torch.cat([torch.cos(pos * freq), torch.sin(pos * freq)], 1)
    return (feats + 0.3 * torch.randn(feats.shape, generator=g))[None, :, None, :]


def figures():
    """(file stem, title, masks of one or more panels)."""
    yield "local", "Local(2)", [P.local(2, n=N, block_size=BLOCK)]
    yield "local_causal", "Local(3) & Causal()", [(P.Local(3) & P.Causal()).mask(N, block_size=BLOCK)]
    yield "causal_rect", "Causal(), N=3000, M=4096", [P.causal(n=3000, m=4096, block_size=BLOCK)]
    yield "global_tokens", "GlobalTokens(2)", [P.global_tokens(2, n=N, block_size=BLOCK)]
    dil = P.dilated([8, 16, 32], [1, 2, 4], n=N, block_size=BLOCK, heads=2)
    yield "dilated", "Dilated([8,16,32], [1,2,4]): head 0 | head 1", [dil[:, :1], dil[:, 1:]]
    yield "hierarchical", "Hierarchical(4, base=2)", [P.hierarchical(4, 2, n=N, block_size=BLOCK)]
    yield "random", "Random(0.1, seed=0)", [P.random(0.1, 0, n=N, block_size=BLOCK)]
    bigbird = P.Local(1) | P.GlobalTokens(1) | P.Random(0.06, seed=0)
    yield "bigbird", "Local(1) | GlobalTokens(1) | Random(0.06)", [bigbird.mask(N, block_size=BLOCK)]
    yield "hierarchical_causal", "Hierarchical(4) & Causal()", [(P.Hierarchical(4) & P.Causal()).mask(N, block_size=BLOCK)]
    q, k = periodic_sequence(N, [7.0, 23.0], 0), periodic_sequence(N, [7.0, 23.0], 1)
    yield "adaptive", "adaptive(q, k, keep=3, causal=True)", [P.adaptive(q, k, 3, block_size=BLOCK, causal=True)]


def draw(stem: str, title: str, masks, out: Path) -> None:
    fig, axes = plt.subplots(1, len(masks), figsize=(2.6 * len(masks), 2.9), dpi=80, squeeze=False)
    for ax, mask in zip(axes[0], masks):
        grid = mask[0, 0].float().numpy()
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(f"key blocks ({grid.shape[1]}), density {grid.mean():.0%}", fontsize=7)
        ax.set_ylabel(f"query blocks ({grid.shape[0]})", fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "patterns")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, title, masks in figures():
        draw(stem, title, masks, args.out)
        print(args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
