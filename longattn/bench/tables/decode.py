"""Decode benchmark: one new token (or a few) against a KV cache, K+V bandwidth against SDPA.

bf16, Hq=32, Hk=8, D=128 (the inference issue's shapes); B in (1, 8), cache lengths 8k-128k; our
``flash_attention_with_kvcache`` (contiguous and paged, page 256) against SDPA with no backend chosen, SDPA-flash
and SDPA-cuDNN on the same contiguous cache (``(B, Hk, M, D)`` views, GQA), and a device copy of K+V (the
bandwidth ceiling: bytes read plus written / time). Bandwidth = bytes of K and V read / time.

    python -m longattn.bench.tables.decode [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

import longattn
from longattn.bench.interleaved import emit, env_header, time_interleaved

HQ, HK, D = 32, 8, 128


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    header = env_header()
    print(header, flush=True)
    lines = [f"Measured on {header}; bf16, Hq={HQ}, Hk={HK}, D={D}, one query token; K+V read in TB/s "
             f"(median of {a.rounds} interleaved rounds).", "",
             "| B | cache | ours µs | ours TB/s | paged µs | paged TB/s | SDPA default µs | SDPA-flash µs | "
             "SDPA-cuDNN µs | copy TB/s | vs SDPA default |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for B, m in ((1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072)):
        kc = torch.randn(B, m, HK, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.full((B,), m, dtype=torch.int32, device="cuda")
        page = 256
        table = torch.arange(B * m // page, device="cuda", dtype=torch.int32).view(B, -1)
        kp, vp = kc.view(-1, page, HK, D), vc.view(-1, page, HK, D)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        dst = torch.empty_like(kc)

        def sdpa(backends=None):
            def run():
                if backends is None:
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                with sdpa_kernel(backends):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            return run

        steps = {
            "ours": lambda: longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
            "paged": lambda: longattn.flash_attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens,
                                                                   block_table=table),
            "sdpa": sdpa(), "flash": sdpa([SDPBackend.FLASH_ATTENTION]), "cudnn": sdpa([SDPBackend.CUDNN_ATTENTION]),
            "copy": lambda: (dst.copy_(kc), dst.copy_(vc)),
        }
        with torch.no_grad():
            ms = time_interleaved(steps, rounds=a.rounds)
        nbytes = 2 * kc.numel() * kc.element_size()
        tb = {n: nbytes / (t * 1e-3) / 1e12 for n, t in ms.items()}
        lines.append(f"| {B} | {m // 1024}k | {ms['ours'] * 1e3:.0f} | {tb['ours']:.2f} | {ms['paged'] * 1e3:.0f} | "
                     f"{tb['paged']:.2f} | {ms['sdpa'] * 1e3:.0f} | {ms['flash'] * 1e3:.0f} | "
                     f"{ms['cudnn'] * 1e3:.0f} | "
                     f"{2 * nbytes / (ms['copy'] * 1e-3) / 1e12:.2f} | {ms['sdpa'] / ms['ours']:.2f}x |")
        print(lines[-1], flush=True)
        del kc, vc, kp, vp, dst
        torch.cuda.empty_cache()
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
