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
work. The ``copy`` row copies the same K and V on the device (``Tensor.copy_``, reading and writing them): half its
time, reading K and V once at a copy's rate, is the ceiling a decode step can reach, and every other row's note
says which fraction of that bound it is (the inference issue's bar: 0.95).

Attention sinks (gpt-oss): on the cases of :func:`sinks_cases` (GPUs), the workload ``decode-nqK-sinks`` times
ours again (``longattn``, ``longattn-triton``, ``longattn-paged``) on the same calls with ``sinks=`` one logit per
query head, in the same rounds as the plain calls. Each such row's ``vs_plain`` is its time over the same
implementation's row without sinks (for ``longattn-triton`` and ``longattn-paged`` the sinks' cost in our kernel;
for ``longattn`` what a user pays, a change of kernel included where ``auto`` runs SDPA without sinks); its note
says whether that meets the issue's bar :data:`SINKS_BAR` (:func:`sinks_verdict`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from longattn.bench import timing as T
from longattn.bench.peers import AUTO_PEERS
from longattn.bench.results import Row

PAGE = {"cuda": 256, "cpu": 64}
SINKS_BAR = 1.05  # the issue's: decode with sinks takes at most this times the same call without


def auto_decode_backend(q: Tensor, k_cache: Tensor, *, cache_seqlens: Union[Tensor, int],
                        block_table: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> str:
    """The implementation ``flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., block_table=...,
    sinks=...)`` runs with ``backend="auto"`` (no new keys, no log-sum-exp): ``"sdpa"``, ``"triton"`` or
    ``"torch"``. The rule is :func:`longattn.backends.dispatch.choose_decode`, asked as :mod:`longattn.kvcache` asks
    it (SDPA never computes a call with sinks)."""
    from longattn import _validation as V
    from longattn.backends import dispatch, sdpa

    fp8 = k_cache.dtype in V.FP8_DTYPES
    reason = "score modifications" if sinks is not None else sdpa.decode_unsupported_reason(
        q, kv_heads=k_cache.shape[2], dilated=False, paged=block_table is not None, fp8=fp8,
        length_known=not isinstance(cache_seqlens, Tensor), need_lse=False)
    call = dispatch.SdpaDecode(q.shape[2] != k_cache.shape[2]) if reason is None else None
    return dispatch.choose_decode("auto", q, fn="bench", fp8_cache=fp8, sdpa=call)


def cases(device: torch.device, quick: bool) -> List[tuple]:
    """``(batch, cache length, new tokens, Hq, Hk, D)``: the inference issue's shapes on a GPU, small on a CPU."""
    return _default_cases(device, quick)


def sinks_cases(device: torch.device, quick: bool) -> List[tuple]:
    """The cases of :func:`cases` that also time the ``-sinks`` variant: every default case on a GPU, none on a CPU
    (there ``auto`` runs the PyTorch backend for sinks, whose time says nothing of the kernels the bar is about)."""
    return _default_cases(device, quick) if device.type == "cuda" else []


def _default_cases(device: torch.device, quick: bool) -> List[tuple]:
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


def _steps(q, kc, vc, seqlens, paged, sinks: Optional[Tensor] = None) -> Dict[str, Callable[[], None]]:
    """The timed calls of one case; with ``sinks``, only ours (contiguous, forced Triton on a GPU, paged), each
    passing ``sinks=``."""
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
                                                            block_table=block_table, backend=backend, sinks=sinks)
        return run

    steps = {"longattn": ours(kc, vc, kc.shape[1])}
    if q.is_cuda:
        steps["longattn-triton"] = ours(kc, vc, kc.shape[1], backend="triton")
    steps["longattn-paged"] = ours(kp, vp, seqlens, table)
    if sinks is not None:
        return steps
    steps["sdpa"] = sdpa()
    if q.is_cuda:
        from torch.nn.attention import SDPBackend

        steps["sdpa-flash"] = sdpa([SDPBackend.FLASH_ATTENTION])
        steps["sdpa-cudnn"] = sdpa([SDPBackend.CUDNN_ATTENTION])
    dk, dv = torch.empty_like(kc), torch.empty_like(vc)
    steps["copy"] = lambda: (dk.copy_(kc), dv.copy_(vc))
    return steps


def copy_bound_note(row: Row, copy: Optional[Row]) -> str:
    """The note part saying which fraction of the copy bound (half the ``copy`` row's time) ``row`` reaches; empty
    where either time is missing."""
    ratio = _ratio(copy, row) if copy is not None else None
    return "" if ratio is None else f"{ratio / 2:.2f} of the copy bound"


def sink_logits(heads: int, device: torch.device, seed: int = 0) -> Tensor:
    """The sinks of the ``-sinks`` rows: one standard-normal logit per query head, float32, seeded."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)).to(device)


def sinks_verdict(ratio: Optional[float]) -> str:
    """The note part of a ``-sinks`` row: its time over the plain row's and whether that meets :data:`SINKS_BAR`."""
    if ratio is None:
        return ""
    verdict = "met" if ratio <= SINKS_BAR else "missed"
    return f"sinks {ratio:.3f}x plain (bar {SINKS_BAR:.2f}x: {verdict})"


def _ratio(row: Row, base: Row) -> Optional[float]:
    """``row``'s time over ``base``'s, None where either is missing."""
    return row.time_ms / base.time_ms if row.ok and base.ok and row.time_ms and base.time_ms else None


def impl_names(cuda: bool) -> Tuple[str, ...]:
    """The rows of a case without sinks (:func:`_steps` builds their calls), on a GPU or not."""
    ours = ("longattn", "longattn-triton", "longattn-paged") if cuda else ("longattn", "longattn-paged")
    return ours + (("sdpa", "sdpa-flash", "sdpa-cudnn") if cuda else ("sdpa",)) + ("copy",)


def planned_impls(cfg) -> Optional[Tuple[str, ...]]:
    """The implementations the quick plan runs in this suite (None without a plan: all of them)."""
    planned = cfg.planned("decode")
    return None if planned is None else tuple(dict.fromkeys(i for c in planned for i in c.impls))


def compile_key(name: str, ran: Dict[str, str], q: Tensor, dtype: str) -> Optional[tuple]:
    """The kernel variant whose first call compiles for row ``name`` (``ran``: the kernel auto ran per row), or
    None: on a GPU our decode kernel, contiguous or paged."""
    from longattn.bench.first_calls import TRITON

    ours = name == "longattn-triton" or ran.get(name) == "triton"
    return (TRITON, "decode", name == "longattn-paged", q.shape[-1], dtype) if q.is_cuda and ours else None


def run_decode(cfg) -> List[Row]:
    device, dtype = cfg.device, cfg.dtype
    rows: List[Row] = []
    todo = cases(device, cfg.quick)
    allowed = planned_impls(cfg)
    with_sinks = set(sinks_cases(device, cfg.quick)) if allowed is None else set()  # a first look: no sinks
    cfg.progress.begin("decode", len(todo))
    for B, m, n_q, hq, hk, d in todo:
        cfg.progress.step(f"B={B} cache={m} Nq={n_q}")
        if not cfg.budget.allow("decode"):
            continue
        gen = torch.Generator(device=device).manual_seed(0)
        kc, vc = (torch.randn(B, m, hk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        q = torch.randn(B, n_q, hq, d, device=device, dtype=dtype, generator=gen)
        seqlens = torch.full((B,), m, dtype=torch.int32, device=device)
        paged = paged_copy(kc, vc, PAGE[device.type], gen)
        variants = {f"decode-nq{n_q}": None}
        if (B, m, n_q, hq, hk, d) in with_sinks:
            variants[f"decode-nq{n_q}-sinks"] = sink_logits(hq, device)
        nbytes = 2 * kc.numel() * kc.element_size()
        timed, keys, found = [], [], []
        for workload, sinks in variants.items():
            steps = {name: step for name, step in _steps(q, kc, vc, seqlens, paged, sinks).items()
                     if allowed is None or name in allowed}
            ran = {"longattn": auto_decode_backend(q, kc, cache_seqlens=m, sinks=sinks),
                   "longattn-paged": auto_decode_backend(q, paged[0], cache_seqlens=seqlens, block_table=paged[2],
                                                         sinks=sinks)}
            same = AUTO_PEERS.get(ran["longattn"])  # the row running auto's kernel on the contiguous call, if any
            case = {name: Row(suite="decode", impl=name, workload=workload, n=m, batch=B, heads=hq, head_dim=d,
                              dtype=cfg.dtype_name, pass_="fwd") for name in steps}
            run = [name for name in steps if not (name == "longattn" and same in steps)]
            timed += [(case[name], lambda step=steps[name]: step) for name in run]
            keys += [compile_key(name, ran, q, cfg.dtype_name) for name in run]
            found.append((case, ran, same))
        for row in T.measure_in_turns(timed, device, cfg.quick, 2 if cfg.quick else 3, cfg.first_calls, keys):
            if row.time_ms is not None and row.impl == "copy":
                row.note = f"K+V read and written {2 * nbytes / (row.time_ms * 1e-3) / 1e12:.2f} TB/s"
            elif row.time_ms is not None:
                row.tokens_per_s = B * n_q / (row.time_ms * 1e-3)
                row.note = f"K+V {nbytes / (row.time_ms * 1e-3) / 1e12:.2f} TB/s"
        for case, ran, same in found:
            if same in case and "longattn" in case:
                case["longattn"].copy_measurement(case[same])
            for name, kernel in ran.items():
                if name not in case:
                    continue
                case[name].note = ", ".join(x for x in (f"auto ran {kernel}", case[name].note) if x)
        plain = found[0][0]
        for case, _, _ in found:
            for name, row in case.items():
                if name != "copy":
                    row.note = ", ".join(x for x in (row.note, copy_bound_note(row, plain.get("copy"))) if x)
        for case, _, _ in found[1:]:
            for name, row in case.items():
                row.vs_plain = _ratio(row, plain[name])
                row.note = ", ".join(x for x in (row.note, sinks_verdict(row.vs_plain)) if x)
        for case, _, _ in found:
            rows.extend(case.values())
        del kc, vc, q, paged, steps, timed, found
    cfg.progress.end()
    return rows
