"""What ``backend="auto"`` gives against the fastest of its peers, measured in one process on one GPU (its bar:
at least 0.98x the fastest on every row):

    python tools/auto_vs_peers.py [--tables [dense] [packed]] [--pair] [--loop] [--graphed] [--head-dims 128]
                                  [--lengths 1024]

Dense rows: bf16, B·N = 16k, heads·D = 2048, D = 64/128, N = 1k/4k/16k, causal or not, forward (no autograd) and
forward+backward; `auto` (``longattn.flash_attention``), our kernels (``backend="triton"``), SDPA with no backend
chosen and FlashAttention-4 called directly (``flash_attn.cute``, required), taking turns in interleaved rounds
(``longattn.bench.interleaved.time_interleaved``: each round in a Williams order). Packed rows: 64k tokens of
long-tailed documents (``longattn.bench.varlen_suite.document_lengths``), GQA 16/4, D = 128, against FA4's varlen.
Two last columns: the fastest peer's time over `auto`'s as a ratio of medians, and as the median over rounds of the
same ratio within a round (``paired_ratio``: steps of one round share the GPU's clock, which drifts between rounds);
>= 1: `auto` is as fast as the best a user could call.

``--pair``: each dense forward+backward row with `auto` and FA4 direct alone, each timed twice a round, which tells
`auto`'s own cost from what a third step leaves behind (the host-bound 1k rows depend on the order of the steps).

``--loop``: four more columns on the dense forward+backward rows and every packed row: the fastest peer's time over
`auto`'s when each runs 50 steps back to back (12 at 4k, 3 at 16k, 10 packed) with one synchronisation at the end
(a training loop's way; ``do_bench`` times every call alone, with a cache flush and a wait between calls, so a
host-bound step's host time counts in full), paired within the rounds, the peer it was, and the two medians (ms a step).

``--graphed``: four more columns on the dense forward+backward rows: each step captured in a CUDA graph (three
warm-up steps on a side stream first) and its replays timed in the same rounds (20 replays a timing at 1k, fewer
above, one synchronisation each): `auto`'s, ours and FA4's medians (ms a step) and FA4's over ours, paired within
the rounds. A graph takes the host's time away, so these rows compare the kernels of host-bound short steps. A step
that cannot be captured prints why (an HTML comment) and gets ``nan``.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import longattn  # noqa: E402
from longattn.backends import sdpa as sdpa_backend  # noqa: E402
from longattn.bench.interleaved import env_header, paired_ratio, time_interleaved, time_rounds  # noqa: E402
from longattn.bench.timing import round_order  # noqa: E402
from longattn.bench.varlen_suite import document_lengths  # noqa: E402
from longattn.utils import cuda_graph  # noqa: E402


def _no_grad(f):
    def step():
        with torch.no_grad():
            f()
    return step


def _fwd_bwd(f, inputs, do):
    def step():
        f().backward(do)
        for t in inputs:
            t.grad = None
    return step


def _graphed(name: str, step):
    """``step`` captured in a CUDA graph after three warm-up steps on a side stream: the graph's ``replay``, or None
    (with why, as an HTML comment) where the step cannot be captured."""
    try:
        graph, _ = cuda_graph(step)
    except Exception as e:  # (a peer that cannot be captured: its columns say nan)
        torch.cuda.synchronize()
        print(f"<!-- {name}: no CUDA graph: {type(e).__name__}: {str(e)[:200]} -->", flush=True)
        return None
    return graph.replay


def _graphed_columns(steps: dict, rounds: int, n: int) -> str:
    """The ``--graphed`` columns of a forward+backward row: `auto`'s, ours and FA4's graphed step (ms, medians of
    :func:`_loop_times` of ``n`` replays) and FA4's over ours, paired within the rounds."""
    replays = {name: _graphed(name, steps[name]) for name in ("auto", "ours", "fa4")}
    times = _loop_times({name: r for name, r in replays.items() if r is not None}, rounds, n)
    ms = {name: statistics.median(times[name]) if name in times else float("nan") for name in replays}
    ratio = paired_ratio(times, "fa4", "ours") if "fa4" in times and "ours" in times else float("nan")
    return f" {ms['auto']:.3f} | {ms['ours']:.3f} | {ms['fa4']:.3f} | {ratio:.3f} |"


def _dense_rows(head_dims=(64, 128), lengths=(1024, 4096, 16384)):
    """``(D, N, causal, q, k, v, dO)`` of each dense row: bf16, B·N = 16k, heads·D = 2048."""
    for d in head_dims:
        for n in lengths:
            b, h = 16384 // n, 2048 // d
            for causal in (False, True):
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                yield d, n, causal, q, k, v, torch.randn_like(q)


def _loop_ms(step, n: int = 50) -> float:
    """ms a step of ``n`` steps enqueued back to back, one synchronisation at the end."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def _loop_times(steps: dict, rounds: int, n: int) -> dict:
    """Each step's :func:`_loop_ms` (``n`` steps a loop) in each of ``rounds`` rounds, the steps in
    :func:`round_order` each round: ``{name: [ms a step, a round each]}``."""
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in round_order(list(steps), r):
            times[name].append(_loop_ms(steps[name], n))
    return times


def _loop_ratio(steps: dict, rounds: int, n: int = 50) -> tuple:
    """``(paired ratio, peer, auto ms, peer ms)``: the fastest peer's loop time over `auto`'s
    (:func:`_loop_times`), the median over rounds of the ratio within a round; and the two medians, ms a step."""
    times = _loop_times(steps, rounds, n)
    best = min((n for n in steps if n != "auto"), key=lambda n: statistics.median(times[n]))
    return (paired_ratio(times, best, "auto"), best, statistics.median(times["auto"]),
            statistics.median(times[best]))


def dense(fa4, rounds_1k: int, rounds: int, loop: bool = False, rows=(), graphed: bool = False) -> None:
    print("\n| D | N | causal | pass | `auto` ran | auto | ours | SDPA | FA4 | best / auto | paired |"
          + (" loop: best / auto | loop: best | loop: auto ms | loop: best ms |" if loop else "")
          + (" graphed: auto ms | graphed: ours ms | graphed: FA4 ms | graphed: FA4 / ours |" if graphed else "")
          + "\n|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if loop else "")
          + ("---|---|---|---|" if graphed else ""), flush=True)
    for d, n, causal, q, k, v, do in _dense_rows(*rows):
        calls = {"auto": lambda: longattn.flash_attention(q, k, v, causal=causal),
                 "ours": lambda: longattn.flash_attention(q, k, v, causal=causal, backend="triton"),
                 "sdpa": lambda: sdpa_backend.flash_attention(q, k, v, causal=causal),
                 "fa4": lambda: fa4.flash_attn_func(q, k, v, causal=causal)[0]}
        for mode in ("fwd", "fwd+bwd"):
            steps = {name: _no_grad(f) if mode == "fwd" else _fwd_bwd(f, (q, k, v), do) for name, f in calls.items()}
            samples = time_rounds(steps, rounds=rounds_1k if n == 1024 else rounds)
            t = {name: statistics.median(s) for name, s in samples.items()}
            with torch.set_grad_enabled(mode != "fwd"):
                ran = longattn.explain(longattn.flash_attention, q, k, v, causal=causal).backend
            best = min(("ours", "sdpa", "fa4"), key=t.get)
            extra = ""
            if loop:
                ratio, peer, auto_ms, peer_ms = (_loop_ratio(steps, rounds, max(3, 50 * 1024 // n))
                                                 if mode == "fwd+bwd" else (float("nan"), "", float("nan"),
                                                                            float("nan")))
                extra = f" {ratio:.3f} | {peer} | {auto_ms:.3f} | {peer_ms:.3f} |"
            if graphed:
                extra += (_graphed_columns(steps, rounds, max(3, 20 * 1024 // n)) if mode == "fwd+bwd"
                          else " | | | |")
            print(f"| {d} | {n // 1024}k | {'yes' if causal else 'no'} | {mode} | {ran} | {t['auto']:.3f} | "
                  f"{t['ours']:.3f} | {t['sdpa']:.3f} | {t['fa4']:.3f} | {t[best] / t['auto']:.3f} | "
                  f"{paired_ratio(samples, best, 'auto'):.3f} |" + extra, flush=True)


def pair(fa4, rounds: int, rows=()) -> None:
    print("\n| D | N | causal | auto | auto again | FA4 | FA4 again | FA4 / auto |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for d, n, causal, q, k, v, do in _dense_rows(*rows):
        auto = _fwd_bwd(lambda: longattn.flash_attention(q, k, v, causal=causal), (q, k, v), do)
        direct = _fwd_bwd(lambda: fa4.flash_attn_func(q, k, v, causal=causal)[0], (q, k, v), do)
        t = time_interleaved({"auto": auto, "fa4": direct, "auto2": auto, "fa42": direct}, rounds=rounds)
        ratio = (t["fa4"] + t["fa42"]) / (t["auto"] + t["auto2"])
        print(f"| {d} | {n // 1024}k | {'yes' if causal else 'no'} | {t['auto']:.3f} | {t['auto2']:.3f} | "
              f"{t['fa4']:.3f} | {t['fa42']:.3f} | {ratio:.3f} |", flush=True)


def packed(fa4, rounds: int, loop: bool = False) -> None:
    lens = document_lengths(65536)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    total, longest = int(cu[-1]), max(lens)
    q = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    print(f"\npacked: {len(lens)} documents, {total} tokens, longest {longest}, GQA 16/4, D = 128\n\n"
          "| causal | pass | auto | ours | FA4 | best / auto | paired |"
          + (" loop: best / auto | loop: best | loop: auto ms | loop: best ms |" if loop else "")
          + "\n|---|---|---|---|---|---|---|" + ("---|---|---|---|" if loop else ""), flush=True)
    for causal in (False, True):
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)
        calls = {"auto": lambda: longattn.flash_attention_varlen(q, k, v, **kw),
                 "ours": lambda: longattn.flash_attention_varlen(q, k, v, backend="triton", **kw),
                 "fa4": lambda: fa4.flash_attn_varlen_func(q, k, v, max_seqlen_q=longest, max_seqlen_k=longest,
                                                           **kw)[0]}
        for mode in ("fwd", "fwd+bwd"):
            steps = {name: _no_grad(f) if mode == "fwd" else _fwd_bwd(f, (q, k, v), do) for name, f in calls.items()}
            samples = time_rounds(steps, rounds=rounds)
            t = {name: statistics.median(s) for name, s in samples.items()}
            best = min(("ours", "fa4"), key=t.get)
            extra = ""
            if loop:  # (every row: a packed step is long, and its host time is hidden only when steps queue up)
                ratio, peer, auto_ms, peer_ms = _loop_ratio(steps, rounds, 10)
                extra = f" {ratio:.3f} | {peer} | {auto_ms:.3f} | {peer_ms:.3f} |"
            print(f"| {'yes' if causal else 'no'} | {mode} | {t['auto']:.3f} | {t['ours']:.3f} | {t['fa4']:.3f} | "
                  f"{t[best] / t['auto']:.3f} | {paired_ratio(samples, best, 'auto'):.3f} |" + extra, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", nargs="*", default=["dense", "packed"], choices=["dense", "packed"],
                   help="tables to time (none: only --pair)")
    p.add_argument("--pair", action="store_true", help="also time auto and FA4 alone on the forward+backward rows")
    p.add_argument("--loop", action="store_true", help="also time steps in loops (the dense forward+backward rows, "
                   "50 steps at 1k; every packed row, 10 steps), one synchronisation a loop")
    p.add_argument("--graphed", action="store_true", help="also time the dense forward+backward rows as CUDA-graph "
                   "replays (auto, ours, FA4): the kernels of host-bound steps")
    p.add_argument("--rounds", type=int, default=8, help="rounds above N = 1k (1k: 2x as many, host-bound rows; "
                   "four rounds left a 2-3%% noise in a median, the size of the 0.98 bar)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="dense rows' head dims")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="dense rows' N")
    a = p.parse_args()
    rows = (a.head_dims, a.lengths)
    from flash_attn import cute as fa4  # (required: the table's peer)

    print(f"{env_header()}, flash-attn-4 {importlib.metadata.version('flash-attn-4')}")
    if "dense" in a.tables:
        dense(fa4, 2 * a.rounds, a.rounds, a.loop, rows, a.graphed)
    if a.pair:
        pair(fa4, 2 * a.rounds, rows)
    if "packed" in a.tables:
        packed(fa4, a.rounds, a.loop)


if __name__ == "__main__":
    main()
