"""Sweep the decode split kernel's tiles and split counts as a serving engine runs it: in CUDA graphs.

    python tools/tune_decode.py [--tiles 64,4,4 128,8,3 32,2,4] [--splits 0 1 2 4 8 16 32 64] [--page 0]
                                [--new-tokens 1] [--append] [--rounds 3] [--shapes 1x32768x32 8x8192x32 ...]

Per shape (``BxMxHq``: batch, cached keys per sequence, query heads; Hk = 8, D = 128, bf16, lengths per sequence in
a tensor, full caches (``--append``: the new tokens' keys and values written into them by the call, as a
generation step does); ``--page P``: a paged cache of P-row pages, each sequence's pages scattered): ten calls of
each variant (tiles ``BLOCK_N,warps,stages`` forced through ``longattn.routing(tiles={"decode": ...})``, split
count through ``num_splits``; 0: the plan's own) are captured in one CUDA graph, SDPA's default over the same
contiguous cache and a device copy of K+V likewise, and the graphs take turns in interleaved rounds of
``do_bench`` (the host's cost of a call, which eager timing measures at small caches, is not what a serving
engine pays). Prints, per shape, the plan's time and choice, the plan without ``decode_launch.MANY_PROGRAMS``'
rows, the "plain" row of ``decode_launch.DECODE_TILES`` (the rule of GPUs without their own row) with its own split
count, the six (``--shown``) fastest variants (``--tiles`` with no value: none, an A/B of the plan), SDPA's, and the
copy bound (half a copy of K+V: reading them once at a copy's bandwidth). Winners go into ``decode_launch`` by
hand, with the run in docs/kernel_notes.md.

``--set FIELD=VALUE ...`` (fields of ``decode_launch.DecodeTiles``, e.g. ``tma=1``): the plan with
those fields in every row (``decode_launch.tiles_set``) is timed in the same rounds ("set"; plan/set > 1: the variant
faster), its largest difference from the plan's output printed first, and each ``--tiles`` variant is timed under
the set too ("+set").
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn.backends.triton import decode_launch  # noqa: E402
from longattn.backends.triton.tiles import Tiles  # noqa: E402
from longattn.bench.decode_suite import paged_copy  # noqa: E402
from longattn.bench.interleaved import env_header, time_interleaved  # noqa: E402

HK, D, CALLS = 8, 128, 10
SHAPES = ("1x2048x32", "1x32768x32", "1x131072x32", "1x262144x32", "2x65536x64", "4x16384x32", "8x8192x32",
          "8x32768x32", "16x2048x32", "32x2048x32", "64x2048x64", "64x4096x32")


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """``CALLS`` calls of ``fn`` captured in one graph (after a warm-up call outside it, which compiles)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    return g


def sweep(shape: str, tiles, splits, page: int, n_q: int, append: bool, rounds: int, shown: int = 6,
          fields=None) -> None:
    B, m, hq = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(B, m, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    q = torch.randn(B, n_q, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((B,), m - n_q if append else m, dtype=torch.int32, device="cuda")
    k_new, v_new = ((torch.randn(B, n_q, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
                    if append else (None, None))
    k_cache, v_cache, table = (kc, vc, None) if not page else paged_copy(kc, vc, page, gen)
    dst = torch.empty_like(kc)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def ours(n_splits: int):
        return lambda: longattn.flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                             block_table=table, causal=True, num_splits=n_splits)

    graphs = {}
    with torch.no_grad():
        graphs["copy"] = graph_of(lambda: (dst.copy_(kc), dst.copy_(vc)))
        graphs["sdpa"] = graph_of(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                                           enable_gqa=True))
        graphs["plan"] = graph_of(ours(0))
        many = dict(decode_launch.MANY_PROGRAMS)  # the plan as it would be without the many-programs rows
        decode_launch.PLANS.clear()
        decode_launch.MANY_PROGRAMS.clear()
        try:
            graphs["row"] = graph_of(ours(0))
        finally:
            decode_launch.MANY_PROGRAMS.update(many)
            decode_launch.PLANS.clear()
        plain = decode_launch.DECODE_TILES["plain"]  # the rule of other GPUs (and of sm_90 before its own row)
        with longattn.routing(tiles={"decode": Tiles(64, plain.block_n, plain.num_warps, plain.num_stages)}):
            graphs["plain"] = graph_of(ours(decode_launch.choose_splits(B, HK, m, q.device, plain)))
        for t in tiles:
            for s in splits:
                if s and s * t.block_n > m:
                    continue
                with longattn.routing(tiles={"decode": t}):
                    graphs[f"{t.block_n},{t.num_warps},{t.num_stages}/{s or 'auto'}"] = graph_of(ours(s))
                    if fields:
                        with decode_launch.tiles_set(**fields):
                            graphs[f"{t.block_n},{t.num_warps},{t.num_stages}/{s or 'auto'}+set"] = graph_of(ours(s))
        if fields:
            with decode_launch.tiles_set(**fields):
                graphs["set"] = graph_of(ours(0))
                got = ours(0)().float()
            want = ours(0)().float()
            print(f"{shape}: set {fields}: max |plan - set| {(got - want).abs().max().item():.3g}", flush=True)
        ms = time_interleaved({name: g.replay for name, g in graphs.items()}, rounds=rounds, warmup=10, rep=50)
    us = {name: t * 1e3 / CALLS for name, t in ms.items()}
    bound, sdpa, plan, plain, row = us.pop("copy") / 2, us.pop("sdpa"), us.pop("plan"), us.pop("plain"), us.pop("row")
    if fields:
        got = us.pop("set")
        print(f"{shape} page={page} new={n_q}: set {got:.1f} µs, plan/set {plan / got:.3f}, "
              f"SDPA/set {sdpa / got:.2f}, bound/set {bound / got:.2f}", flush=True)
    best = sorted(us.items(), key=lambda x: x[1])
    chosen = longattn.explain(longattn.flash_attention_with_kvcache, q, k_cache, v_cache, k_new, v_new,
                              cache_seqlens=lens, block_table=table, causal=True).pass_("decode").chosen
    print(f"{shape} page={page} new={n_q}{' appended' if append else ''}: plan {plan:.1f} µs ({chosen}), "
          f"without MANY_PROGRAMS {row:.1f} (it/plan {row / plan:.2f}), "
          f"'plain' rule {plain:.1f} (plain/plan {plain / plan:.2f}), SDPA {sdpa:.1f} (SDPA/plan {sdpa / plan:.2f}), "
          f"copy bound {bound:.1f}; bound/plan {bound / plan:.2f}, "
          + (f"bound/best {bound / best[0][1]:.2f}, plan/best {plan / best[0][1]:.2f}" if best else ""), flush=True)
    print("    " + ", ".join(f"{name} {t:.1f}" for name, t in best[:shown]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", nargs="*", default=["64,4,4", "128,8,3", "32,2,4"], help="BLOCK_N,warps,stages")
    p.add_argument("--splits", nargs="+", type=int, default=[0, 1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--page", type=int, default=0, help="rows per page of a paged cache (0: contiguous)")
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--append", action="store_true", help="the call writes the new tokens' keys and values")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="BxMxHq")
    p.add_argument("--shown", type=int, default=6, help="the fastest variants printed per shape")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="a variant of every DECODE_TILES row (decode_launch.tiles_set), timed against the plan")
    a = p.parse_args()
    tiles = [Tiles(0, *(int(x) for x in t.split(","))) for t in a.tiles]
    row = decode_launch.DECODE_TILES["plain"]
    fields = {}
    for item in a.set:
        name, _, value = item.partition("=")
        if name not in row._fields:
            raise SystemExit(f"--set: {name!r} is not a DecodeTiles field ({', '.join(row._fields)})")
        kind = type(getattr(row, name))
        fields[name] = bool(int(value)) if kind is bool else kind(value)
    print(env_header(), flush=True)
    for shape in a.shapes:
        sweep(shape, tiles, a.splits, a.page, a.new_tokens, a.append, a.rounds, a.shown, fields)


if __name__ == "__main__":
    main()
