"""Helpers of the GPU benchmark tables (the scripts of the repository's ``benchmarks/`` folder, not installed):
interleaved timing, FLOP counts, the environment header, SDPA and FlexAttention callables, and the tile sweeps of
``tools/tune_backward.py``."""
from __future__ import annotations

import datetime
import platform
import statistics

import torch

from longattn.bench.timing import make_step, round_order


def env_header() -> str:
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return (f"{dev}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today().isoformat()}")


def emit(text: str, out) -> None:
    """Print a finished table (Markdown ``text``) and write it to the file ``out`` when given."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn`` in ms (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def attn_flops(batch: int, heads: int, n: int, m: int, head_dim: int, causal: bool, mode: str) -> float:
    """FlashAttention's count: 4 B H N M D forward (halved for causal), backward 2.5x forward."""
    f = 4.0 * batch * heads * n * m * head_dim * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def sdpa_fn(backend_name: str):
    """An SDPA call restricted to one backend, on (B, N, H, D) inputs (transposed views, no copies)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend_name]

    def run(q, k, v, causal=False):
        with sdpa_kernel([backend]):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    return run


_flex_compiled = None


def flex_fn(block_mask=None):
    """Compiled FlexAttention on (B, N, H, D) inputs with an optional BlockMask."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if _flex_compiled is None:
        import torch._dynamo

        # One compiled graph per shape, mask and grad mode: allow enough of them for a whole benchmark table.
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, causal=False):
        o = _flex_compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                           enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    return run


def flex_causal_mask(n: int, m: int, device="cuda"):
    from torch.nn.attention.flex_attention import create_block_mask

    shift = m - n

    def causal(b, h, i, j):
        return j <= i + shift

    return create_block_mask(causal, None, None, n, m, device=device)


def time_pass(fn, q, k, v, mode: str) -> float:
    """Time ``fn`` forward (``fwd``) or forward+backward (``fwd_bwd``) in ms."""
    return bench_ms(make_step(fn, q, k, v, mode))


def time_interleaved(steps: dict, rounds: int = 3, **bench_kw) -> dict:
    """``{name: ms}``: the median over ``rounds`` of each step's do_bench median, the steps taking turns within
    every round, so that a drift of the GPU's clock (heat, power) falls on all of them alike rather than on whichever
    was measured last; each round in the order :func:`longattn.bench.timing.round_order` gives for it. A step
    that fails on its first call (compilation, out of memory) gets NaN and a printed reason."""
    samples = time_rounds(steps, rounds, **bench_kw)
    return {name: statistics.median(samples[name]) if samples[name] else float("nan") for name in steps}


def paired_ratio(samples: dict, num: str, den: str) -> float:
    """The median over rounds of ``num``'s time over ``den``'s in the same round (:func:`time_rounds`' samples): the
    two steps of a round share its clock, so this ratio moves less with the GPU's drift than a ratio of medians.
    NaN where either step has no samples."""
    pairs = [a / b for a, b in zip(samples[num], samples[den])]
    return statistics.median(pairs) if pairs else float("nan")


def time_rounds(steps: dict, rounds: int = 3, **bench_kw) -> dict:
    """``{name: [ms of each round]}`` as :func:`time_interleaved` takes them (an empty list for a step that failed on
    its first call)."""
    live = {}
    for name, step in steps.items():
        try:
            step()
            live[name] = step
        except Exception as e:  # noqa: BLE001 - a peer that cannot run shows as missing
            print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    torch.cuda.synchronize()
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in round_order(list(live), r):
            times[name].append(bench_ms(live[name], **bench_kw))
    return times


def sweep_tiles(fwd, bwd, pass_name: str, candidates, rounds: int = 2) -> list:
    """``[(ms, tiles), ...]`` fastest first: ``fwd()`` (for ``pass_name == "fwd"``) or ``bwd()`` timed with the
    table's own setting (``tiles`` None) and with each candidate forced for that pass
    (:func:`longattn.backends.triton.tiles.override_tiles`), all taking turns in every round. Settings that fail
    (shared-memory overflow, ...) are reported and left out."""
    from longattn.backends.triton.tiles import override_tiles

    run = fwd if pass_name == "fwd" else bwd
    steps = {None: run}
    for t in candidates:
        def step(t=t):
            with override_tiles(**{pass_name: t}):
                return run()

        steps[t] = step
    times = time_interleaved(steps, rounds=rounds)
    return sorted(((ms, t) for t, ms in times.items() if ms == ms), key=lambda r: r[0])


def format_best(rows, count: int = 4) -> str:
    """The table's time and the ``count`` fastest of :func:`sweep_tiles`'s rows, as ``ms MxN wW sS`` items."""
    table = next((f"{ms:.3f} ms" for ms, t in rows if t is None), "failed")
    best = "; ".join(f"{ms:.3f} {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
                     for ms, t in [r for r in rows if r[1] is not None][:count])
    return f"table {table}; best {best}"
