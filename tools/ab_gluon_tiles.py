"""Check and time a variant of the Gluon forward's tiles (``GluonTiles`` fields such as ``row_parts`` or
``fast_tanh``) against the routed tiles (``launch.TILES``; in the timed table, the tiles the planner gives each call,
``launch.band_tiles``), on one Hopper GPU:

    python tools/ab_gluon_tiles.py --set row_parts=1 [--softcap 50] [--rounds 5]
    python tools/ab_gluon_tiles.py --set tma_store=0 --head-dims 64 128 256
    python tools/ab_gluon_tiles.py --packed --set packed_schedule=1 [--rounds 5]

1. correctness: the routed tiles and the variant against the float64 reference (``longattn.reference``) on awkward
   shapes (N != M both ways, causal and not, grouped-query heads, D = 64, 128 and 256, bf16 and fp16, one row, a
   tail shorter than a block), the soft-cap given if any: the output's and the log-sum-exp's largest errors, whether
   rows without keys agree, and whether the two are bitwise equal;
2. time: the flash table (B·N = 16k, heads·D = 2048; N = 1k/4k/16k and D = 64 and 128 unless ``--lengths`` and
   ``--head-dims`` say otherwise; causal or not) of the forward with the routed tiles, the variant, SDPA's default
   and FlashAttention-4 where it imports, taking turns
   (``longattn.bench.interleaved``). Nothing here changes what longattn routes (``launch.TILES`` is read, not
   written).

With ``--packed`` both steps take packed batches instead (``cu_seqlens``, one launch of the kernel for all
sequences, short sequences included, whatever the routing's ``packed_min_mean_rows``): the check on empty sequences,
sequences shorter than a tile, causal with other key than query lengths, grouped-query heads and NaN in a neighbour
sequence; the time on the packed table of ``tools/ab_inprocess.py`` (64k tokens of log-uniform document lengths from
64 up to 1k and 8k tokens, unless ``--highs`` says otherwise; 2048 query and 512 key/value channels), against the
Triton forward and FlashAttention-4's varlen forward through longattn where it imports.
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
                # (the Gluon tiles the planner gives this call: a short causal band takes SHORT_BAND_TILES)
                routed = launch.band_tiles(d, n // 2 + 1 if causal else 0)
                varied = dataclasses.replace(routed, **variant)
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


PACKED_CASES = [  # (query lengths, key lengths, query heads, kv heads, causal)
    ([300, 0, 1000, 17, 513, 1], [300, 64, 900, 17, 0, 2000], 8, 2, True),
    ([1, 2, 127, 129, 1000, 128, 256], [1, 2, 127, 129, 1000, 128, 256], 4, 4, False),
    ([i * 37 % 700 for i in range(40)], [i * 53 % 900 for i in range(40)], 16, 4, True),
    ([i * 97 % 961 + 64 for i in range(60)], [i * 97 % 961 + 64 + i * 31 % 200 for i in range(60)], 16, 4, True),
    ([i * 97 % 961 + 64 for i in range(60)], [i * 97 % 961 + 64 for i in range(60)], 16, 4, False),
]


def run_packed(q, k, v, cu_q, cu_k, causal: bool, tiles):
    """The Gluon forward's ``(out, lse)`` on a packed batch (``q`` ``(1, tokens, H, D)``) with ``tiles``."""
    o = torch.empty_like(q)
    lse = torch.empty(1, q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    launch.forward(q, k, v, o, lse, None, BandArgs.of(Band.of(causal, (-1, -1))), q.shape[-1] ** -0.5,
                   packed=(cu_q, cu_k), tiles=tiles)
    return o, lse


def check_packed(variant: dict, head_dims=(128,)) -> bool:
    import longattn
    from longattn.utils import cu_seqlens_of
    ok = True
    for d in head_dims:
        for lens_q, lens_k, hq, hk, causal in PACKED_CASES:
            g = torch.Generator(device="cuda").manual_seed(len(lens_q))
            cu_q, cu_k = cu_seqlens_of(lens_q, "cuda"), cu_seqlens_of(lens_k, "cuda")
            q = torch.randn(1, sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(1, sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
            ro, rl = longattn.flash_attention_varlen(q[0].double(), k[0].double(), v[0].double(), cu_seqlens_q=cu_q,
                                                     cu_seqlens_k=cu_k, causal=causal, return_lse=True,
                                                     backend="torch")
            # NaN and infinities in the middle sequence's rows: the others must not see them.
            mid = len(lens_q) // 2
            poisoned = [x.clone() for x in (q, k, v)]
            for x, lens in zip(poisoned, (lens_q, lens_k, lens_k)):
                x[0, sum(lens[:mid]):sum(lens[:mid + 1])] = float("nan")
            rows = torch.ones(sum(lens_q), dtype=torch.bool, device="cuda")
            rows[sum(lens_q[:mid]):sum(lens_q[:mid + 1])] = False
            seen = torch.isfinite(rl)
            errs = []
            for tiles in (launch.TILES[d], dataclasses.replace(launch.TILES[d], **variant)):
                o, lse = run_packed(q, k, v, cu_q, cu_k, causal, tiles)
                po, _ = run_packed(*poisoned, cu_q, cu_k, causal, tiles)
                errs.append(((o[0].double() - ro).abs().max().item(), (lse[0].double() - rl)[seen].abs().max().item(),
                             bool(torch.equal(torch.isneginf(lse[0]), torch.isneginf(rl))),
                             bool(torch.equal(po[0, rows], o[0, rows]))))
            good = (errs[1][0] <= max(1.25 * errs[0][0], 2e-3) and errs[1][1] <= max(1.25 * errs[0][1], 1e-4)
                    and errs[1][2] and errs[1][3])
            ok &= good
            print(f"packed {len(lens_q)} seqs, D={d}, {hq}/{hk} heads, causal={causal}: routed out {errs[0][0]:.2e} "
                  f"lse {errs[0][1]:.2e} neighbours {errs[0][3]}; variant out {errs[1][0]:.2e} lse {errs[1][1]:.2e} "
                  f"neighbours {errs[1][3]} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def bench_packed(variant: dict, rounds: int, head_dims=(128,), highs=(1024, 8192)) -> None:
    import longattn
    from longattn.bench.varlen_suite import document_lengths
    try:
        import flash_attn.cute  # noqa: F401
        fa4 = True
    except Exception:  # not installed here
        fa4 = False
    print("\n| documents | D | causal | routed ms | variant ms | Triton ms | FA4 ms | routed / variant | "
          "Triton / variant | FA4 / variant |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for high in highs:
        lens = document_lengths(65536, high=high)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        for d in head_dims:
            q = torch.randn(1, 65536, 2048 // d, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 65536, 512 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            routed, varied = launch.TILES[d], dataclasses.replace(launch.TILES[d], **variant)
            for causal in (False, True):
                def through(backend, causal=causal, q=q, k=k, v=v):
                    def step():
                        with torch.no_grad(), longattn.routing(gluon=False):
                            longattn.flash_attention_varlen(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                            causal=causal, backend=backend)
                    return step
                steps = {"routed": lambda: run_packed(q, k, v, cu, cu, causal, routed),
                         "variant": lambda: run_packed(q, k, v, cu, cu, causal, varied), "triton": through("triton")}
                if fa4:
                    steps["fa4"] = through("fa4")
                ms = time_interleaved(steps, rounds=rounds)
                f4 = ms.get("fa4", float("nan"))
                print(f"| {len(lens)} up to {high} | {d} | {causal} | {ms['routed']:.3f} | {ms['variant']:.3f} | "
                      f"{ms['triton']:.3f} | {f4:.3f} | {ms['routed'] / ms['variant']:.3f} | "
                      f"{ms['triton'] / ms['variant']:.3f} | {f4 / ms['variant']:.3f} |", flush=True)


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
    p.add_argument("--packed", action="store_true",
                   help="packed batches (cu_seqlens) instead of dense ones; --head-dims defaults to 128 there")
    p.add_argument("--highs", type=int, nargs="+", default=[1024, 8192],
                   help="with --packed: the timed batches' longest documents (64k tokens each)")
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
    if a.packed:
        head_dims = a.head_dims if "--head-dims" in sys.argv else [128]
        if not check_packed(variant, head_dims):
            if not a.force:
                raise SystemExit("correctness FAILED: not timed (--force times it anyway)")
            print("correctness FAILED: the times below are not to be read")
        bench_packed(variant, a.rounds, head_dims, a.highs)
        return
    if not check(variant, a.softcap):
        if not a.force:
            raise SystemExit("correctness FAILED: not timed (--force times it anyway)")
        print("correctness FAILED: the times below are not to be read")
    bench(variant, a.softcap, a.rounds, a.head_dims, a.lengths)


if __name__ == "__main__":
    main()
