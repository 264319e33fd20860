"""The ``decode`` suite: a few new tokens against a KV cache, ``flash_attention_with_kvcache`` against SDPA.

For each case (batch, cache length, new tokens) it times, taking turns in every round: ours with ``backend="auto"``
on a contiguous cache whose length is given as an int (``longattn``: with one new token, a call SDPA computes
exactly), on a GPU our kernel forced on the same call (``longattn-triton``), ours on a paged cache
(``longattn-paged``, each sequence's pages scattered over the pool, the lengths in a tensor), SDPA with no backend
chosen (``sdpa``: what a user gets by default) on the same contiguous cache seen as ``(B, Hk, M, D)`` with
grouped-query heads, and on a GPU SDPA-flash and SDPA-cuDNN. The note of each ``longattn`` row names the kernel
``auto`` ran (:func:`auto_decode_backend`); where that is another row's kernel on the same call, the row repeats that
row's measurement ("same kernel as"). The notes give the bandwidth: bytes of K and V read over the time. SDPA runs
without a mask (with several new tokens its ``is_causal`` would align top-left): the same bytes read, no masking
work.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from longattn.bench import timing as T
from longattn.bench.peers import AUTO_PEERS
from longattn.bench.results import Row

PAGE = {"cuda": 256, "cpu": 64}


def auto_decode_backend(q: Tensor, k_cache: Tensor, *, cache_seqlens: Union[Tensor, int],
                        block_table: Optional[Tensor] = None) -> str:
    """The implementation ``flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., block_table=...)``
    runs with ``backend="auto"`` (no new keys, no log-sum-exp): ``"sdpa"``, ``"triton"`` or ``"torch"``. The rule is
    :func:`longattn.backends.dispatch.choose_decode`, asked as :mod:`longattn.kvcache` asks it."""
    from longattn import _validation as V
    from longattn.backends import dispatch, sdpa

    fp8 = k_cache.dtype in V.FP8_DTYPES
    reason = sdpa.decode_unsupported_reason(q, kv_heads=k_cache.shape[2], dilated=False,
                                            paged=block_table is not None, fp8=fp8,
                                            length_known=not isinstance(cache_seqlens, Tensor), need_lse=False)
    call = dispatch.SdpaDecode(q.shape[2] != k_cache.shape[2]) if reason is None else None
    return dispatch.choose_decode("auto", q, fn="bench", fp8_cache=fp8, sdpa=call)


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

    def ours(k_cache, v_cache, lengths, block_table=None, backend="auto"):
        def run():
            with torch.no_grad():
                return longattn.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                            block_table=block_table, backend=backend)
        return run

    steps = {"longattn": ours(kc, vc, kc.shape[1])}
    if q.is_cuda:
        steps["longattn-triton"] = ours(kc, vc, kc.shape[1], backend="triton")
    steps.update({"longattn-paged": ours(kp, vp, seqlens, table), "sdpa": sdpa()})
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
        paged = paged_copy(kc, vc, PAGE[device.type], gen)
        steps = _steps(q, kc, vc, seqlens, paged)
        ran = {"longattn": auto_decode_backend(q, kc, cache_seqlens=m),
               "longattn-paged": auto_decode_backend(q, paged[0], cache_seqlens=seqlens, block_table=paged[2])}
        same = AUTO_PEERS.get(ran["longattn"])  # the row running auto's kernel on the contiguous call, if any
        case = {name: Row(suite="decode", impl=name, workload=f"decode-nq{n_q}", n=m, batch=B, heads=hq, head_dim=d,
                          dtype=cfg.dtype_name, pass_="fwd") for name in steps}
        nbytes = 2 * kc.numel() * kc.element_size()
        timed = [(case[name], lambda step=step: step) for name, step in steps.items()
                 if not (name == "longattn" and same in steps)]
        for row in T.measure_in_turns(timed, device, cfg.quick, 2 if cfg.quick else 3):
            if row.time_ms is not None:
                row.tokens_per_s = B * n_q / (row.time_ms * 1e-3)
                row.note = f"K+V {nbytes / (row.time_ms * 1e-3) / 1e12:.2f} TB/s"
        if same in steps:
            case["longattn"].copy_measurement(case[same])
        for name, kernel in ran.items():
            case[name].note = ", ".join(x for x in (f"auto ran {kernel}", case[name].note) if x)
        rows.extend(case.values())
        del kc, vc, q, paged, steps, timed
    cfg.progress.end()
    return rows
