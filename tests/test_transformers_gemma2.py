"""Gemma 2 (logit soft-capping, alternating sliding-window and full layers) under ``attn_implementation="longattn"``,
tiny models built from a config, float32 on the CPU: logits and gradients against ``"eager"`` (transformers' own
soft-capping), padded and packed batches against sequences one by one, and greedy generation."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening, Gemma2Config, Gemma2ForCausalLM  # noqa: E402

from longattn.integrations.transformers import register  # noqa: E402

register()
VOCAB = 61


def twins(backend="auto"):
    """The same weights under ``"eager"`` and ``"longattn"`` (float32, eval mode); a soft cap small enough to bite."""
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=1.5,
                  query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                  max_position_embeddings=256, pad_token_id=0, longattn_backend=backend)
    models = []
    for impl in ("eager", "longattn"):
        torch.manual_seed(0)
        m = Gemma2ForCausalLM(Gemma2Config(**config)).float().eval()
        m.set_attn_implementation(impl)
        models.append(m)
    return models


def ids(*shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def close(a, b, tol=2e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_logits_and_gradients_equal_eager(backend):
    eager, ours = twins(backend)
    x = ids(2, 13)
    results = []
    for m in (eager, ours):
        m.zero_grad()
        logits = m(x).logits
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    close(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        close(results[1][1][name], g, tol=1e-4)


def test_padded_and_packed_batches_equal_sequences_one_by_one():
    _, ours = twins()
    lengths = [11, 4, 8]
    x = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        x[b, 11 - n:] = ids(n, seed=b)
        mask[b, 11 - n:] = 1
    logits = ours(x, attention_mask=mask).logits
    for b, n in enumerate(lengths):
        close(logits[b, 11 - n:], ours(ids(1, n, seed=b)).logits[0])
    seqs = [ids(n, seed=b).tolist() for b, n in enumerate(lengths)]
    batch = DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    batch.pop("labels", None)
    packed = ours(**batch).logits[0]
    start = 0
    for s in seqs:
        close(packed[start:start + len(s)], ours(torch.tensor([s])).logits[0])
        start += len(s)


def test_greedy_generation_equals_eager():
    eager, ours = twins()
    prompt = ids(2, 7)
    mask = torch.ones_like(prompt)
    prompt[0, :2] = 0
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kw), eager.generate(prompt, **kw))
