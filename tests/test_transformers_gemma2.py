"""Gemma 2 (logit soft-capping, alternating sliding-window and full layers) under ``attn_implementation="longattn"``,
tiny models built from a config, float32 on the CPU: logits and gradients against ``"eager"`` (transformers' own
soft-capping), padded and packed batches against sequences one by one, and greedy generation."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: E402

from longattn.integrations.transformers import register  # noqa: E402

from _hf_checks import (assert_padded_and_packed_equal_one_by_one, assert_same_greedy_generation,  # noqa: E402
                       assert_same_logits_and_gradients)

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


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_logits_and_gradients_equal_eager(backend):
    eager, ours = twins(backend)
    assert_same_logits_and_gradients(eager, ours, ids(2, 13))


def test_padded_and_packed_batches_equal_sequences_one_by_one():
    _, ours = twins()
    assert_padded_and_packed_equal_one_by_one(ours, ids)


def test_greedy_generation_equals_eager():
    eager, ours = twins()
    assert_same_greedy_generation(eager, ours, ids)

