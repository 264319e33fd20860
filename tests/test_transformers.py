"""longattn as transformers attention implementations (``longattn.integrations.transformers``), on tiny models
built from configs (no downloads), float32 on the CPU: against ``attn_implementation="sdpa"``, against the same
sequences run one by one, and against the reference functions applied by hand."""
import inspect
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AttentionInterface, DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import longattn  # noqa: E402
from longattn import reference  # noqa: E402
from longattn.integrations.transformers import IMPLEMENTATIONS, register  # noqa: E402
from longattn.patterns import GlobalTokens, Local  # noqa: E402

register()
# transformers 5.24 renamed the models' ``past_key_values`` argument ``cache`` and warns that the old name goes in 5.40
pytestmark = pytest.mark.filterwarnings("error:`past_key_values` is deprecated:FutureWarning")
VOCAB = 61
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, pad_token_id=0)
MODELS = {
    "llama": lambda **kw: LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, **kw)),
    "mistral": lambda **kw: MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=7,
                                                             **kw)),
    "qwen2": lambda **kw: Qwen2ForCausalLM(Qwen2Config(**SIZES, num_key_value_heads=1, **kw)),
}


def twins(model: str, impl: str = "longattn", **config):
    """The same weights under ``attn_implementation="sdpa"`` and ``impl`` (float32, eval mode)."""
    torch.manual_seed(0)
    base = MODELS[model](**config).float().eval()
    base.config._attn_implementation = "sdpa"
    other = MODELS[model](**config).float().eval()
    other.load_state_dict(base.state_dict())
    other.set_attn_implementation(impl)
    return base, other


def ids(*shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def cache_kwarg(model, cache) -> dict:
    """``cache`` as the keyword argument ``model.forward`` takes it: ``cache`` where transformers has the new name
    (5.24), ``past_key_values`` where it has only the old one (5.17)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def close(a, b, tol=2e-5):
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_register_is_idempotent():
    register()
    register()
    for name in IMPLEMENTATIONS:
        assert name in AttentionInterface._global_mapping
        assert name in transformers.masking_utils.AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_logits_and_gradients_equal_sdpa(model, backend):
    base, ours = twins(model, longattn_backend=backend)
    x = ids(2, 29)
    outs = []
    for m in (base, ours):
        m.zero_grad()
        logits = m(x).logits
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    close(outs[1][0], outs[0][0])
    for name, grad in outs[0][1].items():
        close(outs[1][1][name], grad, tol=1e-4)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("model,backend", [("llama", "auto"), ("llama", "triton"), ("mistral", "torch"),
                                           ("qwen2", "auto")])
def test_padded_batch_equals_sequences_one_by_one(model, backend, side):
    _, ours = twins(model, longattn_backend=backend)
    lengths = [23, 9, 1, 17]
    width = max(lengths)
    x = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        x[b, cols] = ids(n, seed=b)
        mask[b, cols] = 1
    logits = ours(x, attention_mask=mask).logits
    for b, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        alone = ours(ids(1, n, seed=b)).logits[0]
        close(logits[b, cols], alone)


def test_padded_and_packed_batches_under_inference_mode():
    """Inference tensors have no version counter, so what is remembered per mask, position_ids or cu_seqlens tensor
    is computed afresh for them (it used to raise); the results are those of no_grad."""
    _, ours = twins("llama")
    x, mask = ids(2, 13), torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    position_ids = torch.tensor([list(range(6)) + list(range(7))])
    with torch.no_grad():
        want = ours(x, attention_mask=mask).logits, ours(x[:1], position_ids=position_ids).logits
    with torch.inference_mode():
        got = ours(x, attention_mask=mask).logits, ours(x[:1], position_ids=position_ids).logits
    close(got[0][0], want[0][0])
    close(got[0][1, 4:], want[0][1, 4:])
    close(got[1], want[1])


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model,backend", [("llama", "auto"), ("mistral", "triton"), ("qwen2", "torch")])
def test_packed_batch_equals_sequences_one_by_one(model, backend, flash_kwargs):
    base, ours = twins(model, longattn_backend=backend)
    seqs = [ids(n, seed=n).tolist() for n in (13, 1, 30, 8)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s} for s in seqs])
    batch.pop("labels", None)
    packed = ours(**batch).logits[0]
    start = 0
    for s in seqs:
        alone = base(torch.tensor([s])).logits[0]
        close(packed[start:start + len(s)], alone)
        start += len(s)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("model,backend", [("llama", "auto"), ("llama", "torch"), ("mistral", "auto"),
                                           ("qwen2", "triton")])
def test_greedy_generation_equals_sdpa(model, backend, padded):
    base, ours = twins(model, longattn_backend=backend)
    prompt = ids(2, 11)
    mask = torch.ones_like(prompt)
    if padded:
        prompt[0, :4] = 0
        mask[0, :4] = 0
    new = 32 if backend != "triton" else 12
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    expected = base.generate(prompt, **kw)
    assert torch.equal(ours.generate(prompt, **kw), expected)


def _hand_dilated(segs, rates):
    """An attention function applying :func:`longattn.reference.dilated_attention` by hand (no cache, no mask)."""
    def fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return reference.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, causal=True,
                                           scale=scaling), None
    return fn


DILATED = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4]}


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_dilated_equals_dilated_attention_by_hand(backend):
    AttentionInterface.register("hand_dilated", _hand_dilated(DILATED["segment_lengths"], DILATED["dilation_rates"]))
    hand, ours = twins("qwen2", "longattn_dilated", longattn_dilated=DILATED, longattn_backend=backend)
    hand.set_attn_implementation("hand_dilated")
    x = ids(2, 37)
    close(ours(x).logits, hand(x).logits)
    # differs from full attention: the dilated pattern is really applied
    hand.set_attn_implementation("sdpa")
    assert (ours(x).logits - hand(x).logits).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dilated_padded_packed_and_generation(backend):
    _, ours = twins("llama", "longattn_dilated", longattn_dilated=DILATED, longattn_backend=backend)
    seqs = [ids(n, seed=n) for n in (21, 5, 12)]
    alone = [ours(s[None]).logits[0] for s in seqs]
    width = 21
    x = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, s in enumerate(seqs):
        x[b, width - len(s):], mask[b, width - len(s):] = s, 1
    padded = ours(x, attention_mask=mask).logits
    batch = DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in seqs])
    batch.pop("labels")
    packed = ours(**batch).logits[0]
    start = 0
    for b, s in enumerate(seqs):
        close(padded[b, width - len(s):], alone[b])
        close(packed[start:start + len(s)], alone[b])
        start += len(s)
    # generation through the dilated decode path equals generation that recomputes the whole sequence per token
    kw = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(x, **kw), ours.generate(x, use_cache=False, **kw))


def _hand_block_sparse(pattern, block):
    def fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        mask = pattern.mask(q.shape[1], block_size=block)
        return reference.block_sparse_attention(q, k, v, block_mask=mask, block_size=block, causal=True,
                                                scale=scaling), None
    return fn


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_block_sparse_equals_pattern_by_hand(backend):
    settings = {"block_size": 16, "local_blocks": 1, "global_blocks": 1}
    AttentionInterface.register("hand_block_sparse", _hand_block_sparse(Local(1) | GlobalTokens(1), 16))
    hand, ours = twins("llama", "longattn_block_sparse", longattn_block_sparse=settings, longattn_backend=backend)
    hand.set_attn_implementation("hand_block_sparse")
    x = ids(2, 71)
    close(ours(x).logits, hand(x).logits)
    dense, _ = twins("llama")
    assert (ours(x).logits - dense(x).logits).abs().max() > 1e-3  # the pattern is really applied
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(x, **kw), hand.generate(x, use_cache=False, **kw))


def test_unsupported_requests_raise():
    _, ours = twins("llama")
    x = ids(1, 9)
    with pytest.raises(ValueError, match="output_attentions"):
        ours(x, output_attentions=True)
    with pytest.raises(ValueError, match="4-D|arbitrary"):
        ours(x, attention_mask=torch.zeros(1, 1, 9, 9))
    _, ours = twins("llama", attention_dropout=0.1)
    ours.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        ours(x)
    ours.eval()
    ours(x)  # no dropout in eval mode


def test_a_model_that_edits_its_materialised_mask_is_refused():
    """Doge asks for its causal mask materialised (``allow_is_causal_skip=False``) and adds its dynamic mask onto
    it as a 4-D tensor: under longattn it raised ``IndexError`` inside the model, padded or not. The mask function
    refuses it by name; a padding-free packed batch (whose mask transformers also materialises) still runs."""
    from transformers import DogeConfig, DogeForCausalLM

    torch.manual_seed(0)
    doge = DogeForCausalLM(DogeConfig(**SIZES, num_key_value_heads=2)).eval()
    doge.set_attn_implementation("longattn")
    x, mask = ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    for kw in ({}, {"attention_mask": mask}):
        with torch.no_grad(), pytest.raises(ValueError, match="allow_is_causal_skip=False to edit or read the 4-D"):
            doge(x, **kw)
    base, ours = twins("llama")
    positions = torch.tensor([list(range(4)) + list(range(5))])
    with torch.no_grad():
        close(ours(x[:1], position_ids=positions, use_cache=False).logits,
              base(x[:1], position_ids=positions, use_cache=False).logits)


def test_sliding_window_only_in_the_models_mask():
    """Qwen2-MoE's layers keep their sliding window to themselves (no ``sliding_window=`` to the attention function):
    eager and sdpa apply it through the mask, longattn ran full attention, silently. The window is read from the
    mask function transformers hands the mask interface: plain, padded and packed batches, and generation."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(**SIZES, num_key_value_heads=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2)
    torch.manual_seed(0)
    base = Qwen2MoeForCausalLM(config).eval()
    base.set_attn_implementation("sdpa")
    ours = Qwen2MoeForCausalLM(Qwen2MoeConfig(**config.to_dict())).eval()
    ours.load_state_dict(base.state_dict())
    ours.set_attn_implementation("longattn")
    x, mask = ids(2, 13), torch.ones(2, 13, dtype=torch.long)
    mask[0, :3] = 0
    positions = torch.tensor([list(range(6)) + list(range(7))])
    with torch.no_grad():
        close(ours(x).logits, base(x).logits)
        close(ours(x, attention_mask=mask).logits[mask.bool()], base(x, attention_mask=mask).logits[mask.bool()])
        close(ours(x[:1], position_ids=positions, use_cache=False).logits,
              base(x[:1], position_ids=positions, use_cache=False).logits)
        kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(x, **kw), base.generate(x, **kw))


def test_attention_mask_shorter_than_the_tokens_raises():
    """A 2-D attention_mask without a column for every token (the new tokens' only, in a call continuing a cache; a
    prompt's mask cut short) ran: its missing columns were taken as padding, hiding keys. eager and sdpa run such a
    mask too, each reading it its own way; longattn refuses it, naming what it needs."""
    from transformers import DynamicCache

    _, ours = twins("llama")
    x = ids(2, 9)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"attention_mask has 5 columns, but the model attends over 9 tokens"):
            ours(x, attention_mask=torch.ones(2, 5, dtype=torch.long))
        cache = DynamicCache(config=ours.config)
        ours(x, **cache_kwarg(ours, cache), use_cache=True)
        with pytest.raises(ValueError, match=r"3 columns, but the model attends over 12 tokens \(9 cached and 3 new"):
            ours(ids(2, 3), attention_mask=torch.ones(2, 3, dtype=torch.long), **cache_kwarg(ours, cache),
                 use_cache=True)


@pytest.mark.parametrize("model,key", [("bert", "attention_probs_dropout_prob"), ("gpt2", "attn_pdrop")])
def test_attention_dropout_error_names_the_models_setting(model, key):
    """The refusal of attention dropout in training named config.attention_dropout whatever the model: BERT's and
    GPT-2's are other keys, and setting the named one changed nothing."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    torch.manual_seed(0)
    if model == "bert":
        m = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=32))
    else:
        m = GPT2Model(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))
    m.set_attn_implementation("longattn")
    m.train()
    with pytest.raises(ValueError, match=rf"no attention dropout: the model runs with config\.{key}=0\.1 in training"):
        m(ids(1, 5))


@pytest.mark.parametrize("impl,config,match", [
    ("longattn_dilated", {"longattn_dilated": {"segment_lengths": [4, 8], "dilation_rates": [1]}}, "same length"),
    ("longattn_dilated", {"longattn_dilated": {"segment_lengths": [0], "dilation_rates": [1]}}, ">= 1"),
    ("longattn_dilated", {"longattn_dilated": {"segments": [4]}}, "unknown keys"),
    ("longattn_dilated", {"longattn_dilated": [4, 8]}, "must be a dict"),
    ("longattn_block_sparse", {"longattn_block_sparse": {"local_blocks": -1}}, ">= 0"),
    ("longattn_block_sparse", {"longattn_block_sparse": {"pattern": "local"}}, "Pattern"),
    ("longattn", {"longattn_backend": "cuda"}, "backend"),
])
def test_bad_configurations_raise(impl, config, match):
    _, ours = twins("llama", impl, **config)
    with pytest.raises((ValueError, TypeError), match=match):
        ours(ids(1, 9))


def test_paths_that_cannot_honour_the_model_raise():
    # A head dim past the library's 256: named by the attention implementation, sdpa suggested (the error came
    # from an internal function's check before).
    _, ours = twins("llama", head_dim=264)
    with pytest.raises(ValueError, match="attn_implementation='longattn' takes head dims from 1 to 256, this "
                                         "model's is 264; use attn_implementation='sdpa'"):
        ours(ids(1, 5))
    _, ours = twins("mistral", "longattn_dilated")
    with pytest.raises(ValueError, match="sliding_window"):
        ours(ids(1, 9))
    _, ours = twins("llama", "longattn_block_sparse", longattn_block_sparse={"block_size": 4})
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="padded or packed"):
        ours(ids(2, 9), attention_mask=mask)
    # Padding inside a sequence under a sliding window: unpadding would close the gap the window counts.
    sdpa, ours = twins("mistral")
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 4:6] = 0
    with pytest.raises(ValueError, match="padding inside a sequence"):
        ours(ids(2, 12), attention_mask=mask)
    # Right-padded generation puts the new tokens after the padding: the advice is to pad on the left.
    right = torch.ones(2, 12, dtype=torch.long)
    right[0, 9:] = 0
    with torch.no_grad(), pytest.raises(ValueError, match=r"on the left for generate\(\)"):
        ours.generate(ids(2, 12), attention_mask=right, max_new_tokens=2, use_cache=False, pad_token_id=0)
    # A window spanning every key (Mistral's 4096 on a short prompt, right-padded generation) cuts nothing: exact.
    sdpa_wide, ours_wide = twins("mistral")
    sdpa_wide.config.sliding_window = ours_wide.config.sliding_window = 32
    mask[1, 7:9] = 0
    real = mask.bool()
    close(ours_wide(ids(2, 12), attention_mask=mask).logits[real],
          sdpa_wide(ids(2, 12), attention_mask=mask).logits[real])
    with torch.no_grad():
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(ours_wide.generate(ids(2, 12), **kw), sdpa_wide.generate(ids(2, 12), **kw))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding under the window: exact
    real = mask.bool()
    close(ours(ids(2, 12), attention_mask=mask).logits[real], sdpa(ids(2, 12), attention_mask=mask).logits[real])


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("impl", ["longattn", "longattn_dilated"])
def test_cached_steps_of_several_tokens_equal_one_forward(impl, backend):
    """Prefill, then steps of 3, 1 and 5 new tokens against transformers' dynamic cache (the decode functions,
    bottom-right causal), equal one forward pass over the whole sequence."""
    from transformers import DynamicCache

    _, ours = twins("mistral" if impl == "longattn" else "llama", impl, longattn_dilated=DILATED,
                    longattn_backend=backend)
    x = ids(2, 29)
    with torch.no_grad():
        full = ours(x).logits
        cache = DynamicCache(config=ours.config)
        start = 0
        for stop in (20, 23, 24, 29):
            step = ours(x[:, start:stop], **cache_kwarg(ours, cache), use_cache=True).logits
            close(step, full[:, start:stop])
            start = stop


@pytest.mark.parametrize("impl", ["longattn", "longattn_dilated"])
def test_cached_chunks_reaching_into_left_padding_equal_one_forward(impl):
    """A chunked prefill (generate's prefill_chunk_size) of a left-padded batch: a chunk holds a different number of
    real tokens in each row (none in some). longattn_dilated refused it, telling to pad on the left."""
    from transformers import DynamicCache

    _, ours = twins("llama", impl, longattn_dilated=DILATED)
    x, mask = ids(2, 23), torch.ones(2, 23, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        full = ours(x, attention_mask=mask).logits
        cache = DynamicCache(config=ours.config)
        for start in range(0, 23, 5):
            stop = min(start + 5, 23)
            step = ours(x[:, start:stop], attention_mask=mask[:, :stop], **cache_kwarg(ours, cache), use_cache=True)
            real = mask[:, start:stop].bool()
            close(step.logits[real], full[:, start:stop][real])


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_static_cache_generation_equals_sdpa(model, backend):
    """A static cache hands every layer the whole preallocated cache: its unused tail must not be attended."""
    base, ours = twins(model, longattn_backend=backend)
    prompt = ids(2, 11)
    mask = torch.ones_like(prompt)
    prompt[0, :4], mask[0, :4] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    assert torch.equal(ours.generate(prompt, **kw), base.generate(prompt, **kw))


def test_block_sparse_pattern_cache_tells_patterns_of_one_repr_apart():
    """The built patterns were cached by repr: a subclass that draws differently under its parent's repr got the
    parent's mask. Patterns are told apart; one pattern object is still built once per length."""
    from longattn.integrations.transformers.attention import _pattern
    from longattn.patterns import Causal

    class Wide(Local):  # repr "Local(1)", a different mask
        def _draw(self, grid):
            return super()._draw(grid) | Causal()._draw(grid)

    local, wide = Local(1), Wide(1)
    cpu = torch.device("cpu")
    built = _pattern(local, (16, 16), 64, cpu)
    assert _pattern(local, (16, 16), 64, cpu) is built
    assert torch.equal(_pattern(wide, (16, 16), 64, cpu).mask, wide.mask(64, block_size=16))
    assert not torch.equal(wide.mask(64, block_size=16), built.mask)


def test_compiled_model_compiles_the_attention_once_for_all_its_layers():
    """``config.setting`` read the model's config through ``object.__getattribute__``, where Dynamo breaks the
    graph; the attention function's frame resumed after that break guarded on ``module.layer_idx``, so under
    ``torch.compile`` it compiled again for every layer, and from Dynamo's recompile limit (8) on, a warning and
    eager frames: every model of more than 8 layers. The config is now read with ``getattr`` while compiling."""
    from longattn.integrations.transformers.config import setting

    config = LlamaConfig(**SIZES)
    assert torch.compile(lambda x: x * setting(config, "hidden_size", 1), fullgraph=True)(torch.ones(1)).item() == 64
    torch.manual_seed(0)
    layers = torch._dynamo.config.recompile_limit + 1  # (a lower limit stops transformers' own wrappers first)
    model = LlamaForCausalLM(LlamaConfig(**{**SIZES, "num_hidden_layers": layers}, num_key_value_heads=2)).eval()
    model.set_attn_implementation("longattn")
    tokens, mask = ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("torch._dynamo.convert_frame")
    log.addHandler(handler)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = torch.compile(model, backend="eager")(tokens, attention_mask=mask, use_cache=False).logits
    finally:
        log.removeHandler(handler)
    assert not [m for m in messages if "recompile_limit" in m and "longattn" in m], messages
    with torch.no_grad():
        want = model(tokens, attention_mask=mask, use_cache=False).logits
    close(got * mask[..., None], want * mask[..., None])
