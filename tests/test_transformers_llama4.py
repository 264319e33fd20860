"""Llama 4's chunked attention (``config.attention_chunk_size``: on its ``"chunked_attention"`` layers a query sees
the earlier keys of its own chunk; the other layers are full causal) under ``attn_implementation="longattn"``, a tiny
text model built from a config, float32 on the CPU, against ``"eager"`` on the same weights: logits and gradients of
unpadded, right- and left-padded and packed batches, a prefill continued from a cache, and greedy generation (its
logits at every step). Sequences of 40-70 tokens against chunks of 8: several chunks and a partial last one."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
Llama4TextConfig = getattr(transformers, "Llama4TextConfig", None)
if Llama4TextConfig is None:  # pragma: no cover - older transformers
    pytest.skip("this transformers has no Llama 4", allow_module_level=True)
from transformers import DataCollatorWithFlattening, DynamicCache, Llama4ForCausalLM  # noqa: E402

from longattn.integrations.transformers import register  # noqa: E402

from _hf_checks import close  # noqa: E402

register()
VOCAB = 61
CHUNK = 8


def twins(impl="longattn", backend="auto"):
    """The same weights under ``"eager"`` and ``impl`` (float32, eval mode): four layers, chunked and full in turn."""
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_layers=[],
                  no_rope_layer_interval=2, attention_chunk_size=CHUNK, max_position_embeddings=256, pad_token_id=0,
                  longattn_backend=backend)
    models = []
    for name in ("eager", impl):
        torch.manual_seed(0)
        m = Llama4ForCausalLM(Llama4TextConfig(**config)).float().eval()
        m.set_attn_implementation(name)
        models.append(m)
    assert models[0].config.layer_types[:2] == ["chunked_attention", "full_attention"]
    return models


def ids(*shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def assert_same(eager, ours, weight=None, **inputs):
    """The same logits (where ``weight`` is 1) and parameter gradients of the loss on them."""
    results = []
    for m in (eager, ours):
        m.zero_grad()
        logits = m(**inputs).logits
        w = torch.ones(logits.shape[:2]) if weight is None else weight
        (logits.square().mean(-1) * w).mean().backward()
        results.append((logits.detach() * w[..., None], {n: p.grad.clone() for n, p in m.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    close(got, want)
    for name, g in want_grads.items():
        close(got_grads[name], g, tol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_logits_and_gradients_equal_eager(backend):
    eager, ours = twins(backend=backend)
    assert_same(eager, ours, input_ids=ids(2, 45))


def test_chunks_matter():
    """The chunked layers are not full causal attention: the test above would catch treating them as such."""
    eager, _ = twins()
    full, _ = twins()
    full.config.attention_chunk_size = 1000
    x = ids(1, 45)
    assert not torch.allclose(eager(x).logits, full(x).logits, atol=1e-3)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_eager(side):
    """Chunks start at each sequence's first real token (after left padding, as transformers counts them)."""
    eager, ours = twins()
    lengths, width = [61, 37, 50], 61
    x, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        x[b, cols], mask[b, cols] = ids(n, seed=b), 1
    assert_same(eager, ours, weight=mask.float(), input_ids=x, attention_mask=mask)
    logits = ours(x, attention_mask=mask).logits
    for b, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        close(logits[b, cols], ours(ids(1, n, seed=b)).logits[0])


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_packed_batch_equals_eager_and_sequences_one_by_one(flash_kwargs):
    """A padding-free batch (DataCollatorWithFlattening): chunks restart with each document."""
    eager, ours = twins()
    seqs = [ids(n, seed=n).tolist() for n in (43, 20, 67)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s} for s in seqs])
    batch.pop("labels", None)
    batch["use_cache"] = False  # (with a cache transformers' masks do not pack, and eager attends across documents)
    assert_same(eager, ours, **batch)
    packed, start = ours(**batch).logits[0], 0
    for s in seqs:
        close(packed[start:start + len(s)], ours(torch.tensor([s])).logits[0])  # (Llama 4's full layers too)
        start += len(s)
    if flash_kwargs:  # with a cache transformers' mask does not separate the documents that cu_seq_lens_q/k give
        with pytest.raises(ValueError, match="separate its documents"):
            ours(**{**batch, "use_cache": True})


def test_prefill_continued_from_a_cache_equals_one_forward():
    """A left-padded prompt in pieces against transformers' cache (its chunked layers keep a sliding window of keys;
    a piece may hold no real token of a row) gives the logits of one forward."""
    eager, ours = twins()
    x, mask = ids(2, 53), torch.ones(2, 53, dtype=torch.long)
    mask[1, :11] = 0
    real = mask.bool()
    want = eager(x, attention_mask=mask).logits
    cache = {"cache" if "cache" in inspect.signature(ours.forward).parameters else "past_key_values":
             DynamicCache(config=ours.config)}  # transformers 5.24's name, or 5.17's
    with torch.no_grad():
        for a, b in ((0, 7), (7, 21), (21, 30), (30, 31), (31, 53)):
            got = ours(x[:, a:b], attention_mask=mask[:, :b], use_cache=True, **cache).logits
            close(got[real[:, a:b]], want[:, a:b][real[:, a:b]])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_equals_eager(cache):
    """Generation from a left-padded batch: the same tokens, and the same logits at every step (decode steps against
    the cache's window, crossing chunk boundaries)."""
    eager, ours = twins()
    prompt, mask = ids(2, 19), torch.ones(2, 19, dtype=torch.long)
    prompt[0, :5], mask[0, :5] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True, **({} if cache == "dynamic" else
                                                                      {"cache_implementation": cache}))
    want, got = eager.generate(prompt, **kw), ours.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    close(torch.stack(got.logits), torch.stack(want.logits))


@pytest.mark.parametrize("impl", ["longattn_dilated", "longattn_block_sparse"])
def test_other_implementations_refuse_chunked_layers(impl):
    _, other = twins(impl)
    with pytest.raises(ValueError, match="does not support chunked attention"):
        other(ids(1, 20))


def test_a_chunked_layer_whose_mask_is_not_read_as_chunked_is_refused(monkeypatch):
    """Where the plug-in does not recognise a chunked mask (another transformers' mask function), a layer that
    ``config.layer_types`` calls chunked raises instead of running full causal attention (a silently wrong answer)."""
    from longattn.integrations.transformers import batch

    _, ours = twins()
    parts = batch._mask_functions
    monkeypatch.setattr(batch, "_mask_functions",
                        lambda fn: [f for f in parts(fn) if "chunked" not in getattr(f, "__qualname__", "")])
    with pytest.raises(ValueError, match="layer 0 is a chunked attention layer"):
        ours(ids(1, 20))
