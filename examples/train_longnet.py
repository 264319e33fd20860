"""Train a small LongNet language model on a synthetic long-range retrieval task.

    python examples/train_longnet.py                                    # CPU (time: README, "Measured times")
    python examples/train_longnet.py --device cuda --dtype bfloat16 --seq-len 65536 --batch-size 8 \\
        --embed-dim 256 --heads 16 --segment-lengths 2048,65536 --dilation-rates 1,4 --checkpointing \\
        --curriculum-start 1024 --steps 700

The task (needle in a haystack): every sequence is ``--seq-len`` filler tokens (``--filler`` symbols, default
a single "blank"). One needle token, one of ``--symbols`` values, sits at a random position in the first quarter;
the last ``--answer-len`` tokens are ``QUERY`` and the model must output the needle there, i.e. retrieve a token
``0.75 * seq_len`` or more positions back. With dilation rate ``r`` in the long branch a query sees only every
``r``-th key of it, so for most needle positions the answer has to travel through two layers (long branch, then
the local branch). Only the answer positions are trained: the loss starts near ``ln(symbols)`` (a guess) and
falls towards 0 once the model retrieves; the script prints it every few steps and, at the end, the accuracy on the
answer positions of fresh sequences (chance: ``1 / symbols``). How long the CPU defaults take: the README's
"Measured times".

On a GPU run with ``--dtype bfloat16`` (autocast: the Triton kernels run in bf16, parameters stay float32) and
``--checkpointing`` (recompute each block in the backward) for long sequences.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longattn.models import LongNet, LongNetConfig  # noqa: E402

IGNORE = -100


def int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def make_batch(batch_size: int, seq_len: int, symbols: int, generator: torch.Generator, device: torch.device,
               filler: int = 1, answer_len: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch of the retrieval task: ``tokens`` and ``targets``, int64 ``(batch_size, seq_len)`` each.

    Tokens ``0 .. filler-1`` are filler, ``filler .. filler+symbols-1`` the needle values and ``filler + symbols``
    is ``QUERY``. One needle sits at a random position in the first quarter; the last ``answer_len`` tokens are
    ``QUERY`` and their targets are the needle token; all other targets are ``IGNORE`` (-100). The vocabulary
    size is ``filler + symbols + 1``.
    """
    answer_len = max(1, min(answer_len, seq_len // 2))
    tokens = torch.randint(0, filler, (batch_size, seq_len), generator=generator)
    pos = torch.randint(0, max(1, seq_len // 4), (batch_size,), generator=generator)
    values = torch.randint(0, symbols, (batch_size,), generator=generator)
    tokens[torch.arange(batch_size), pos] = filler + values
    tokens[:, -answer_len:] = filler + symbols
    targets = torch.full_like(tokens, IGNORE)
    targets[:, -answer_len:] = filler + values[:, None]
    return tokens.to(device), targets.to(device)


def batch(args: argparse.Namespace, gen: torch.Generator, device: torch.device,
          seq_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    return make_batch(args.batch_size, seq_len or args.seq_len, args.symbols, gen, device, args.filler,
                      args.answer_len)


def length_schedule(seq_len: int, steps: int, start: Optional[int]) -> List[int]:
    """The sequence length of every step: ``seq_len`` throughout, or with a curriculum from ``start``, doubling
    in equal stages up to ``seq_len`` (the last stage, at ``seq_len``, also takes the remainder)."""
    if not start or start >= seq_len:
        return [seq_len] * steps
    lengths = []
    n = start
    while n < seq_len:
        lengths.append(n)
        n *= 2
    lengths.append(seq_len)
    per = steps // len(lengths)
    return [n for n in lengths[:-1] for _ in range(per)] + [seq_len] * (steps - per * (len(lengths) - 1))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--symbols", type=int, default=8, help="needle values to retrieve (chance accuracy 1/symbols)")
    p.add_argument("--filler", type=int, default=1,
                   help="filler (haystack) symbols; more makes the search harder and slower to learn")
    p.add_argument("--answer-len", type=int, default=8, help="QUERY positions at the end, each asks for the needle")
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query); default --heads")
    p.add_argument("--segment-lengths", type=int_list, default=[64, 256])
    p.add_argument("--dilation-rates", type=int_list, default=[1, 2])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="autocast dtype of the activations (parameters stay float32)")
    p.add_argument("--no-rotary", action="store_true", help="no rotary position embedding (no position information)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every block")
    p.add_argument("--curriculum-start", type=int, default=None,
                   help="train first at this length, doubling in equal stages up to --seq-len (a long-context "
                        "retrieval learns from scratch slowly: at init a query's attention to the needle is ~1/N)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Train, print progress, and return ``{"first_loss", "final_loss", "accuracy"}``."""
    args = parse_args(argv)
    if args.seq_len < 4:
        raise SystemExit("--seq-len must be at least 4")
    if args.steps < 0:
        raise SystemExit("--steps must be >= 0 (0: evaluate the untrained model)")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    config = LongNetConfig(
        vocab_size=args.filler + args.symbols + 1, embed_dim=args.embed_dim, num_heads=args.heads,
        num_layers=args.layers,
        segment_lengths=args.segment_lengths, dilation_rates=args.dilation_rates, num_kv_heads=args.kv_heads,
        gradient_checkpointing=args.checkpointing, rotary=not args.no_rotary,
    )
    model = LongNet(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)  # linear warm-up, then cosine decay to 10%
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / max(1, args.steps))))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LongNet: {n_params} parameters, seq_len {args.seq_len}, segments {config.segment_lengths}, "
          f"rates {config.dilation_rates}, {device} {args.dtype}; chance loss ln({args.symbols}) = "
          f"{math.log(args.symbols):.3f}", flush=True)

    t0, first, recent = time.perf_counter(), None, []
    schedule = length_schedule(args.seq_len, args.steps, args.curriculum_start)
    model.train()
    for step in range(args.steps):
        if step and schedule[step] != schedule[step - 1]:
            recent = []  # the running mean restarts with each new length
        tokens, targets = batch(args, gen, device, schedule[step])
        with autocast:
            loss = model.loss(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        first = value if first is None else first
        recent = (recent + [value])[-args.log_every:]
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  len {schedule[step]:7d}  loss {value:.4f}  (mean of last {len(recent)}: "
                  f"{sum(recent) / len(recent):.4f})"
                  f"  {time.perf_counter() - t0:.1f}s", flush=True)

    model.eval()
    correct = total = 0
    with torch.no_grad(), autocast:
        for _ in range(args.eval_batches):
            tokens, targets = batch(args, gen, device)
            keep = targets != IGNORE
            correct += int((model(tokens)[keep].argmax(-1) == targets[keep]).sum())
            total += int(keep.sum())
    accuracy = correct / total
    print(f"accuracy on {total} answer positions of fresh sequences: {accuracy:.3f} (chance "
          f"{1 / args.symbols:.3f})", flush=True)
    final = sum(recent) / len(recent) if recent else None  # None with --steps 0: nothing was trained
    return {"first_loss": first, "final_loss": final, "accuracy": accuracy}


if __name__ == "__main__":
    main()
