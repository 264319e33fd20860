"""gpt-oss (attention sinks, alternating sliding-window and full layers) under ``attn_implementation="longattn"``,
tiny models built from a config, float32 on the CPU: logits and gradients (the sinks' included) against
``"eager"`` (transformers' own sink implementation), padded and packed batches against sequences one by one, and
greedy generation."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
GptOssConfig = getattr(transformers, "GptOssConfig", None)
if GptOssConfig is None:  # pragma: no cover - older transformers
    pytest.skip("this transformers has no gpt-oss", allow_module_level=True)
from transformers import GptOssForCausalLM  # noqa: E402

from longattn.integrations.transformers import register  # noqa: E402

from _hf_checks import (assert_padded_and_packed_equal_one_by_one, assert_same_greedy_generation,  # noqa: E402
                       assert_same_logits_and_gradients)

register()
VOCAB = 61


def twins(backend="auto"):
    """The same weights under ``"eager"`` and ``"longattn"`` (float32, eval mode), sinks made non-zero."""
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                  pad_token_id=0, longattn_backend=backend)
    models = []
    for impl in ("eager", "longattn"):
        torch.manual_seed(0)
        m = GptOssForCausalLM(GptOssConfig(**config)).float().eval()
        models.append(m)
    with torch.no_grad():
        for layer in models[0].model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    models[1].load_state_dict(models[0].state_dict())
    models[0].set_attn_implementation("eager")
    models[1].set_attn_implementation("longattn")
    return models


def ids(*shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_logits_and_gradients_equal_eager(backend):
    eager, ours = twins(backend)
    grads = assert_same_logits_and_gradients(eager, ours, ids(2, 13))
    assert any("sinks" in n for n in grads)


def test_padded_and_packed_batches_equal_sequences_one_by_one():
    _, ours = twins()
    assert_padded_and_packed_equal_one_by_one(ours, ids)


def test_greedy_generation_equals_eager():
    eager, ours = twins()
    assert_same_greedy_generation(eager, ours, ids)



def test_sinks_are_refused_by_the_other_implementations():
    _, ours = twins()
    ours.set_attn_implementation("longattn_block_sparse")
    with pytest.raises(ValueError, match="sinks"):
        ours(ids(1, 9))
