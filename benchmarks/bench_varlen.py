"""Variable-length benchmark: a packed batch of documents with long-tailed lengths, against the peers a user has.

bf16, Hq=16, Hk=4, D=128, a packed batch of ``--total`` tokens (default 64k) whose document lengths are drawn
log-uniformly between 64 and 16k with a fixed seed (the last one cut to fill the batch); causal and not, forward and
forward+backward, all timed in the same run, taking turns:

- ``flash_attention_varlen`` (``backend="triton"``: one launch per pass; on Hopper the forward at D=128 is the
  Gluon kernel);
- compiled FlexAttention with a document mask (its BlockMask built from document ids outside the timing);
- SDPA (no backend chosen: what a user gets by default) on the batch padded to the longest document: causal with
  ``is_causal`` (padding keys come after every real query), non-causal with a key-padding mask;
- our dense kernel (``flash_attention``, ``backend="triton"``) on one sequence of the same total length, for its
  TFLOP/s.

TFLOP/s count only the same-document pairs (half of them, plus the diagonal, under a causal mask), the padded and
masked-out work of the peers not counted.

    python benchmarks/bench_varlen.py [--total 65536] [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

import longattn
from longattn.bench.interleaved import emit, env_header, flex_fn, make_step, time_interleaved
from longattn.bench.varlen_suite import document_lengths, padded_sdpa
from longattn.bench.varlen_suite import useful_flops as _useful_flops
from longattn.utils import cu_seqlens_of

HQ, HK, D = 16, 4, 128


def useful_flops(lens, causal: bool, mode: str) -> float:
    return _useful_flops(lens, HQ, D, causal, mode)


def flex_document_mask(lens, causal: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
    total = doc.numel()

    def same_doc(b, h, i, j):
        ok = doc[i] == doc[j]
        return (ok & (j <= i)) if causal else ok

    return create_block_mask(same_doc, None, None, total, total, device="cuda")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--total", type=int, default=65536)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    header = env_header()
    lens = document_lengths(a.total)
    print(header, flush=True)
    print(f"{len(lens)} documents, lengths {min(lens)}..{max(lens)}: {lens}", flush=True)
    cu = cu_seqlens_of(lens, "cuda")
    q = torch.randn(1, a.total, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, a.total, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lines = [f"Measured on {header}; bf16, Hq={HQ}, Hk={HK}, D={D}, a packed batch of {a.total} tokens in "
             f"{len(lens)} documents of {min(lens)}..{max(lens)} tokens (log-uniform 64..16k, seed 0); ms (median of "
             f"{a.rounds} interleaved rounds) and TFLOP/s of same-document pairs.", "",
             "| causal | pass | varlen ms | TFLOP/s | Flex ms | vs Flex | SDPA padded ms | vs SDPA padded | "
             "dense TFLOP/s (one 64k sequence) | varlen / dense |", "|---|---|---|---|---|---|---|---|---|---|"]
    for causal in (False, True):
        def varlen(x, y, z, causal=causal):
            return longattn.flash_attention_varlen(x[0], y[0], z[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                   max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=causal,
                                                   backend="triton")[None]

        def dense(x, y, z, causal=causal):
            return longattn.flash_attention(x, y, z, causal=causal, backend="triton")

        flex = flex_fn(flex_document_mask(lens, causal))
        sdpa = padded_sdpa(lens, causal, torch.device("cuda"))
        for mode in ("fwd", "fwd_bwd"):
            steps = {"varlen": make_step(varlen, q, k, v, mode), "flex": make_step(flex, q, k, v, mode),
                     "sdpa": make_step(sdpa, q, k, v, mode), "dense": make_step(dense, q, k, v, mode)}
            ms = time_interleaved(steps, rounds=a.rounds)
            tf = useful_flops(lens, causal, mode) / ms["varlen"] / 1e9
            dense_tf = useful_flops([a.total], causal, mode) / ms["dense"] / 1e9
            lines.append(f"| {causal} | {mode} | {ms['varlen']:.3f} | {tf:.0f} | {ms['flex']:.3f} | "
                         f"{ms['flex'] / ms['varlen']:.2f}x | {ms['sdpa']:.3f} | {ms['sdpa'] / ms['varlen']:.2f}x | "
                         f"{dense_tf:.0f} | {tf / dense_tf:.2f} |")
            print(lines[-1], flush=True)
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
