"""The ``decode`` suite: a few new tokens against a KV cache, ``flash_attention_with_kvcache`` against SDPA.

For each case (batch, cache length, new tokens) it times, taking turns in every round: ours on a contiguous cache
(``longattn``) and on a paged one (``longattn-paged``, each sequence's pages scattered over the pool), SDPA with no
backend chosen (``sdpa``: what a user gets by default) on the same contiguous cache seen as ``(B, Hk, M, D)``
with grouped-query heads, and on a GPU SDPA-flash and SDPA-cuDNN. The note of each row gives the bandwidth: bytes
of K and V read over the time. SDPA runs without a mask (with several new tokens its ``is_causal`` would align
top-left): the same bytes read, no masking work.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from longattn.bench import timing as T
from longattn.bench.results import Row

PAGE = {"cuda": 256, "cpu": 64}


def cases(device: torch.device, quick: bool) -> List[tuple]:
    """``(batch, cache length, new tokens, Hq, Hk, D)``: the inference issue's shapes on a GPU, small on a CPU."""
    if device.type == "cuda":
        shapes = ((8, 32768, 1),) if quick else ((1, 131072, 1), (8, 8192, 1), (8, 32768, 1), (8, 131072, 1),
                                                 (64, 4096, 1), (8, 32768, 4))
        return [(b, m, n, 32, 8, 128) for b, m, n in shapes]
    shapes = ((2, 1024, 1),) if quick else ((1, 4096, 1), (4, 1024, 1), (4, 1024, 4))
    return [(b, m, n, 8, 2, 64) for b, m, n in shapes]


def paged_copy(kc: torch.Tensor, vc: torch.Tensor, page: int, gen: torch.Generator):
    """The same rows in a paged cache (pages of ``page`` rows), each sequence's pages scattered over the pool."""
    B, m, hk, d = kc.shape
    per = m // page
    perm = torch.randperm(B * per, device=kc.device, generator=gen)
    kp, vp = (torch.empty(B * per, page, hk, d, device=kc.device, dtype=kc.dtype) for _ in range(2))
    kp[perm], vp[perm] = kc.reshape(B * per, page, hk, d), vc.reshape(B * per, page, hk, d)
    return kp, vp, perm.view(B, per).to(torch.int32)


def _steps(q, kc, vc, seqlens, paged) -> Dict[str, Callable[[], None]]:
    import longattn

    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    kp, vp, table = paged

    def sdpa(backends=None):
        def run():
            with torch.no_grad():
                if backends is None:
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                from torch.nn.attention import sdpa_kernel
                with sdpa_kernel(backends):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return run

    def ours(k_cache, v_cache, block_table):
        def run():
            with torch.no_grad():
                return longattn.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                            block_table=block_table)
        return run

    steps = {"longattn": ours(kc, vc, None), "longattn-paged": ours(kp, vp, table), "sdpa": sdpa()}
    if q.is_cuda:
        from torch.nn.attention import SDPBackend

        steps["sdpa-flash"] = sdpa([SDPBackend.FLASH_ATTENTION])
        steps["sdpa-cudnn"] = sdpa([SDPBackend.CUDNN_ATTENTION])
    return steps


def run_decode(cfg) -> List[Row]:
    device, dtype = cfg.device, cfg.dtype
    rows: List[Row] = []
    todo = cases(device, cfg.quick)
    cfg.progress.begin("decode", len(todo))
    for B, m, n_q, hq, hk, d in todo:
        cfg.progress.step(f"B={B} cache={m} Nq={n_q}")
        gen = torch.Generator(device=device).manual_seed(0)
        kc, vc = (torch.randn(B, m, hk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        q = torch.randn(B, n_q, hq, d, device=device, dtype=dtype, generator=gen)
        seqlens = torch.full((B,), m, dtype=torch.int32, device=device)
        runs = [(Row(suite="decode", impl=name, workload=f"decode-nq{n_q}", n=m, batch=B, heads=hq, head_dim=d,
                      dtype=cfg.dtype_name, pass_="fwd"), lambda step=step: step)
                 for name, step in _steps(q, kc, vc, seqlens, paged_copy(kc, vc, PAGE[device.type], gen)).items()]
        nbytes = 2 * kc.numel() * kc.element_size()
        for row in T.measure_in_turns(runs, device, cfg.quick, 2 if cfg.quick else 3):
            if row.time_ms is not None:
                row.tokens_per_s = B * n_q / (row.time_ms * 1e-3)
                row.note = f"K+V {nbytes / (row.time_ms * 1e-3) / 1e12:.2f} TB/s"
            rows.append(row)
        del kc, vc, q, runs
    cfg.progress.end()
    return rows
