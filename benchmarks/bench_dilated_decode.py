"""Dilated decode benchmark: LongNet decoding against a KV cache, time against the bytes it must read.

bf16, Hq=Hk=16 (LongNet's MHA) and Hq=16, Hk=4, D=64, segments (2048, 4096, 8192, 16384) with rates (1, 2, 4, 8)
(each branch selects up to 2048 keys of the query's segment), caches of 128k tokens, one new token at the last
position of a full 16k segment (the most keys selected). ``dilated_attention_with_kvcache`` on a contiguous and a
paged cache (pages of 256), a device copy of the cache (bandwidth ceiling: bytes read plus written / time), and,
for scale, ``flash_attention_with_kvcache`` over the whole cache. "bound" is the time to read the distinct selected
K and V rows (per KV head) at 0.8x the measured copy bandwidth (the inference issue's bar: ours at most that). Our
kernel runs one program per query head, so with grouped heads it reads a row once per query head that selects it
(the L2 cache may absorb some of the repeats).

    python benchmarks/bench_dilated_decode.py [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

import longattn
from longattn.bench.decode_suite import paged_copy
from longattn.bench.interleaved import emit, env_header, time_interleaved
from longattn.call import dilated_branches

D, M = 64, 131072
SEGMENTS, RATES = (2048, 4096, 8192, 16384), (1, 2, 4, 8)


def selected_rows(hq: int, hk: int, pos: int) -> int:
    """Distinct (KV head, key) rows the query at ``pos`` reads over all branches and query heads: rows of K (and as
    many of V). Query heads of a group with the same offset select the same rows; they count once."""
    rows = set()
    for br in dilated_branches(max(SEGMENTS), hq, SEGMENTS, RATES, False):
        s = pos // br.segment * br.segment
        for h in range(br.head_start, br.head_start + br.n_heads):
            o = h % br.dilation if br.offset is None else br.offset
            if (pos - s) >= o and (pos - s - o) % br.dilation == 0:
                rows.update((h // (hq // hk), j) for j in range(s + o, pos + 1, br.dilation))
    return len(rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    header = env_header()
    print(header, flush=True)
    lines = [f"Measured on {header}; bf16, D={D}, segments {SEGMENTS}, rates {RATES}, cache of {M // 1024}k tokens, "
             f"one new token at position {M - 1}; µs (median of {a.rounds} interleaved rounds).", "",
             "| B | Hq/Hk | selected K+V MB | ours µs | paged µs | bound µs | bound / ours | flash decode over the "
             "whole cache µs | copy TB/s |", "|---|---|---|---|---|---|---|---|---|"]
    kw = dict(segment_lengths=SEGMENTS, dilation_rates=RATES)
    for B in (1, 8):
        for hq, hk in ((16, 16), (16, 4)):
            gen = torch.Generator(device="cuda").manual_seed(0)
            kc, vc = (torch.randn(B, M, hk, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            q = torch.randn(B, 1, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            seqlens = torch.full((B,), M, dtype=torch.int32, device="cuda")
            kp, vp, table = paged_copy(kc, vc, 256, gen)
            dst = torch.empty_like(kc)
            steps = {
                "ours": lambda: longattn.dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw),
                "paged": lambda: longattn.dilated_attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens,
                                                                         block_table=table, **kw),
                "flash": lambda: longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
                "copy": lambda: (dst.copy_(kc), dst.copy_(vc)),
            }
            with torch.no_grad():
                ms = time_interleaved(steps, rounds=a.rounds)
            copy_bw = 2 * (2 * kc.numel() * 2) / (ms["copy"] * 1e-3)  # bytes read + written per second
            sel = B * selected_rows(hq, hk, M - 1) * D * 2 * 2  # distinct rows (ours reads them once per query head)
            bound_us = sel / (0.8 * copy_bw) * 1e6
            lines.append(f"| {B} | {hq}/{hk} | {sel / 1e6:.1f} | {ms['ours'] * 1e3:.1f} | {ms['paged'] * 1e3:.1f} | "
                         f"{bound_us:.1f} | {bound_us / (ms['ours'] * 1e3):.2f} | {ms['flash'] * 1e3:.0f} | "
                         f"{copy_bw / 1e12:.2f} |")
            print(lines[-1], flush=True)
            del kc, vc, kp, vp, dst
            torch.cuda.empty_cache()
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
