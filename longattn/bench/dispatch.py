"""The ``dispatch`` suite: the measurement behind ``backend="auto"``'s table (:mod:`longattn.backends.auto_table`).

For each kind of call that both SDPA and longattn's kernels compute exactly (dense or causal, MHA or grouped-query
heads, a head dim per bucket, forward and forward+backward) it times, at a few sequence lengths and taking turns
in every round, SDPA with no backend chosen (``sdpa``: what a user gets by default), our kernels forced
(``longattn-triton``, GPUs only) and ``backend="auto"`` (``longattn``, whose note says which kernel it ran; where
that is one of the other rows' kernels, the row repeats that row's measurement and says "same kernel as").
:func:`derive_table` turns the rows into table entries: our kernel wherever it was faster than SDPA's default at
every length measured, SDPA elsewhere.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from longattn.bench import timing as T
from longattn.bench.peers import AUTO_PEERS
from longattn.bench.results import Row

GROUP = 4  # grouped-query rows: Hq = 4 * Hk


def _impls(device: torch.device) -> Dict[str, Callable]:
    import longattn
    from longattn.backends import sdpa as sdpa_backend

    def sdpa(q, k, v, causal):  # SDPA with no backend chosen, on transposed views (the user's call)
        return sdpa_backend.flash_attention(q, k, v, causal=causal)

    impls = {"sdpa": sdpa, "longattn": lambda q, k, v, causal: longattn.flash_attention(q, k, v, causal=causal)}
    if device.type == "cuda":
        impls["longattn-triton"] = lambda q, k, v, causal: longattn.flash_attention(q, k, v, causal=causal,
                                                                                     backend="triton")
    return impls


def auto_choice(q, k, causal: bool, needs_grad: bool) -> str:
    """The implementation ``backend="auto"`` picks for this call (``sdpa``, ``triton`` or ``torch``)."""
    from longattn.backends import dispatch as _dispatch

    call = _dispatch.sdpa_call(q, k, causal=causal, window=(-1, -1), need_lse=False, needs_grad=needs_grad)
    return _dispatch.choose("auto", q, fn="dispatch", sdpa=call)


def workload_name(causal: bool, grouped: bool) -> str:
    """``dense``/``causal``, with ``-gqa`` for grouped-query heads (``Hq = 4 Hk``)."""
    return ("causal" if causal else "dense") + ("-gqa" if grouped else "")


def cases(device: torch.device, quick: bool) -> List[Tuple[int, bool, bool, int, int]]:
    """``(head_dim, causal, grouped, N, batch)``: batch * N and heads * head_dim fixed per device."""
    if device.type == "cuda":
        dims, lengths, tokens = (64, 128, 256), ((4096,) if quick else (1024, 4096, 16384)), 16384
    else:
        dims, lengths, tokens = (64,), ((256, 1024) if quick else (256, 1024, 4096)), 4096
    return [(d, causal, grouped, n, max(1, tokens // n)) for d in dims for causal in (False, True)
            for grouped in (False, True) for n in lengths]


def run_dispatch(cfg) -> List[Row]:
    device, dtype = cfg.device, cfg.dtype
    impls = _impls(device)
    rows: List[Row] = []
    todo = cases(device, cfg.quick)
    rounds = 2 if cfg.quick else 3
    cfg.progress.begin("dispatch", len(todo) * 2)
    for d, causal, grouped, n, batch in todo:
        hq = (2048 if device.type == "cuda" else 256) // d
        hk = hq // GROUP if grouped else hq
        q = torch.randn(batch, n, hq, d, device=device, dtype=dtype)
        k, v = (torch.randn(batch, n, hk, d, device=device, dtype=dtype) for _ in range(2))
        for pass_ in T.PASSES:
            cfg.progress.step(f"D={d} {'causal' if causal else 'dense'} {'gqa' if grouped else 'mha'} N={n} {pass_}")
            runs, case, same = [], {}, {}
            for name, fn in impls.items():
                row = Row(suite="dispatch", impl=name, workload=workload_name(causal, grouped), n=n, batch=batch,
                          heads=hq, head_dim=d, dtype=cfg.dtype_name, pass_=pass_)
                case[name] = row
                if name == "longattn":
                    ran = auto_choice(q, k, causal, pass_ == "fwd_bwd")
                    row.note = f"auto ran {ran}"
                    if AUTO_PEERS.get(ran) in impls:  # the same kernel as that row: not timed twice
                        same[name] = AUTO_PEERS[ran]
                        continue
                runs.append((row, lambda fn=fn, pass_=pass_: T.make_step(
                    lambda a, b, c: fn(a, b, c, causal), q, k, v, pass_)))
            T.measure_in_turns(runs, device, cfg.quick, rounds)
            for name, target in same.items():
                case[name].copy_measurement(case[target])
            rows.extend(case.values())
        del q, k, v
    cfg.progress.end()
    return rows


def derive_table(rows: List[Row], device_class: str) -> Dict[Tuple[str, str, bool, bool, int], str]:
    """Table entries from dispatch rows: ``"triton"`` where ``longattn-triton`` beat ``sdpa`` at every length of a
    kind of call, ``"sdpa"`` where it lost at any (a kind with no timed pair gets no entry)."""
    from longattn.backends.auto_table import SDPA, TRITON

    timed = {(r.impl, r.workload, r.head_dim, r.pass_, r.n): r.time_ms
             for r in rows if r.suite == "dispatch" and r.ok and r.time_ms}
    table: Dict[Tuple[str, str, bool, bool, int], str] = {}
    for (impl, workload, d, pass_, n), ours in timed.items():
        if impl != "longattn-triton":
            continue
        theirs = timed.get(("sdpa", workload, d, pass_, n))
        if theirs is None:
            continue
        key = (device_class, pass_, workload.startswith("causal"), workload.endswith("-gqa"), d)
        faster = ours < theirs
        table[key] = TRITON if faster and table.get(key, TRITON) == TRITON else SDPA
    return table
