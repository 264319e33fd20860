"""The ``score_mods`` suite: what the score modifications of ``flash_attention`` cost, against the plain kernel and
against FlexAttention.

For each case (head dim, causal self-attention at one N, forward and forward+backward) it times, all taking turns in
every round, each modification (:data:`MODS`: ``none``; ``softcap``, soft-capping at :data:`SOFTCAP`; ``alibi``,
ALiBi with the paper's geometric slopes (:func:`alibi_slopes`); ``sinks``, one learnable attention-sink logit per
head; ``all``, the three together) run by:

- ``longattn``: ``flash_attention(..., backend="auto")``; its note names the kernel ``auto`` ran, and where that is
  the ``longattn-triton`` row's kernel the row repeats that row's measurement ("same kernel as");
- ``longattn-triton``: ``backend="triton"``, our kernels forced (GPUs only);
- ``flex``: compiled FlexAttention with a causal ``BlockMask`` and the equivalent ``score_mod`` (soft-capping by
  ``tanh``, ALiBi as the bias ``-slope * (q_idx - kv_idx)``); attention sinks are no ``score_mod``, so its ``sinks``
  and ``all`` rows say ``n/a`` (:data:`FLEX_NA`). GPUs only, as the ``flex`` peer.
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, its ``softcap`` and ``learnable_sink``) where it is
  installed and runs on the GPU (the ``fa4`` peer's reasons); it takes no ALiBi slopes, so its ``alibi`` and ``all``
  rows say ``n/a`` (:data:`FA4_NA`).

:func:`fill_ratios` gives every timed row two ratios: ``vs_plain``, its time over the same implementation's ``none``
row (what the modification costs; the issue's bar :data:`COST_BAR`), and ``speedup``, the ``flex`` row's time over
its own (the bar :data:`FLEX_BAR`); :func:`bar_verdict` says whether a modified row of ours meets both. Where FA4
ran the same modification, the note of each of our rows gives FA4's time over ours (:func:`note_fa4`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from longattn.bench import timing as T
from longattn.bench.interleaved import attn_flops
from longattn.bench.peers import AUTO_PEERS, Fa4, Flex
from longattn.bench.results import Row

SUITE = "score_mods"
MODS = ("none", "softcap", "alibi", "sinks", "all")
SOFTCAP = 50.0  # Gemma 2's attention-logit cap
COST_BAR = {"fwd": 1.10, "fwd_bwd": 1.15}  # a modification's time over the plain kernel's, at most
FLEX_BAR = 1.3  # FlexAttention's time over ours, at least
FLEX_NA = "n/a: sinks are not expressible as a score_mod"
FA4_NA = "n/a: FlashAttention-4 takes no ALiBi slopes"
OURS = ("longattn", "longattn-triton")


def alibi_slopes(heads: int) -> Tensor:
    """ALiBi's geometric slopes (Press et al.), float32 ``(heads,)``: ``2 ** (-8 (h + 1) / heads)`` for a power of
    two; otherwise those of the largest power of two below, then every other slope of twice that many."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"alibi_slopes: heads must be a positive int, got {heads!r}")
    closest = 2 ** int(math.floor(math.log2(heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / closest) for h in range(closest)]
    slopes += [2.0 ** (-4.0 * (2 * h + 1) / closest) for h in range(heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def _check_mod(mod: str) -> None:
    if mod not in MODS:
        raise ValueError(f"modification must be one of {MODS}, got {mod!r}")


def mod_kwargs(mod: str, heads: int, device: torch.device, seed: int = 0) -> Dict[str, Any]:
    """The keyword arguments of ``flash_attention`` for ``mod`` (one of :data:`MODS`) with ``heads`` query heads:
    ``softcap``, ``alibi_slopes`` and ``sinks`` (standard-normal logits, seeded, requiring grad as a model's would)
    as the modification asks; ``{}`` for ``none``."""
    _check_mod(mod)
    kw: Dict[str, Any] = {}
    if mod in ("softcap", "all"):
        kw["softcap"] = SOFTCAP
    if mod in ("alibi", "all"):
        kw["alibi_slopes"] = alibi_slopes(heads).to(device)
    if mod in ("sinks", "all"):
        gen = torch.Generator().manual_seed(seed)
        kw["sinks"] = torch.randn(heads, generator=gen).to(device).requires_grad_()
    return kw


def flex_score_mod(kwargs: Dict[str, Any]) -> Optional[Callable]:
    """The FlexAttention ``score_mod`` computing what ``kwargs`` (:func:`mod_kwargs`) ask of ``flash_attention`` on a
    causal self-attention call: soft-capping, then the ALiBi bias ``-slope * (q_idx - kv_idx)`` (the distance
    ``|q_idx - kv_idx|`` of the kept keys); None without either. ValueError for sinks, which no ``score_mod`` gives."""
    if kwargs.get("sinks") is not None:
        raise ValueError(f"flex_score_mod: {FLEX_NA}")
    cap, slopes = kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes")
    if not cap and slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx)
        return score

    return score_mod


def flex_unsupported(device: torch.device) -> Optional[str]:
    """Why FlexAttention does not run in this suite on ``device`` (the ``flex`` peer's reasons), or None."""
    return Flex().unsupported(None, device, None)


def _flex_kernel() -> Callable:
    """The FlexAttention callable timed: compiled once for the whole run (the ``flex`` peer's)."""
    return Flex._compiled_flex()


def _causal_block_mask(n: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    if device.type == "cuda":
        try:
            return create_block_mask(causal, None, None, n, n, device=device, _compile=True)
        except TypeError:  # a torch without the _compile argument
            pass
    return create_block_mask(causal, None, None, n, n, device=device)


def flex_fn(kwargs: Dict[str, Any], block_mask) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention on ``(B, N, H, D)`` inputs with ``block_mask`` and the ``score_mod`` of ``kwargs``."""
    flex, score_mod = _flex_kernel(), flex_score_mod(kwargs)

    def run(q, k, v):
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=block_mask)
        return o.transpose(1, 2)

    return run


def fa4_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why FlashAttention-4 does not run in this suite (not installed, not this GPU or dtype), or None."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # not installed, or it fails to import here
        return f"flash_attn.cute not importable ({type(e).__name__})"
    return Fa4().unsupported(SimpleNamespace(head_dim=head_dim), device, dtype)  # (all it reads of a workload)


def fa4_fn(kwargs: Dict[str, Any]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """FlashAttention-4 (causal) with the soft-capping and sinks of ``kwargs`` (float32 sinks, as FA4 takes them);
    ValueError for ALiBi."""
    if kwargs.get("alibi_slopes") is not None:
        raise ValueError(f"fa4_fn: {FA4_NA}")
    from flash_attn.cute import flash_attn_func

    cap, sinks = kwargs.get("softcap", 0.0), kwargs.get("sinks")
    extra: Dict[str, Any] = {}
    if cap:
        extra["softcap"] = cap
    if sinks is not None:
        extra["learnable_sink"] = sinks.float().contiguous()
    return lambda q, k, v: flash_attn_func(q, k, v, causal=True, **extra)[0]


def ours_fn(kwargs: Dict[str, Any], backend: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``longattn.flash_attention`` (causal) with the modifications of ``kwargs``."""
    import longattn

    return lambda q, k, v: longattn.flash_attention(q, k, v, causal=True, backend=backend, **kwargs)


def auto_kernel(q: Tensor, k: Tensor, kwargs: Dict[str, Any], needs_grad: bool) -> str:
    """The kernel ``flash_attention(q, k, v, causal=True, backend="auto", **kwargs)`` runs: ``"sdpa"``,
    ``"triton"`` or ``"torch"`` (asked as :func:`longattn.flash_attention` asks :func:`longattn.runner.choose`)."""
    from longattn import runner
    from longattn.backends import dispatch
    from longattn.call import flash_call

    call = replace(flash_call(q.shape[-1] ** -0.5, causal=True), softcap=kwargs.get("softcap", 0.0),
                   alibi=kwargs.get("alibi_slopes"), sinks=kwargs.get("sinks"))
    sdpa = dispatch.sdpa_call(q, k, causal=True, window=(-1, -1), need_lse=False, needs_grad=needs_grad)
    return runner.choose("auto", q, call, fn="bench", sdpa=sdpa)


def cases(device: torch.device, quick: bool) -> List[Tuple[int, int, int, int]]:
    """``(N, batch, heads, D)``: on a GPU N = 16k at batch 1 (``--quick``: 4k at batch 4), D 64 and 128 with
    heads * D = 2048; on a CPU tiny sizes."""
    if device.type == "cuda":
        n = 4096 if quick else 16384
        return [(n, 16384 // n, 2048 // d, d) for d in (64, 128)]
    return [(128 if quick else 256, 1, 2, d) for d in (16, 32)]


def _impls(device: torch.device) -> Tuple[str, ...]:
    return ("longattn", "longattn-triton", "flex", "fa4") if device.type == "cuda" else ("longattn", "flex")


def _case_rows(cfg, q: Tensor, k: Tensor, v: Tensor, pass_: str, block_mask, flex_reason: Optional[str]):
    """The rows of one case and pass, every implementation and modification taking turns in each round."""
    n, batch, heads, d = q.shape[1], q.shape[0], q.shape[2], q.shape[3]
    impls = _impls(cfg.device)
    # the peers: (the modification each cannot take, its n/a, why it does not run here, its callable's maker)
    peers = {"flex": ("sinks", FLEX_NA, flex_reason, lambda kwargs: flex_fn(kwargs, block_mask)),
             "fa4": ("alibi_slopes", FA4_NA, fa4_unsupported(cfg.device, q.dtype, d) if "fa4" in impls else None,
                     fa4_fn)}
    case: Dict[Tuple[str, str], Row] = {}
    timed, same = [], {}
    for mod in MODS:
        kwargs = mod_kwargs(mod, heads, cfg.device)
        for impl in impls:
            row = case[impl, mod] = Row(suite=SUITE, impl=impl, workload=mod, n=n, batch=batch, heads=heads,
                                        head_dim=d, dtype=cfg.dtype_name, pass_=pass_)
            if impl in peers:
                lacks, na, reason, make = peers[impl]
                if lacks in kwargs:
                    row.status = na
                    continue
                if reason is not None:
                    row.status = f"unsupported: {reason}"
                    continue
                fn = make(kwargs)
            else:
                fn = ours_fn(kwargs, "auto" if impl == "longattn" else "triton")
            if impl == "longattn":
                ran = auto_kernel(q, k, kwargs, needs_grad=pass_ == "fwd_bwd")
                row.note = f"auto ran {ran}"
                if AUTO_PEERS.get(ran) in impls:  # the same kernel as that row: not timed twice
                    same[impl, mod] = AUTO_PEERS[ran], mod
                    continue
            timed.append((row, lambda fn=fn: T.make_step(fn, q, k, v, pass_)))
    T.measure_in_turns(timed, cfg.device, cfg.quick, 2 if cfg.quick else 3)
    for key, target in same.items():
        case[key].copy_measurement(case[target])
    flops = attn_flops(batch, heads, n, n, d, causal=True, mode=pass_)
    for row in case.values():
        if row.ok and row.time_ms:
            row.tflops = flops / (row.time_ms * 1e-3) / 1e12
            row.tokens_per_s = batch * n / (row.time_ms * 1e-3)
    return list(case.values())


def run_score_mods(cfg) -> List[Row]:
    """The suite's rows (see the module's docstring), their ratios filled (:func:`fill_ratios`)."""
    device, dtype = cfg.device, cfg.dtype
    todo = cases(device, cfg.quick)
    flex_reason = flex_unsupported(device)
    cfg.progress.begin(SUITE, len(todo) * len(T.PASSES))
    rows: List[Row] = []
    for n, batch, heads, d in todo:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(batch, n, heads, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
        block_mask = _causal_block_mask(n, device) if flex_reason is None else None
        for pass_ in T.PASSES:
            cfg.progress.step(f"D={d} N={n} B={batch} {pass_}")
            if cfg.budget.allow(SUITE):
                rows.extend(_case_rows(cfg, q, k, v, pass_, block_mask, flex_reason))
        del q, k, v, block_mask
    cfg.progress.end()
    fill_ratios(rows)
    note_fa4(rows)
    return rows


def note_fa4(rows: List[Row]) -> None:
    """Add to the note of each of our rows (:data:`OURS`) FA4's time over its own, where the ``fa4`` row of the same
    modification, case and pass has a time (above 1: ours is faster)."""
    fa4 = {(r.workload, r.n, r.batch, r.head_dim, r.dtype, r.pass_): r.time_ms for r in rows
           if r.suite == SUITE and r.impl == "fa4" and r.ok and r.time_ms}
    for r in rows:
        theirs = fa4.get((r.workload, r.n, r.batch, r.head_dim, r.dtype, r.pass_))
        if r.suite == SUITE and r.impl in OURS and theirs and r.ok and r.time_ms:
            ratio = f"FA4 / this {theirs / r.time_ms:.2f}"
            r.note = f"{r.note}; {ratio}" if r.note else ratio


def fill_ratios(rows: List[Row]) -> None:
    """Set ``vs_plain`` (the row's time over the same implementation's ``none`` row of the same case) and
    ``speedup`` (the ``flex`` row's time of the same modification and case over the row's) on the suite's rows; None
    where either time is missing."""
    def case(r: Row) -> tuple:
        return r.n, r.batch, r.head_dim, r.dtype, r.pass_

    timed = {(r.impl, r.workload) + case(r): r.time_ms for r in rows if r.suite == SUITE and r.ok and r.time_ms}
    for r in rows:
        if r.suite != SUITE:
            continue
        mine = r.time_ms if r.ok and r.time_ms else None
        plain, flex = timed.get((r.impl, "none") + case(r)), timed.get(("flex", r.workload) + case(r))
        r.vs_plain = mine / plain if mine and plain else None
        r.speedup = flex / mine if mine and flex else None


def bar_verdict(row: Row) -> str:
    """Whether a modified row of ours meets the issue's bars: ``"met"``, ``"missed: <which>"``, or ``"-"`` (flex
    and ``none`` rows, rows without a ratio). The cost bar is :data:`COST_BAR` of its pass; the Flex bar
    :data:`FLEX_BAR`, where Flex ran the modification."""
    if row.impl not in OURS or row.workload == "none" or (row.vs_plain is None and row.speedup is None):
        return "-"
    missed = []
    limit = COST_BAR[row.pass_]
    if row.vs_plain is not None and row.vs_plain > limit:
        missed.append(f"costs {row.vs_plain:.2f}x > {limit:.2f}x")
    if row.speedup is not None and row.speedup < FLEX_BAR:
        missed.append(f"{row.speedup:.2f}x < {FLEX_BAR:.1f}x vs flex")
    return "missed: " + "; ".join(missed) if missed else "met"
