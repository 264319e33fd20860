"""The ``dispatch`` suite: the measurement behind ``backend="auto"``'s table (:mod:`longattn.backends.auto_table`).

For each kind of call that both SDPA and longattn's kernels compute exactly it times, taking turns in every round,
SDPA with no backend chosen (``sdpa``: what a user gets by default), our kernels forced (``longattn-triton``, GPUs
only) and ``backend="auto"`` (``longattn``, whose note says which kernel it ran; where that is one of the other
rows' kernels, the row repeats that row's measurement and says "same kernel as"):

- dense or causal attention, MHA or grouped-query heads, a head dim per bucket, forward and forward+backward, at a
  few sequence lengths (``flash_attention``);
- decode (pass ``decode``): one new token against a contiguous cache whose length is given as an int, grouped-query
  heads, at a few batch sizes and cache lengths (``flash_attention_with_kvcache``; SDPA over the whole cache).

:func:`derive_table` turns the rows into table entries: our kernel wherever it was faster than SDPA's default on
every case measured of a kind of call, SDPA elsewhere. Where FlashAttention-4 is installed, the dense rows time it too
(``fa4``), and :func:`derive_fa4_orders` gives the table's orders of the three
(:data:`longattn.backends.auto_table.WITH_FA4`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from longattn.bench import timing as T
from longattn.bench.decode_suite import auto_decode_backend
from longattn.bench.peers import AUTO_PEERS
from longattn.bench.results import Row

GROUP = 4  # grouped-query rows of the dense calls: Hq = 4 * Hk
DECODE = "decode"  # the pass of the decode rows (the table's key)


def _impls(device: torch.device) -> Dict[str, Callable]:
    import longattn
    from longattn.backends import sdpa as sdpa_backend

    def sdpa(q, k, v, causal):  # SDPA with no backend chosen, on transposed views (the user's call)
        return sdpa_backend.flash_attention(q, k, v, causal=causal)

    impls = {"sdpa": sdpa, "longattn": lambda q, k, v, causal: longattn.flash_attention(q, k, v, causal=causal)}
    if device.type == "cuda":
        impls["longattn-triton"] = lambda q, k, v, causal: longattn.flash_attention(q, k, v, causal=causal,
                                                                                     backend="triton")
        from longattn.backends import fa4

        if fa4.device_reason(torch.empty(0, device=device)) is None:  # FlashAttention-4 installed: a third row
            impls["fa4"] = lambda q, k, v, causal: longattn.flash_attention(q, k, v, causal=causal, backend="fa4")
    return impls


def _auto_ran(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, needs_grad: bool) -> str:
    """The backend ``auto`` runs the call on (its plan, :func:`longattn.explain`; no kernel runs)."""
    import longattn

    q, k, v = (x.detach().requires_grad_(needs_grad) for x in (q, k, v))
    return longattn.explain(longattn.flash_attention, q, k, v, causal=causal).backend


def _decode_impls(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Dict[str, Callable[[], None]]:
    """Zero-argument decode steps on one contiguous cache, full to its length (an int ``cache_seqlens``)."""
    import longattn

    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    length = k_cache.shape[1]

    def sdpa():  # SDPA's default over the cache, grouped-query heads: what a user without longattn runs
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    def ours(backend):
        def run():
            with torch.no_grad():
                longattn.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, backend=backend)
        return run

    steps = {"sdpa": sdpa, "longattn": ours("auto")}
    if q.is_cuda:
        steps["longattn-triton"] = ours("triton")
    return steps


def workload_name(causal: bool, grouped: bool) -> str:
    """``dense``/``causal``, with ``-gqa`` for grouped-query heads (``Hq = 4 Hk``)."""
    return ("causal" if causal else "dense") + ("-gqa" if grouped else "")


def decode_workload_name(grouped: bool) -> str:
    """``decode``, with ``-gqa`` for grouped-query heads."""
    return DECODE + ("-gqa" if grouped else "")


def cases(device: torch.device, quick: bool) -> List[Tuple[int, bool, bool, int, int]]:
    """``(head_dim, causal, grouped, N, batch)``: batch * N and heads * head_dim fixed per device."""
    if device.type == "cuda":
        dims, lengths, tokens = (64, 128, 256), ((4096,) if quick else (1024, 4096, 16384)), 16384
    else:
        dims, lengths, tokens = (64,), ((256, 1024) if quick else (256, 1024, 4096)), 4096
    return [(d, causal, grouped, n, max(1, tokens // n)) for d in dims for causal in (False, True)
            for grouped in (False, True) for n in lengths]


def decode_cases(device: torch.device, quick: bool) -> List[Tuple[int, int, int, int, int]]:
    """``(batch, cache length, Hq, Hk, D)`` of the decode rows: on a GPU batches 1, 8, 32 and caches of 4k, 32k and
    128k keys (at most 1M cached keys per case: 8 GiB of K and V), GQA 32/8, D=128; tiny on a CPU."""
    if device.type == "cuda":
        shapes = ((1, 32768), (32, 4096)) if quick else tuple(
            (b, m) for b in (1, 8, 32) for m in (4096, 32768, 131072) if b * m <= 1 << 20)
        return [(b, m, 32, 8, 128) for b, m in shapes]
    return [(2, 512 if quick else 2048, 8, 2, 64)]


def _compile_key(row: Row, device: torch.device) -> Optional[tuple]:
    """The kernel variant the first call of ``row`` compiles: our kernels on a GPU (the longattn row, when it runs
    them, repeats the longattn-triton row and is not run)."""
    from longattn.bench.first_calls import FA4, TRITON

    if device.type != "cuda" or row.impl not in ("longattn-triton", "fa4"):
        return None
    return (TRITON if row.impl == "longattn-triton" else FA4, row.workload, row.pass_, row.head_dim, row.dtype)


def _run_dense(cfg, rounds: int) -> List[Row]:
    device, dtype = cfg.device, cfg.dtype
    impls = _impls(device)
    rows: List[Row] = []
    for d, causal, grouped, n, batch in cases(device, cfg.quick):
        if not cfg.budget.allow("dispatch"):
            continue
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
                    ran = _auto_ran(q, k, v, causal, pass_ == "fwd_bwd")
                    row.note = f"auto ran {ran}"
                    if AUTO_PEERS.get(ran) in impls:  # the same kernel as that row: not timed twice
                        same[name] = AUTO_PEERS[ran]
                        continue
                runs.append((row, lambda fn=fn, pass_=pass_: T.make_step(
                    lambda a, b, c: fn(a, b, c, causal), q, k, v, pass_)))
            T.measure_in_turns(runs, device, cfg.quick, rounds, cfg.first_calls,
                               [_compile_key(row, device) for row, _ in runs])
            for name, target in same.items():
                case[name].copy_measurement(case[target])
            rows.extend(case.values())
        del q, k, v
    return rows


def _run_decode(cfg, rounds: int) -> List[Row]:
    device, dtype = cfg.device, cfg.dtype
    rows: List[Row] = []
    for batch, m, hq, hk, d in decode_cases(device, cfg.quick):
        cfg.progress.step(f"decode B={batch} cache={m} Hq={hq} Hk={hk} D={d}")
        if not cfg.budget.allow("dispatch"):
            continue
        gen = torch.Generator(device=device).manual_seed(0)
        k_cache, v_cache = (torch.randn(batch, m, hk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        q = torch.randn(batch, 1, hq, d, device=device, dtype=dtype, generator=gen)
        steps = _decode_impls(q, k_cache, v_cache)
        ran = auto_decode_backend(q, k_cache, cache_seqlens=m)
        same = AUTO_PEERS.get(ran)
        case = {name: Row(suite="dispatch", impl=name, workload=decode_workload_name(hq != hk), n=m, batch=batch,
                          heads=hq, head_dim=d, dtype=cfg.dtype_name, pass_=DECODE) for name in steps}
        case["longattn"].note = f"auto ran {ran}"
        runs = [(case[name], lambda step=step: step) for name, step in steps.items()
                if not (name == "longattn" and same in steps)]
        T.measure_in_turns(runs, device, cfg.quick, rounds, cfg.first_calls,
                           [_compile_key(row, device) for row, _ in runs])
        if same in steps:  # the same kernel as that row: not timed twice
            case["longattn"].copy_measurement(case[same])
        for row in case.values():
            if row.time_ms:
                row.tokens_per_s = batch / (row.time_ms * 1e-3)
        rows.extend(case.values())
        del k_cache, v_cache, q, steps
    return rows


def run_dispatch(cfg) -> List[Row]:
    rounds = 2 if cfg.quick else 3
    cfg.progress.begin("dispatch", len(cases(cfg.device, cfg.quick)) * len(T.PASSES)
                       + len(decode_cases(cfg.device, cfg.quick)))
    rows = _run_dense(cfg, rounds) + _run_decode(cfg, rounds)
    cfg.progress.end()
    return rows


def derive_table(rows: List[Row], device_class: str) -> Dict[Tuple[str, str, bool, bool, int], str]:
    """Table entries from dispatch rows: ``"triton"`` where ``longattn-triton`` beat ``sdpa`` on every case (every
    length, and for decode every batch size and cache length) of a kind of call, ``"sdpa"`` where it lost on any (a
    kind with no timed pair gets no entry). Keys as in :data:`longattn.backends.auto_table.MEASURED`: the pass is
    ``"fwd"``, ``"fwd_bwd"`` or ``"decode"`` (whose ``causal`` is False)."""
    from longattn.backends.auto_table import SDPA, TRITON

    timed = {(r.impl, r.workload, r.head_dim, r.pass_, r.n, r.batch): r.time_ms
             for r in rows if r.suite == "dispatch" and r.ok and r.time_ms}
    table: Dict[Tuple[str, str, bool, bool, int], str] = {}
    for (impl, workload, d, pass_, n, batch), ours in timed.items():
        if impl != "longattn-triton":
            continue
        theirs = timed.get(("sdpa", workload, d, pass_, n, batch))
        if theirs is None:
            continue
        key = (device_class, pass_, workload.startswith("causal"), workload.endswith("-gqa"), d)
        faster = ours < theirs
        table[key] = TRITON if faster and table.get(key, TRITON) == TRITON else SDPA
    return table


def derive_fa4_orders(rows: List[Row], device_class: str) -> Dict[Tuple[str, str, str, int], tuple]:
    """Entries of :data:`longattn.backends.auto_table.WITH_FA4` from dispatch rows that timed FA4 (``fa4``) beside
    SDPA's default (``sdpa``) and our kernels (``longattn-triton``): per pass, kind (``dense``/``causal``; the
    grouped-query rows are reported, not keyed: FA4's kind of call does not tell them apart) and head dim, the
    implementations fastest first at each length, lengths with the same order merged, each range ending at the
    geometric middle between two measured lengths."""
    from longattn.backends.auto_table import FA4, SDPA, TRITON

    names = {"sdpa": SDPA, "fa4": FA4, "longattn-triton": TRITON}
    timed = {(r.impl, r.workload, r.head_dim, r.pass_, r.n): r.time_ms
             for r in rows if r.suite == "dispatch" and r.ok and r.time_ms}
    orders: Dict[Tuple[str, str, int], Dict[int, tuple]] = {}
    for (impl, workload, d, pass_, n) in timed:
        if impl != "fa4" or workload.endswith("-gqa") or pass_ == DECODE:
            continue
        times = {names[i]: timed[(i, workload, d, pass_, n)] for i in names if (i, workload, d, pass_, n) in timed}
        orders.setdefault((pass_, workload, d), {})[n] = tuple(sorted(times, key=times.get))
    table = {}
    for (pass_, kind, d), by_n in orders.items():
        lengths, entries = sorted(by_n), []
        for i, n in enumerate(lengths):
            below = None if i == len(lengths) - 1 else int((n * lengths[i + 1]) ** 0.5)
            if entries and entries[-1][1] == by_n[n]:
                entries[-1] = (below, by_n[n])
            else:
                entries.append((below, by_n[n]))
        table[(device_class, pass_, kind, d)] = tuple(entries)
    return table
