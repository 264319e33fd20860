"""Train a small LongNet language model with the sequence split over P ranks (sequence parallelism).

    torchrun --nproc-per-node 2 examples/train_longnet_ring.py --device cpu                 # gloo, CPU
    torchrun --nproc-per-node 4 examples/train_longnet_ring.py \
        --seq-len 1048576 --segments 2048,16384,1048576                                  # NCCL, GPUs

Every rank holds the same model and a contiguous shard of every sequence; the dilated attention layers
(:class:`longattn.distributed.RingMultiheadDilatedAttention`) exchange what they need across ranks. The loss of a
shard is its share of the mean over the whole sequence, so the parameter gradients are summed over the ranks
(one all-reduce per step) before the optimizer step, and every rank's model stays identical.

The task is synthetic: a random block of ``--period`` tokens repeated to the sequence length, so the next token is
predictable only from ``period`` positions back (copying); the loss falls from ``ln(vocab)`` towards
``(period / seq_len) * ln(vocab)`` (the first block cannot be predicted). The default last segment spans all ranks
when P >= 2, so the distributed (all-gather) path of the dilated attention is exercised.
A process-group timeout makes a dead or stuck rank end the job with an error instead of hanging.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longattn.distributed import RingMultiheadDilatedAttention, shard  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, segments, rates, group):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = RingMultiheadDilatedAttention(dim, heads, segments, rates, num_kv_heads=kv_heads, causal=True,
                                                  group=group)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLongNet(nn.Module):
    """Decoder-only LongNet: token + absolute position embeddings, pre-LN blocks of dilated attention."""

    def __init__(self, vocab, dim, depth, heads, kv_heads, segments, rates, max_len, group=None):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, segments, rates, group) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions):
        """tokens, positions: ``(B, n)`` this rank's shard and the global positions of its rows."""
        x = self.tok(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, over all ranks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8)
    p.add_argument("--period", type=int, default=8, help="the repeated block length (the copy distance)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--segments", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 128])
    p.add_argument("--rates", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout: a dead rank ends the job")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_batch(step, args, device):
    """The same full batch on every rank: inputs and next-token targets, ``(B, seq_len)`` each."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    block = torch.randint(0, args.vocab, (args.batch, args.period), generator=g)
    reps = math.ceil((args.seq_len + 1) / args.period)
    seq = block.repeat(1, reps)[:, : args.seq_len + 1]
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def main():
    args = parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.seq_len % world:
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by the number of ranks {world}")

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = TinyLongNet(args.vocab, args.dim, args.depth, args.heads, args.kv_heads, args.segments, args.rates,
                        args.seq_len).to(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    positions = shard(torch.arange(args.seq_len, device=device)[None].expand(args.batch, -1), layout="contiguous")
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{world} ranks x {args.seq_len // world} tokens, {n_params} parameters, ln(vocab) = "
              f"{math.log(args.vocab):.3f}", flush=True)
    t0 = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = make_batch(step, args, device)
        inputs, targets = shard(inputs, layout="contiguous"), shard(targets, layout="contiguous")
        with torch.autocast(device.type, dtype=dtype, enabled=cuda):
            logits = model(inputs, positions)
        # this shard's share of the mean loss over the whole batch
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / (args.batch * args.seq_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():  # every parameter on every rank (zeros where this rank has no gradient)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {total.item():.4f}  {time.perf_counter() - t0:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
