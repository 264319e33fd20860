"""Decode benchmark: a few new tokens against a KV cache, K+V bandwidth against SDPA, FlexAttention and a copy.

bf16, Hq=32, Hk=8, D=128 (the inference issue's shapes): B=1 with 128k keys, B=8 with 8k/32k/128k, B=64 with 4k;
Nq = 1 and 4 new tokens. Ours: ``flash_attention_with_kvcache`` on a contiguous cache and on paged caches (pages of
64 and 256 rows, the pages of each sequence scattered). Peers on the same contiguous cache (``(B, Hk, M, D)`` views,
GQA): SDPA with no backend chosen, SDPA-flash, SDPA-cuDNN, compiled FlexAttention; and a device copy of K+V (the
bandwidth ceiling: bytes read plus written / time). Bandwidth = bytes of K and V read / time.

With Nq = 4 our call is causal (bottom-right: token t sees the keys up to ``M - 4 + t``) and so is Flex's (a block
mask); SDPA's ``is_causal`` aligns top-left, so SDPA is timed without a mask: the same bytes, no masking work.

    python benchmarks/bench_decode.py [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

import longattn
from longattn.bench.decode_suite import paged_copy
from longattn.bench.interleaved import emit, env_header, flex_causal_mask, flex_fn, time_interleaved

HQ, HK, D = 32, 8, 128
SHAPES = ((1, 131072), (8, 8192), (8, 32768), (8, 131072), (64, 4096))


def _row(B: int, m: int, n_q: int, rounds: int) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(B, m, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(B, m, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, n_q, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((B,), m, dtype=torch.int32, device="cuda")
    paged = {page: paged_copy(kc, vc, page, gen) for page in (64, 256)}
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    flex = flex_fn(flex_causal_mask(n_q, m) if n_q > 1 else None)
    dst = torch.empty_like(kc)

    def sdpa(backends=None):
        def run():
            if backends is None:
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            with sdpa_kernel(backends):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return run

    def ours(page=None):
        kc_, vc_, table = (kc, vc, None) if page is None else paged[page]
        return lambda: longattn.flash_attention_with_kvcache(q, kc_, vc_, cache_seqlens=seqlens, block_table=table)

    steps = {"ours": ours(), "p64": ours(64), "p256": ours(256), "sdpa": sdpa(),
             "flash": sdpa([SDPBackend.FLASH_ATTENTION]), "cudnn": sdpa([SDPBackend.CUDNN_ATTENTION]),
             "flex": lambda: flex(q, kc, vc), "copy": lambda: (dst.copy_(kc), dst.copy_(vc))}
    with torch.no_grad():
        ms = time_interleaved(steps, rounds=rounds)
    nbytes = 2 * kc.numel() * kc.element_size()
    tb = {n: nbytes / (t * 1e-3) / 1e12 for n, t in ms.items()}
    copy_tb = 2 * tb["copy"]  # a copy reads and writes the bytes
    best_sdpa = min(ms["sdpa"], ms["flash"], ms["cudnn"])
    us = {n: f"{t * 1e3:.0f}" for n, t in ms.items()}
    return (f"| {B} | {m // 1024}k | {n_q} | {us['ours']} | {tb['ours']:.2f} | {us['p64']} | {us['p256']} | "
            f"{us['sdpa']} | {us['flash']} | {us['cudnn']} | {us['flex']} | {copy_tb:.2f} | "
            f"{tb['ours'] / copy_tb:.2f} | {best_sdpa / ms['ours']:.2f}x | "
            f"{ms['ours'] / max(ms['p64'], ms['p256']):.2f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    header = env_header()
    print(header, flush=True)
    lines = [f"Measured on {header}; bf16, Hq={HQ}, Hk={HK}, D={D}; times in µs (median of {a.rounds} interleaved "
             "rounds), K+V read in TB/s.", "",
             "| B | cache | Nq | ours µs | ours TB/s | paged 64 µs | paged 256 µs | SDPA default µs | SDPA-flash µs | "
             "SDPA-cuDNN µs | Flex µs | copy TB/s | ours / copy | vs best SDPA | paged / contiguous (worse) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n_q in (1, 4):
        for B, m in SHAPES:
            lines.append(_row(B, m, n_q, a.rounds))
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
