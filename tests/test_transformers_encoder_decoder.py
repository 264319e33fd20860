"""The transformers plug-in on models beyond decoder-only ones (tiny configs, float32, CPU): an encoder-decoder's
cross-attention (every encoder key, the encoder's padding, generation; modules that do not say they are a decoder's),
bidirectional sliding windows (T5Gemma's encoder, ModernBERT, a decoder with ``is_causal=False``), score biases the
plug-in cannot honour (T5's ``position_bias``) and a custom mask overlay inside a packed batch's mask: equal to
``sdpa``, or refused."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

from longattn.integrations.transformers import register  # noqa: E402

register()


def _twins(model_class, config, reference="sdpa"):
    """The same weights under ``reference`` and ``longattn`` (eval mode; separate configs: transformers keeps the
    implementation in the config)."""
    torch.manual_seed(0)
    ref = model_class(config).eval()
    ours = model_class(copy.deepcopy(config)).eval()
    ours.load_state_dict(ref.state_dict())
    ref.set_attn_implementation(reference)
    ours.set_attn_implementation("longattn")
    return ref, ours


def _bart():
    return _twins(BartForConditionalGeneration, BartConfig(
        vocab_size=61, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, init_std=0.5, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2))


@pytest.mark.parametrize("source, target", [(13, 5), (4, 9), (7, 7)])
@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention_sees_every_encoder_key(source, target, padded):
    """The decoder's cross-attention attended to the first ``target`` encoder keys only (the key mask was cut at the
    queries' length, as for a causal cache), and a padded source shorter than the decoder crashed."""
    ref, ours = _bart()
    g = torch.Generator().manual_seed(1)
    src, dec = torch.randint(3, 61, (2, source), generator=g), torch.randint(3, 61, (2, target), generator=g)
    mask = torch.ones(2, source, dtype=torch.long)
    if padded:
        mask[1, source // 2:] = 0
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits
        got = ours(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_encoder_decoder_generation_matches_sdpa():
    ref, ours = _bart()
    src = torch.randint(3, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src)
    mask[0, 9:] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        assert ours.generate(src, **kw).tolist() == ref.generate(src, **kw).tolist()


def test_t5_position_bias_is_refused_not_dropped():
    """T5 hands its relative position bias to the attention function as ``position_bias``: it was ignored."""
    from transformers import T5Config, T5EncoderModel

    _, ours = _twins(T5EncoderModel, T5Config(vocab_size=61, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
                                              relative_attention_num_buckets=8))
    with torch.no_grad(), pytest.raises(ValueError, match=r"cannot honour the model's position_bias"):
        ours(torch.randint(1, 61, (2, 9)))


@pytest.mark.parametrize("packed", [False, True])
def test_block_overlay_is_refused_in_a_packed_batch_too(packed):
    """A packed batch wraps the model's mask function in an ``and_mask``; the bidirectional blocks inside it (an
    ``or_mask``) were not seen and the call ran plain causal attention per document."""
    cfg = LlamaConfig(vocab_size=61, hidden_size=48, num_attention_heads=4, num_hidden_layers=1)
    cfg._attn_implementation = "longattn"
    blocks = torch.tensor([[0, 0, 0, -1, -1, 1, 1, -1]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]) if packed else None
    with pytest.raises(ValueError, match="cannot honour this model's custom attention mask"):
        create_causal_mask(cfg, torch.zeros(1, 8, 48), None, None, position_ids=positions,
                           block_sequence_ids=blocks)


def test_deepseek_sparse_attention_is_refused_clearly():
    """DeepSeek-V3.2's indexer reads a 4-D mask, which crashed inside the model (TypeError, IndexError)."""
    config_class = getattr(transformers, "DeepseekV32Config", None)
    if config_class is None:
        pytest.skip("this transformers has no DeepSeek-V3.2")
    cfg = config_class(vocab_size=61, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                       kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                       num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, index_topk=4,
                       index_n_heads=2, index_head_dim=16, pad_token_id=0)
    model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    model.set_attn_implementation("longattn")
    with torch.no_grad(), pytest.raises(ValueError, match="do not run DeepSeek sparse attention"):
        model(torch.randint(1, 61, (2, 9)))


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_cross_attention_of_a_module_without_is_decoder(model):
    """BERT's and GPT-2's cross-attention modules carry no ``is_decoder``: with as many decoder tokens as encoder
    tokens the call looked like an encoder's self-attention, and the decoder rows at the encoder's padding came out
    0 (unpadded by the encoder's mask), silently."""
    from transformers import BertConfig, BertLMHeadModel, GPT2Config, GPT2LMHeadModel

    if model == "bert":
        ref, ours = _twins(BertLMHeadModel, BertConfig(vocab_size=61, hidden_size=32, num_hidden_layers=1,
                                                       num_attention_heads=4, intermediate_size=32, is_decoder=True,
                                                       add_cross_attention=True))
    else:
        ref, ours = _twins(GPT2LMHeadModel, GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=4,
                                                       add_cross_attention=True, pad_token_id=0))
    g = torch.Generator().manual_seed(1)
    x, encoded = torch.randint(1, 61, (2, 9), generator=g), torch.randn(2, 9, 32, generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 5:], mask[1, :2] = 0, 0
    with torch.no_grad():
        want = ref(x, encoder_hidden_states=encoded, encoder_attention_mask=mask).logits
        got = ours(x, encoder_hidden_states=encoded, encoder_attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _bidirectional_window_models():
    from transformers import (MistralConfig, MistralModel, ModernBertConfig, ModernBertModel, T5GemmaConfig,
                              T5GemmaEncoderModel, T5GemmaModuleConfig)

    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=32, num_attention_heads=4, pad_token_id=0)
    module = dict(sizes, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, sliding_window=3,
                  layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)
    t5gemma = T5GemmaConfig(encoder=T5GemmaModuleConfig(**module), decoder=T5GemmaModuleConfig(**module),
                            vocab_size=61, pad_token_id=0, is_encoder_decoder=False)
    return {
        # sliding_window=3 in the config and the layers: eager's |q - k| <= 3, one more than FlashAttention's
        "t5gemma": lambda: _twins(T5GemmaEncoderModel, t5gemma, reference="eager"),  # no sdpa for T5Gemma
        "mistral": lambda: _twins(MistralModel, MistralConfig(**sizes, num_hidden_layers=1, num_key_value_heads=2,
                                                              sliding_window=3, is_causal=False)),
        # ModernBERT passes config.sliding_window + 1 to its layers (FlashAttention's convention): unchanged
        "modernbert": lambda: _twins(ModernBertModel, ModernBertConfig(**sizes, num_hidden_layers=1, local_attention=4,
                                                                       global_attn_every_n_layers=3)),
    }


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("model", ["t5gemma", "mistral", "modernbert"])
def test_bidirectional_sliding_window_is_the_masks(model, padded):
    """transformers' bidirectional sliding-window mask lets a query see the keys within ``config.sliding_window``
    positions on either side; the layers' ``sliding_window`` argument was taken for FlashAttention's ``(w - 1, w -
    1)``, one key short on each side wherever the model does not add 1 to it (T5Gemma's encoder, a decoder run with
    ``is_causal=False``): different outputs, no error."""
    ref, ours = _bidirectional_window_models()[model]()
    x = torch.randint(1, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    if padded:
        mask[0, 8:], mask[1, :3] = 0, 0
    real = mask.bool()
    with torch.no_grad():
        want = ref(x, attention_mask=mask).last_hidden_state
        got = ours(x, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=2e-5)


def test_bidirectional_sliding_window_mask_compiles():
    """torch.compile (graph breaks allowed) of a model with a bidirectional sliding-window mask: asking the mask
    function which keys it shows crashed inside Dynamo (AssertionError in load_cell); compiled here, the mask
    function alone, and the whole model in eager mode."""
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    ref, ours = _bidirectional_window_models()["mistral"]()
    torch._dynamo.reset()
    make = torch.compile(create_bidirectional_sliding_window_mask, backend="eager")
    mask = make(config=ours.config, inputs_embeds=torch.zeros(2, 11, 32), attention_mask=None)
    x = torch.randint(1, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.layers[0].self_attn(ours.embed_tokens(x), position_embeddings=ours.rotary_emb(
            torch.zeros(1), torch.arange(11)[None]), attention_mask=mask)[0]
        want = ref.layers[0].self_attn(ref.embed_tokens(x), position_embeddings=ref.rotary_emb(
            torch.zeros(1), torch.arange(11)[None]), attention_mask=create_bidirectional_sliding_window_mask(
                config=ref.config, inputs_embeds=torch.zeros(2, 11, 32), attention_mask=None))[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_causality_is_the_masks_not_the_layers_attribute(padded):
    """BigBird-Pegasus's decoder layers say ``is_causal=False`` (and ``is_decoder=True``) under the causal mask
    the model builds, which eager applies: the plug-in trusted the attribute and attended to later tokens,
    silently (eager is the model's only other implementation)."""
    from transformers import BigBirdPegasusConfig, BigBirdPegasusForCausalLM

    ref, ours = _twins(BigBirdPegasusForCausalLM, BigBirdPegasusConfig(
        vocab_size=61, d_model=32, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=32, init_std=0.5,
        max_position_embeddings=64, pad_token_id=0), reference="eager")
    x = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    if padded:
        mask[1, :4] = 0
    with torch.no_grad():
        want, got = ref(x, attention_mask=mask).logits, ours(x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=2e-5)
