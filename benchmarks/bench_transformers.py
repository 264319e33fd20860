"""Hugging Face transformers benchmark: a Llama-style model from config with ``attn_implementation="longattn"``
(and ``"longattn_dilated"``) against the implementations transformers ships, one training step and a generate call.

Model (the transformers issue's): ``LlamaConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
num_key_value_heads=2, vocab_size=32000)``, other settings the config's defaults; bf16 weights, batch 1.

- train: one step (forward, loss on all tokens, backward) at 16k and 64k tokens (64k with gradient checkpointing:
  without it the MLP activations do not fit in 80 GB); peers ``"sdpa"`` and, where it runs, ``"flex_attention"``.
- packed: documents of long-tailed lengths filling 16k tokens: ours on the padding-free packed batch (position_ids
  restarting, as ``DataCollatorWithFlattening`` builds it), sdpa on the same documents padded into a batch (what
  users without a packed path run), and sdpa on the packed batch (transformers then builds a 4-D document mask);
  gradient checkpointing on for all (the padded batch does not fit without it).
- generate: a 4k-token prompt, 64 new tokens (greedy, the default dynamic cache).
- dilated: ``"longattn_dilated"`` (segments 2k-16k, rates 1-8) at 256k tokens, vocab 8192 and gradient checkpointing
  (the 256k x 32000 logits alone would take 48 GiB), against sdpa on the same model.

Times are medians of interleaved rounds (the implementations take turns); peak memory from
``torch.cuda.max_memory_allocated``.

    python benchmarks/bench_transformers.py [--out FILE] [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from longattn.bench.interleaved import emit, env_header

LLAMA = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
             max_position_embeddings=1 << 19)
DILATED = {"segment_lengths": [2048, 4096, 8192, 16384], "dilation_rates": [1, 2, 4, 8]}


def _model(impl: str, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA, **overrides})
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation(impl)
    return model


def _timed(fn, reps: int) -> float:
    """Median wall time of ``fn`` in ms over ``reps`` calls (synchronised)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def _in_turns(steps: dict, rounds: int, reps: int) -> dict:
    """``{name: (ms, peak GiB)}``, NaN for a step that fails (printed); the steps take turns in every round (one call
    per turn for steps slower than a second)."""
    live, peaks = {}, {}
    for name, step in steps.items():
        try:
            step()  # warm-up: kernels compiled, caches built
            t0 = time.perf_counter()
            peaks[name] = _peak(step)
            live[name] = (step, 1 if time.perf_counter() - t0 > 1.0 else reps)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run shows as missing
            print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        torch.cuda.empty_cache()
    times = {name: [] for name in live}
    for _ in range(rounds):
        for name, (step, n) in live.items():
            times[name].append(_timed(step, n))
    nan = float("nan")
    return {name: (statistics.median(times[name]) if name in live else nan, peaks.get(name, nan)) for name in steps}


def _train_step(model, batch: dict):
    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    return step


def _documents(total: int, seed: int = 0) -> list:
    """Long-tailed document lengths (log-normal, median about 700 tokens) filling ``total`` tokens exactly."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = int(math.exp(6.5 + 1.2 * torch.randn((), generator=g).item()))
        n = max(16, min(n, left, total // 2))
        lengths.append(n)
        left -= n
    return lengths


def train_rows(rounds: int, lengths=(16384, 65536)) -> list:
    rows = []
    impls = ("longattn", "sdpa", "flex_attention")
    models = {impl: _model(impl) for impl in impls}
    for n in lengths:
        if n > 16384:
            models.pop("flex_attention", None)  # (its compile at 64k costs minutes)
            for model in models.values():
                model.gradient_checkpointing_enable()
        ids = torch.randint(0, LLAMA["vocab_size"], (1, n), device="cuda")
        batch = {"input_ids": ids, "labels": ids}
        r = _in_turns({impl: _train_step(model, batch) for impl, model in models.items()}, rounds, reps=3)
        rows.append((f"train {n // 1024}k", r))
        print(rows[-1], flush=True)
    return rows


def packed_rows(rounds: int, total: int = 16384) -> list:
    lengths = _documents(total)
    vocab = LLAMA["vocab_size"]
    ids = torch.randint(0, vocab, (total,), device="cuda")
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    packed = {"input_ids": ids[None], "position_ids": position_ids, "labels": ids[None]}
    width = max(lengths)
    padded_ids = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(padded_ids)
    start = 0
    for b, n in enumerate(lengths):
        padded_ids[b, :n], mask[b, :n] = ids[start:start + n], 1
        start += n
    labels = padded_ids.masked_fill(mask == 0, -100)
    padded = {"input_ids": padded_ids, "attention_mask": mask, "labels": labels}
    ours, sdpa = _model("longattn"), _model("sdpa")
    for model in (ours, sdpa):  # the padded batch holds several times the tokens: without it, it does not fit
        model.gradient_checkpointing_enable()
    steps = {"longattn packed": _train_step(ours, packed), "sdpa padded": _train_step(sdpa, padded),
             "sdpa packed": _train_step(sdpa, packed), "longattn padded": _train_step(ours, padded)}
    r = _in_turns(steps, rounds, reps=3)
    label = f"packed {total // 1024}k ({len(lengths)} docs, longest {width}, padded to {len(lengths)}x{width})"
    print(label, r, flush=True)
    return [(label, r)]


def generate_rows(rounds: int, prompt: int = 4096, new: int = 64) -> list:
    impls = ("longattn", "sdpa", "flash_attention_2")
    ids = torch.randint(0, LLAMA["vocab_size"], (1, prompt), device="cuda")
    steps = {}
    for impl in impls:
        try:
            model = _model(impl).eval()
        except Exception as e:  # noqa: BLE001 - not installed in this image
            print(f"  {impl}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        steps[impl] = (lambda m: lambda: m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                    pad_token_id=0))(model)
    with torch.no_grad():  # host-bound and noisy at batch 1: more rounds
        r = _in_turns(steps, max(rounds, 6), reps=2)
    rows = [(f"generate {prompt // 1024}k + {new}", r)]
    print(rows[-1], flush=True)
    return rows


def dilated_rows(n: int = 262144) -> list:
    ids = torch.randint(0, 8192, (1, n), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    out = {}
    for impl in ("longattn_dilated", "sdpa"):
        model = _model(impl, vocab_size=8192, longattn_dilated=DILATED)
        model.gradient_checkpointing_enable()
        r = _in_turns({impl: _train_step(model, batch)}, rounds=1, reps=2)
        out.update(r)
        del model
        torch.cuda.empty_cache()
    rows = [(f"dilated train {n // 1024}k", out)]
    print(rows[-1], flush=True)
    return rows


def _table(rows: list, header: str, rounds: int) -> str:
    lines = [f"Measured on {header}; bf16, Llama-style model (8 layers, hidden 1024, 8 heads, 2 KV heads), batch 1 "
             f"unless stated; ms (median of {rounds} interleaved rounds), peak GiB in brackets.", "",
             "| case | ours | peers | speed vs the first sdpa (its ms / ours) |", "|---|---|---|---|"]
    for label, r in rows:
        ours_name = next(name for name in r if name.startswith("longattn"))
        ours_ms = r[ours_name][0]
        peers = ", ".join(f"{name} {ms:.1f} ({gib:.1f})" for name, (ms, gib) in r.items() if name != ours_name)
        sdpa_name = next((name for name in r if name.startswith("sdpa")), None)
        ratio = r[sdpa_name][0] / ours_ms if sdpa_name else float("nan")
        lines.append(f"| {label} | {ours_name} {ours_ms:.1f} ({r[ours_name][1]:.1f}) | {peers} | {ratio:.2f}x |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="train,packed,generate,dilated")
    p.add_argument("--train-lengths", default="16384,65536")
    a = p.parse_args()
    from longattn.integrations.transformers import register

    register()
    header = env_header()
    import transformers

    header += f", transformers {transformers.__version__}"
    print(header, flush=True)
    rows = []
    lengths = tuple(int(x) for x in a.train_lengths.split(","))
    parts = {"train": lambda: train_rows(a.rounds, lengths), "packed": lambda: packed_rows(a.rounds),
             "generate": lambda: generate_rows(a.rounds), "dilated": dilated_rows}
    for part in a.only.split(","):
        rows += parts[part]()
        torch.cuda.empty_cache()
    emit(_table(rows, header, a.rounds), a.out)


if __name__ == "__main__":
    main()
