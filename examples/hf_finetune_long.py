"""Fine-tune a small Hugging Face model with LongNet dilated attention on a long synthetic task, then generate.

    python examples/hf_finetune_long.py                                   # CPU (time: README, "Measured times")
    python examples/hf_finetune_long.py --device cuda --dtype bfloat16 --seq-len 8192 --period 257 \
        --segment-lengths 256,1024,4096 --dilation-rates 1,4,16 --new 256

A Llama-style model is built from a config (no download) and switched to ``attn_implementation="longattn_dilated"``
after ``longattn.integrations.transformers.register()``; the segment lengths and dilation rates come from
``config.longattn_dilated``. The task: every sequence repeats a random block of ``--period`` tokens, so continuing
it means attending to the key ``period - 1`` positions back, at least the first (dense) segment's length: only
the dilated branches reach it (the distance is a multiple of their rates). The script prints the loss as it falls,
then greedy-generates continuations of fresh prompts through transformers' ``generate`` (the dilated decode path
reads only the cached keys the branches select) and reports how many generated tokens are right (chance is
1 / vocab). What the CPU default and the GPU command above reach, and how long they take: the README's "Measured
times".
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from longattn.integrations.transformers import register


def periodic(n: int, length: int, period: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    block = torch.randint(0, vocab, (n, period), generator=gen)
    return block.repeat(1, -(-length // period))[:, :length]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--period", type=int, default=33)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--segment-lengths", default="32,128,512")
    p.add_argument("--dilation-rates", default="1,2,8")
    p.add_argument("--new", type=int, default=64)
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)

    register()
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * a.seq_len,
                         longattn_dilated={"segment_lengths": [int(x) for x in a.segment_lengths.split(",")],
                                           "dilation_rates": [int(x) for x in a.dilation_rates.split(",")]})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.set_attn_implementation("longattn_dilated")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, attn_implementation="
          f"{model.config._attn_implementation!r}, {config.longattn_dilated}")
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        x = periodic(a.batch_size, a.seq_len, a.period, a.vocab, gen).to(device)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1 or step % max(1, a.steps // 10) == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    model.eval()
    prompt_len = a.seq_len - a.new
    truth = periodic(4, a.seq_len, a.period, a.vocab, gen).to(device)
    with torch.no_grad():
        out = model.generate(truth[:, :prompt_len], attention_mask=torch.ones_like(truth[:, :prompt_len]),
                             max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
    right = (out[:, prompt_len:] == truth[:, prompt_len:]).float().mean().item()
    print(f"generated {a.new} tokens after {prompt_len}-token prompts: {right:.2f} right (chance {1 / a.vocab:.2f})")


if __name__ == "__main__":
    main()
