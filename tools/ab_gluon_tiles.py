"""Check and time a variant of the Gluon forward's tiles (``GluonTiles`` fields such as ``row_parts`` or
``fast_tanh``) against the routed tiles, on one Hopper GPU:

    python tools/ab_gluon_tiles.py --set row_parts=1 [--softcap 50] [--rounds 5]

1. correctness: the routed tiles and the variant against the float64 reference (``longattn.reference``) on awkward
   shapes (N != M both ways, causal and not, grouped-query heads, D = 64, 128 and 256, bf16 and fp16, one row, a
   tail shorter than a block), the soft-cap given if any: the output's and the log-sum-exp's largest errors, whether
   rows without keys agree, and whether the two are bitwise equal;
2. time: the flash table (B·N = 16k, heads·D = 2048; N = 1k/4k/16k and D = 64 and 128 unless ``--lengths`` and
   ``--head-dims`` say otherwise; causal or not) of the forward with the routed tiles, the variant, SDPA's default
   and FlashAttention-4 where it imports, taking turns
   (``longattn.bench.interleaved``). Nothing here changes what longattn routes (``launch.TILES`` is read, not
   written).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from longattn.backends.gluon import launch  # noqa: E402
from longattn.backends.triton.launch import BandArgs  # noqa: E402
from longattn.bench.interleaved import env_header, time_interleaved  # noqa: E402
from longattn.call import Band  # noqa: E402
from longattn.reference import flash_attention as reference  # noqa: E402

CASES = [(2, 1000, 1000, 4, 4, 128, True, torch.bfloat16), (1, 777, 1300, 4, 2, 128, False, torch.bfloat16),
         (2, 1500, 900, 2, 1, 128, True, torch.float16), (1, 4095, 4096, 2, 2, 64, True, torch.bfloat16),
         (1, 2047, 2047, 6, 2, 64, False, torch.float16), (1, 900, 1100, 2, 2, 256, True, torch.bfloat16),
         (3, 1, 513, 4, 4, 128, False, torch.bfloat16), (1, 300, 129, 8, 8, 64, True, torch.bfloat16)]


def run(q, k, v, causal: bool, cap: float, tiles):
    """The Gluon forward's ``(out, lse)`` with ``tiles``."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    launch.forward(q, k, v, o, lse, None, BandArgs.of(Band.of(causal, (-1, -1))), q.shape[-1] ** -0.5,
                   softcap=cap, tiles=tiles)
    return o, lse


def check(variant: dict, cap: float) -> bool:
    ok = True
    for (B, N, M, H, Hk, D, causal, dt) in CASES:
        g = torch.Generator(device="cuda").manual_seed(N * 7 + M)
        q = torch.randn(B, N, H, D, device="cuda", dtype=dt, generator=g) * 2
        k = torch.randn(B, M, Hk, D, device="cuda", dtype=dt, generator=g) * 2
        v = torch.randn(B, M, Hk, D, device="cuda", dtype=dt, generator=g)
        ro, rl = reference(q.double(), k.double(), v.double(), causal=causal, softcap=cap, return_lse=True)
        seen = torch.isfinite(rl)
        got, errs = [], []
        for tiles in (launch.TILES[D], dataclasses.replace(launch.TILES[D], **variant)):
            o, lse = run(q, k, v, causal, cap, tiles)
            got.append((o, lse))
            errs.append(((o.double() - ro).abs().max().item(), (lse.double() - rl)[seen].abs().max().item(),
                         bool(torch.equal(torch.isneginf(lse), torch.isneginf(rl)))))
        good = errs[1][0] <= max(1.25 * errs[0][0], 2e-3) and errs[1][1] <= max(1.25 * errs[0][1], 1e-4) and errs[1][2]
        same = torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
        ok &= good
        print(f"{(B, N, M, H, Hk, D, causal, str(dt)[6:])}: routed out {errs[0][0]:.2e} lse {errs[0][1]:.2e}; "
              f"variant out {errs[1][0]:.2e} lse {errs[1][1]:.2e}; bitwise {same} {'ok' if good else 'FAIL'}",
              flush=True)
    return ok


def bench(variant: dict, cap: float, rounds: int, head_dims=(64, 128), lengths=(1024, 4096, 16384)) -> None:
    try:
        from flash_attn import cute as fa4
    except Exception:  # not installed here
        fa4 = None
    print("\n| D | N | causal | routed ms | variant ms | SDPA ms | FA4 ms | routed / variant | FA4 / variant |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    for d in head_dims:
        for n in lengths:
            for causal in (False, True):
                q, k, v = (torch.randn(16384 // n, n, 2048 // d, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                routed, varied = launch.TILES[d], dataclasses.replace(launch.TILES[d], **variant)
                steps = {"routed": lambda: run(q, k, v, causal, cap, routed),
                         "variant": lambda: run(q, k, v, causal, cap, varied)}
                if not cap:
                    steps["sdpa"] = lambda: F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                if fa4 is not None:
                    steps["fa4"] = lambda: fa4.flash_attn_func(q, k, v, causal=causal, softcap=cap)
                ms = time_interleaved(steps, rounds=rounds)
                sdpa, f4 = ms.get("sdpa", float("nan")), ms.get("fa4", float("nan"))
                print(f"| {d} | {n} | {causal} | {ms['routed']:.3f} | {ms['variant']:.3f} | {sdpa:.3f} | {f4:.3f} | "
                      f"{ms['routed'] / ms['variant']:.3f} | {f4 / ms['variant']:.3f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a GluonTiles field of the variant (integers; booleans as 0/1); repeatable "
                   "(a one-warp loader takes two consumers: consumers=3 at D=128 needs loader_warps=4 too)")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="the timed table's head dims")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="the timed table's N (B·N = 16k)")
    p.add_argument("--force", action="store_true", help="time the variant even where its check failed")
    a = p.parse_args()
    fields = {f.name: f.type for f in dataclasses.fields(launch.GluonTiles)}
    variant = {}
    for item in a.set:
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--set: {name!r} is not a GluonTiles field ({', '.join(fields)})")
        variant[name] = bool(int(value)) if "bool" in str(fields[name]) else int(value)
    print(env_header(), "variant:", variant, "softcap:", a.softcap, flush=True)
    if not torch.cuda.is_available() or launch.kernel_module() is None:
        raise SystemExit("the Gluon forward does not run here (it needs a Hopper GPU)")
    if not check(variant, a.softcap):
        if not a.force:
            raise SystemExit("correctness FAILED: not timed (--force times it anyway)")
        print("correctness FAILED: the times below are not to be read")
    bench(variant, a.softcap, a.rounds, a.head_dims, a.lengths)


if __name__ == "__main__":
    main()
