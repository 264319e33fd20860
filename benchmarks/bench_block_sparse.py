"""Issue-5 benchmark: block-sparse attention time against density, with our dense kernel and compiled FlexAttention
on the same block mask, all in the same run.

bf16, B=1, H=16, block 128, N in (32k, 128k), D in (64, 128), random and local (banded) masks at densities
100, 50, 25, 10, 5 %, forward and forward+backward.

    python benchmarks/bench_block_sparse.py [--lengths 32768 131072] [--dims 64 128] [--out FILE]
    python benchmarks/bench_block_sparse.py --adaptive-only   # cost of the content-adaptive selection
"""
from __future__ import annotations

import argparse

import torch

from longattn.bench.interleaved import emit, env_header, flex_fn, make_step, time_interleaved, time_pass

import longattn
from longattn.patterns import BlockSparsePattern

BLOCK = 128
DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.05)


def random_mask(h, nb, density, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.rand(1, h, nb, nb, device="cuda", generator=g) < density
    mask |= torch.eye(nb, dtype=torch.bool, device="cuda")  # keep every row non-empty
    return mask


def local_mask(h, nb, density):
    width = max(1, round(density * nb))
    i = torch.arange(nb, device="cuda")
    rel = i[None, :] - i[:, None]
    mask = (rel >= -(width // 2)) & (rel < width - width // 2)
    return mask[None, None].expand(1, h, nb, nb).contiguous()


def flex_block_mask(mask, n):
    from torch.nn.attention.flex_attention import BlockMask

    # Every listed block is a full block (no mask_mod inside), as in longattn (N is a multiple of the block).
    nb = mask.shape[-1]
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    zeros = torch.zeros_like(num)
    return BlockMask.from_kv_blocks(zeros, idx.clone(), num, idx, BLOCK_SIZE=BLOCK, seq_lengths=(n, n))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds, longattn and Flex taking turns")
    p.add_argument("--adaptive-only", action="store_true",
                   help="only the content-adaptive rows: selection cost beside the attention's")
    a = p.parse_args()
    if a.adaptive_only:
        return adaptive_cost(a)
    header = env_header()
    print(header, flush=True)
    h = 16
    lines = [f"Measured on {header}; bf16, B=1, H={h}, blocks of {BLOCK}; time in ms (median over {a.rounds} "
             "rounds of do_bench medians, longattn and Flex taking turns).", "",
             "| N | D | mask | density | pass | longattn ms | dense longattn ms | speedup vs own dense "
             "| Flex ms | vs Flex |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in a.lengths:
        nb = n // BLOCK
        for d in a.dims:
            q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            dense = {m: time_pass(lambda x, y, z: longattn.flash_attention(x, y, z, backend="triton"), q, k, v, m)
                     for m in ("fwd", "fwd_bwd")}
            for kind in ("random", "local"):
                for density in DENSITIES:
                    mask = random_mask(h, nb, density) if kind == "random" else local_mask(h, nb, density)
                    real = mask.float().mean().item()
                    # the public call with a BlockSparsePattern, as a model would make it (lists cached by the
                    # pattern on the first call, which time_interleaved makes before timing)
                    pattern = BlockSparsePattern(mask, BLOCK, seq_lens=(n, n))

                    def ours(x, y, z, pattern=pattern):
                        return longattn.block_sparse_attention(x, y, z, block_mask=pattern, backend="triton")

                    try:
                        fx = flex_fn(flex_block_mask(mask, n))
                    except Exception as e:  # noqa: BLE001
                        print(f"flex mask failed: {e}", flush=True)
                        fx = None
                    for mode in ("fwd", "fwd_bwd"):
                        steps = {"ours": make_step(ours, q, k, v, mode)}
                        if fx:
                            steps["flex"] = make_step(fx, q, k, v, mode)
                        ms = time_interleaved(steps, rounds=a.rounds)
                        t, tf = ms["ours"], ms.get("flex", float("nan"))
                        lines.append(f"| {n // 1024}k | {d} | {kind} | {100 * real:.1f}% | {mode} | {t:.3f} | "
                                     f"{dense[mode]:.3f} | {dense[mode] / t:.2f}x | {tf:.3f} | {tf / t:.2f}x |")
                        print(lines[-1], flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    emit("\n".join(lines), a.out)


def adaptive_cost(a) -> None:
    """Cost of ``patterns.adaptive`` (mean-pool, block scores, top-k) beside the attention on the mask it picks.

    The mask is new on every call (it depends on q and k), so "attention" includes its conversion to block lists.
    """
    from longattn.bench.interleaved import bench_ms
    from longattn import patterns

    header = env_header()
    h = 16
    lines = [f"Measured on {header}; bf16, B=1, H={h}, blocks of {BLOCK}; time in ms (median of do_bench). "
             "Selection: patterns.adaptive(q, k, keep); attention: block_sparse_attention on its mask (forward, "
             "mask conversion included).", "",
             "| N | D | keep | density | selection ms | attention fwd ms | selection / attention |",
             "|---|---|---|---|---|---|---|"]
    for n in a.lengths:
        for d in a.dims:
            q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for keep in (0.05, 0.1, 0.25):
                mask = patterns.adaptive(q, k, keep, block_size=BLOCK)
                sel = bench_ms(lambda: patterns.adaptive(q, k, keep, block_size=BLOCK))
                att = bench_ms(lambda: longattn.block_sparse_attention(
                    q, k, v, block_mask=patterns.adaptive(q, k, keep, block_size=BLOCK), block_size=BLOCK)) - sel
                lines.append(f"| {n // 1024}k | {d} | {keep} | {100 * mask.float().mean().item():.1f}% | {sel:.3f} | "
                             f"{att:.3f} | {sel / att:.3f} |")
                print(lines[-1], flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
