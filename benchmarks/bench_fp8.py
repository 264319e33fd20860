"""FP8 benchmark: accuracy, forward speed and decode against float8 KV caches.

1. Accuracy, D=128, N=4096, H=8: the FP8 forward (inputs quantised with :func:`longattn.quantize_fp8`, per tensor
   and per head) and the bf16 forward against float64 attention on the original float32 data (max and RMS error),
   and the FP8 kernel against float64 attention on its dequantised inputs; normal and outlier-heavy inputs (four
   channels 30x larger).
2. Forward TFLOP/s at D = 64/128/256, N = 4k/16k (``--lengths``; batch x N = 16k, heads x D = 2048), causal and
   not: FP8 with values in the usual layout (the kernel's sequence-major copy of V included), FP8 with V given
   sequence-major, the same on the Triton kernel (``LONGATTN_GLUON=0``; on Hopper the Gluon kernel runs otherwise,
   from the routing's ``fp8_min_keys`` keys for a sequence-major V, at any length for one in the usual layout), the Gluon kernel at any length on V in the usual layout, our
   bf16 forward, SDPA-cuDNN bf16, SDPA with no backend chosen and FlashAttention-4's bf16 forward where
   ``flash_attn.cute`` imports, all in the same run.
3. Decode, Hq=32, Hk=8, D=128, one new token: float8 caches (contiguous and pages of 256 rows) against bf16 caches
   and SDPA's default on the bf16 cache; K+V bytes read, bandwidth, and a device copy of the float8 K+V (the
   ceiling).

    python benchmarks/bench_fp8.py [--out FILE] [--rounds 3] [--parts accuracy,forward,decode] [--head-dims 64 128 256]
        [--lengths 4096 16384]
"""
from __future__ import annotations

import argparse
import os

import torch

import longattn
from longattn import reference as ref
from longattn.backends import fa4 as fa4_backend
from longattn.bench.decode_suite import paged_copy
from longattn.bench.interleaved import attn_flops, emit, env_header, sdpa_fn, time_interleaved

F8 = torch.float8_e4m3fn


def _rms(x: torch.Tensor) -> float:
    return float(x.double().square().mean().sqrt())


def accuracy_table() -> list:
    lines = ["| inputs | causal | FP8 scale | FP8 vs exact: max | rms | bf16 vs exact: max | rms | "
             "FP8 kernel vs its dequantised inputs: max | rms | output rms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind in ("normal", "outliers"):
        for causal in (False, True):
            x = [torch.randn(1, 4096, 8, 128, device="cuda", generator=gen) for _ in range(3)]
            if kind == "outliers":
                for t in x:
                    t[..., :4] *= 30
            exact = ref.flash_attention(*(t.double() for t in x), causal=causal)
            bf = longattn.flash_attention(*(t.bfloat16() for t in x), causal=causal)
            e_bf = bf.double() - exact
            for per_head in (False, True):
                (q, qd), (k, kd), (v, vd) = (longattn.quantize_fp8(t, per_head=per_head) for t in x)
                f8 = longattn.flash_attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                deq = ref.flash_attention(*(ref.dequantize_fp8(a, s) for a, s in ((q, qd), (k, kd), (v, vd))),
                                          causal=causal)
                e8, ek = f8.double() - exact, f8.double() - deq
                lines.append(f"| {kind} | {causal} | {'per head' if per_head else 'per tensor'} | "
                             f"{e8.abs().max():.2e} | {_rms(e8):.2e} | {e_bf.abs().max():.2e} | {_rms(e_bf):.2e} | "
                             f"{ek.abs().max():.2e} | {_rms(ek):.2e} | {_rms(exact):.2e} |")
                print(lines[-1], flush=True)
    return lines


def forward_table(rounds: int, head_dims=(64, 128, 256), lengths=(4096, 16384)) -> list:
    lines = ["| D | causal | N | FP8 TFLOP/s | FP8, V seq-major | FP8 Triton kernel, V seq-major | "
             "FP8 Gluon kernel at any length | our bf16 | "
             "SDPA-cuDNN bf16 | SDPA default bf16 | FA4 bf16 | FP8 / our bf16 | FP8 seq-major / our bf16 | "
             "FP8 / cuDNN | FP8 / FA4 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fa4 = fa4_backend._module()  # FlashAttention-4 where it imports (bf16 only on Hopper): the fastest peer
    for d in head_dims:
        for causal in (False, True):
            for n in lengths:
                b, h = max(1, 16384 // n), 2048 // d
                qb, kb, vb = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                (q, qd), (k, kd), (v, vd) = (longattn.quantize_fp8(t) for t in (qb, kb, vb))
                v_seq = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # (B, N, H, D), stride 1 along N
                cudnn = sdpa_fn("cudnn")

                def fp8(values, gluon="1", min_keys=None):
                    def run():
                        os.environ["LONGATTN_GLUON"] = gluon  # read on every call: set by every step
                        with longattn.routing(**({} if min_keys is None else {"fp8_min_keys": min_keys})):
                            return longattn.flash_attention(q, k, values, causal=causal, q_descale=qd, k_descale=kd,
                                                            v_descale=vd)
                    return run

                def bf16_forward(*qkv):  # our bf16 forward as backend="triton" runs it (Gluon at D=128 on Hopper)
                    def run():
                        os.environ["LONGATTN_GLUON"] = "1"
                        return longattn.flash_attention(*qkv, causal=causal, backend="triton")
                    return run

                def sdpa_default():
                    return torch.nn.functional.scaled_dot_product_attention(
                        qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), is_causal=causal)

                steps = {"fp8": fp8(v), "fp8_seq": fp8(v_seq), "fp8_triton": fp8(v_seq, "0"),
                         "fp8_gluon": fp8(v, min_keys=0),
                         "bf16": bf16_forward(qb, kb, vb),
                         "cudnn": lambda: cudnn(qb, kb, vb, causal), "default": sdpa_default}
                if fa4 is not None:
                    steps["fa4"] = lambda: fa4.flash_attn_func(qb, kb, vb, causal=causal)
                with torch.no_grad():
                    ms = time_interleaved(steps, rounds=rounds)
                os.environ["LONGATTN_GLUON"] = "1"
                tf = {name: attn_flops(b, h, n, n, d, causal, "fwd") / t * 1e-9 for name, t in ms.items()}
                lines.append(f"| {d} | {causal} | {n / 1024:g}k | {tf['fp8']:.0f} | {tf['fp8_seq']:.0f} | "
                             f"{tf['fp8_triton']:.0f} | {tf['fp8_gluon']:.0f} | {tf['bf16']:.0f} | "
                             f"{tf['cudnn']:.0f} | {tf['default']:.0f} | "
                             + (f"{tf['fa4']:.0f} | " if fa4 else "n/a | ")
                             + f"{tf['fp8'] / tf['bf16']:.2f} | {tf['fp8_seq'] / tf['bf16']:.2f} | "
                             f"{tf['fp8'] / tf['cudnn']:.2f} | "
                             + (f"{tf['fp8'] / tf['fa4']:.2f} |" if fa4 else "n/a |"))
                print(lines[-1], flush=True)
                del qb, kb, vb, q, k, v, v_seq
                torch.cuda.empty_cache()
    return lines


HQ, HK, D = 32, 8, 128
DECODE_SHAPES = ((1, 131072), (8, 32768), (8, 131072), (64, 4096))


def decode_table(rounds: int) -> list:
    lines = ["| B | cache | bf16 cache µs | FP8 cache µs | FP8 paged 256 µs | SDPA default (bf16) µs | "
             "K+V bytes, FP8 | FP8 TB/s | FP8 copy TB/s | FP8 / copy | bf16 / FP8 time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for B, m in DECODE_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        kc, vc = (torch.randn(B, m, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        (k8, kd), (v8, vd) = longattn.quantize_fp8(kc), longattn.quantize_fp8(vc)
        kp, vp, table = paged_copy(kc, vc, 256, gen)
        kp8, vp8 = (kp.float() / kd).to(F8), (vp.float() / vd).to(F8)
        del kp, vp
        seqlens = torch.full((B,), m, dtype=torch.int32, device="cuda")
        dst = torch.empty_like(k8)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        steps = {
            "bf16": lambda: longattn.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
            "fp8": lambda: longattn.flash_attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd,
                                                                 v_descale=vd),
            "fp8_p256": lambda: longattn.flash_attention_with_kvcache(q, kp8, vp8, cache_seqlens=seqlens,
                                                                      block_table=table, k_descale=kd,
                                                                      v_descale=vd),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
            "copy": lambda: (dst.copy_(k8), dst.copy_(v8)),
        }
        with torch.no_grad():
            ms = time_interleaved(steps, rounds=rounds)
        nbytes = 2 * k8.numel()
        tb = nbytes / (ms["fp8"] * 1e-3) / 1e12
        copy_tb = 2 * nbytes / (ms["copy"] * 1e-3) / 1e12  # a copy reads and writes the bytes
        lines.append(f"| {B} | {m // 1024}k | {ms['bf16'] * 1e3:.0f} | {ms['fp8'] * 1e3:.0f} | "
                     f"{ms['fp8_p256'] * 1e3:.0f} | {ms['sdpa'] * 1e3:.0f} | {nbytes / 2**20:.0f} MiB | {tb:.2f} | "
                     f"{copy_tb:.2f} | {tb / copy_tb:.2f} | {ms['bf16'] / ms['fp8']:.2f}x |")
        print(lines[-1], flush=True)
        del kc, vc, k8, v8, kp8, vp8, dst
        torch.cuda.empty_cache()
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", default="accuracy,forward,decode")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256], help="the forward table's head dims")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384],
                   help="the forward table's sequence lengths (batch * length = 16k)")
    a = p.parse_args()
    header = env_header()
    print(header, flush=True)
    parts = a.parts.split(",")
    text = [f"Measured on {header}; times are medians of {a.rounds} interleaved rounds."]
    with torch.no_grad():
        if "accuracy" in parts:
            text += ["", "Accuracy (D=128, N=4096, H=8, B=1; bf16 output):", ""] + accuracy_table()
        if "forward" in parts:
            text += ["", "Forward TFLOP/s (FlashAttention's count):", ""] + forward_table(a.rounds, a.head_dims,
                                                                                        a.lengths)
        if "decode" in parts:
            text += ["", f"Decode, Hq={HQ}, Hk={HK}, D={D}, one new token, per-tensor descales:", ""] + decode_table(
                a.rounds)
    emit("\n".join(text), a.out)


if __name__ == "__main__":
    main()
