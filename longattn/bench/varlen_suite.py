"""The ``varlen`` suite: a packed batch of documents of long-tailed lengths, ``flash_attention_varlen`` against
SDPA on the same documents padded to the longest one (what a user without a packed path does).

For each case (total tokens, causal or not, forward and forward+backward) it times, taking turns in every round:
``longattn`` (``flash_attention_varlen``, ``backend="auto"``: one launch per pass of the Triton kernels on a GPU)
and ``sdpa`` (no backend chosen, on the padded batch, the packing and unpacking copies included; non-causal with a
key-padding mask, causal with ``is_causal``, padding keys coming after every real query). TFLOP/s count the
same-document pairs only (half of them plus the diagonal when causal).
"""
from __future__ import annotations

import math
from typing import List

import torch

from longattn.bench import timing as T
from longattn.bench.results import Row
from longattn.utils import cu_seqlens_of


def document_lengths(total: int, low: int = 64, high: int = 16384, seed: int = 0) -> List[int]:
    """Log-uniform lengths in ``[low, high]`` (fixed seed) until ``total`` tokens, the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lens: List[int] = []
    while sum(lens) < total:
        x = math.exp(math.log(low) + torch.rand((), generator=g).item() * (math.log(high) - math.log(low)))
        lens.append(min(int(x), total - sum(lens)))
    return lens


def useful_flops(lens, heads: int, head_dim: int, causal: bool, mode: str) -> float:
    """FLOPs of the same-document pairs: 4 H D pairs forward, 3.5 times that forward+backward."""
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
    return 4.0 * heads * head_dim * pairs * (3.5 if mode == "fwd_bwd" else 1.0)


def padded_sdpa(lens, causal: bool, device: torch.device):
    """SDPA (no backend chosen) on the packed batch padded to its longest document; takes and returns packed
    ``(1, total, H, D)`` tensors, the copies in and out included."""
    longest = max(lens)
    rows = torch.cat([torch.arange(n, device=device) + b * longest for b, n in enumerate(lens)])
    keep = None
    if not causal:
        keep = torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        keep = keep[:, None, None, :]  # (B, 1, 1, M): key padding

    def pad(x):
        out = x.new_zeros((len(lens) * longest,) + tuple(x.shape[1:]))
        out[rows] = x
        return out.view(len(lens), longest, *x.shape[1:]).transpose(1, 2)

    def run(q, k, v, causal_=False):
        hq, hk = q.shape[2], k.shape[2]
        kp, vp = pad(k[0]), pad(v[0])
        if keep is not None and hq != hk:  # a mask rules out SDPA's GQA kernels: repeat the heads, as a user would
            kp, vp = (x.repeat_interleave(hq // hk, dim=1) for x in (kp, vp))
        o = torch.nn.functional.scaled_dot_product_attention(pad(q[0]), kp, vp, attn_mask=keep, is_causal=causal,
                                                             enable_gqa=keep is None and hq != hk)
        return o.transpose(1, 2).reshape(-1, hq, q.shape[-1])[rows][None]

    return run


def cases(device: torch.device, quick: bool) -> List[tuple]:
    """``(total tokens, lowest and longest document, Hq, Hk, D)``."""
    if device.type == "cuda":
        return [(16384 if quick else 65536, 64, 16384, 16, 4, 128)]
    return [(1024 if quick else 4096, 16, 1024, 4, 2, 64)]


IMPLS = ("longattn", "sdpa")


def workload_name(causal: bool) -> str:
    return f"varlen-{'causal' if causal else 'dense'}"


def todo(cfg) -> List[tuple]:
    """``(case, causal, pass)`` of the run: every case causal and not, both passes, or the quick plan's."""
    planned = cfg.planned("varlen")
    wanted = None if planned is None else {(c.workload, c.pass_) for c in planned}
    return [(c, causal, p) for c in cases(cfg.device, cfg.quick) for causal in (False, True) for p in T.PASSES
            if wanted is None or (workload_name(causal), p) in wanted]


def run_varlen(cfg) -> List[Row]:
    import longattn
    from longattn.bench.first_calls import TRITON

    device, dtype = cfg.device, cfg.dtype
    rows: List[Row] = []
    jobs = todo(cfg)
    cfg.progress.begin("varlen", len(jobs))
    for (total, low, high, hq, hk, d), causal, pass_ in jobs:
        cfg.progress.step(f"{total} tokens {'causal' if causal else 'dense'} {pass_}")
        if not cfg.budget.allow("varlen"):
            continue
        lens = document_lengths(total, low, high)
        cu = cu_seqlens_of(lens, device)
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, total, hq, d, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(1, total, hk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))

        def varlen(x, y, z, causal_=False, causal=causal):
            return longattn.flash_attention_varlen(x[0], y[0], z[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                   max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                                   causal=causal)[None]

        workload = workload_name(causal)
        runs = [(Row(suite="varlen", impl=name, workload=workload, n=total, batch=len(lens), heads=hq, head_dim=d,
                      dtype=cfg.dtype_name, pass_=pass_, note=f"{len(lens)} docs {min(lens)}..{max(lens)}"),
                  lambda fn=fn: T.make_step(fn, q, k, v, pass_))
                 for name, fn in (("longattn", varlen), ("sdpa", padded_sdpa(lens, causal, device)))]
        # on a GPU flash_attention_varlen runs the Triton kernels: its first call compiles them
        keys = [(TRITON, workload, pass_, d, cfg.dtype_name) if device.type == "cuda" else None, None]
        for row in T.measure_in_turns(runs, device, cfg.quick, 2 if cfg.quick else 3, cfg.first_calls, keys):
            if row.time_ms is not None:
                row.tflops = useful_flops(lens, hq, d, causal, pass_) / (row.time_ms * 1e-3) / 1e12
                row.tokens_per_s = total / (row.time_ms * 1e-3)
            rows.append(row)
        del q, k, v, runs
    cfg.progress.end()
    return rows
