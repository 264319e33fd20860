"""``generate()`` under ``attn_implementation="longattn"`` against ``"eager"``, token for token and logit for logit,
on tiny models built from configs (float32, CPU): Mistral's sliding window and Gemma 3's alternating sliding and full
layers, with prompts longer than the window, left padding, beam search (the cache reordered between steps), sampling,
assisted decoding, a static cache, a cache continued across calls, no cache, and a training loss on a padded batch."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig,  # noqa: E402
                          MistralForCausalLM)

from longattn.integrations.transformers import register  # noqa: E402

register()
VOCAB = 61
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, sliding_window=5, max_position_embeddings=128, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
MODELS = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SIZES)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SIZES, query_pre_attn_scalar=8,
                                                         layer_types=["sliding_attention", "full_attention"])),
}


def twins(model: str):
    """The same weights under ``"eager"`` and ``"longattn"`` (eval mode), scaled up so that the next-token
    distributions are sharp (a wrong attention changes the tokens, not only the logits' last digits)."""
    torch.manual_seed(0)
    eager = MODELS[model]().eval()
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    ours = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("longattn")
    return eager, ours


def left_padded(*lengths: int, seed: int = 1) -> dict:
    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    x, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        x[b, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[b, width - n:] = 1
    return dict(input_ids=x, attention_mask=mask)


def assert_same_generation(eager, ours, inputs: dict, **kw):
    """Equal sequences and per-step logits (the same seed before each call, for sampling)."""
    runs = []
    for m in (eager, ours):
        torch.manual_seed(7)
        with torch.no_grad():
            runs.append(m.generate(**inputs, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kw))
    assert torch.equal(runs[1].sequences, runs[0].sequences)
    assert len(runs[1].logits) == len(runs[0].logits)
    for got, want in zip(runs[1].logits, runs[0].logits):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    return runs


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mode", ["beam", "sample", "static", "no_cache"])
def test_generation_equals_eager(model, mode):
    """A left-padded batch whose longer prompt is longer than the window."""
    eager, ours = twins(model)
    kw = {"beam": dict(num_beams=3), "sample": dict(do_sample=True, top_k=0),
          "static": dict(cache_implementation="static"), "no_cache": dict(use_cache=False)}[mode]
    new = 4 if mode == "no_cache" else 6
    assert_same_generation(eager, ours, left_padded(9, 4), max_new_tokens=new, min_new_tokens=new, **kw)


def test_prompt_of_one_token_and_assisted_decoding_equal_eager():
    eager, ours = twins("gemma3")
    one = dict(input_ids=torch.tensor([[5], [9]]))
    assert_same_generation(eager, ours, one, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    prompt = dict(input_ids=torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3)))
    assert_same_generation(eager, ours, prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           assistant_model=twins("gemma3")[1])


def test_cache_continued_across_calls_equals_eager():
    """A conversation continued: the second generate() gets the whole text and the first call's cache."""
    eager, ours = twins("mistral")
    inputs = left_padded(9, 5)
    first = assert_same_generation(eager, ours, inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    turn = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))
    # transformers 5.24 renamed the argument ``cache`` (5.17 has only ``past_key_values``)
    name = "cache" if "cache" in inspect.signature(ours.forward).parameters else "past_key_values"
    runs = []
    for m, run in zip((eager, ours), first):
        text = torch.cat([run.sequences, turn], 1)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, text.shape[1] - 9, dtype=torch.long)], 1)
        with torch.no_grad():
            runs.append(m.generate(text, attention_mask=mask, **{name: run.past_key_values}, max_new_tokens=5,
                                   min_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                                   output_logits=True))
    assert torch.equal(runs[1].sequences, runs[0].sequences)
    for got, want in zip(runs[1].logits, runs[0].logits):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_training_loss_of_a_right_padded_batch_equals_eager():
    """Padding labelled -100; on the right, no real label is predicted from a padded position (on the left the first
    real token is, from a padded row: eager attends from it to every key uniformly, longattn and sdpa give 0)."""
    eager, ours = twins("gemma3")
    inputs = left_padded(11, 6)
    x, mask = inputs["input_ids"].flip(1), inputs["attention_mask"].flip(1)
    labels = x.masked_fill(mask == 0, -100)
    losses = [m(x, attention_mask=mask, labels=labels).loss for m in (eager, ours)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    grads = []
    for m, loss in zip((eager, ours), losses):
        m.zero_grad()
        loss.backward()
        grads.append(m.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
