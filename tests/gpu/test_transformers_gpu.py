"""GPU tests of the transformers integration: tiny models on CUDA through the Triton kernels (bf16 against sdpa,
padded and packed batches against one-by-one runs, greedy generation through the decode kernels)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM  # noqa: E402

from longattn.integrations.transformers import register  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
register()


def _twins(dtype, impl="longattn", **config):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096, pad_token_id=0,
                      longattn_backend="triton", **config)
    base = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    base.set_attn_implementation("sdpa")
    ours = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    ours.load_state_dict(base.state_dict())
    ours.set_attn_implementation(impl)
    return base, ours


def _ids(*shape, seed=0):
    return torch.randint(1, 101, shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


def test_bf16_logits_and_gradients_match_sdpa():
    base, ours = _twins(torch.bfloat16)
    x = _ids(2, 777)
    res = []
    for m in (base, ours):
        m.zero_grad()
        logits = m(x).logits.float()
        logits.square().mean().backward()
        res.append((logits.detach(), m.model.layers[0].self_attn.q_proj.weight.grad.float()))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=5e-2, atol=5e-2 * res[0][1].abs().max().item())


def test_padded_and_packed_batches_equal_one_by_one():
    _, ours = _twins(torch.float16)
    lengths = [300, 1, 129, 77]
    seqs = [_ids(n, seed=n) for n in lengths]
    with torch.no_grad():
        alone = [ours(s[None]).logits[0] for s in seqs]
        width = max(lengths)
        x = torch.zeros(len(seqs), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(x)
        for b, s in enumerate(seqs):
            x[b, width - len(s):], mask[b, width - len(s):] = s, 1
        padded = ours(x, attention_mask=mask).logits
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(
            [{"input_ids": s.tolist()} for s in seqs])
        batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "labels"}
        packed = ours(**batch).logits[0]
    start = 0
    for b, s in enumerate(seqs):
        torch.testing.assert_close(padded[b, width - len(s):], alone[b], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(packed[start:start + len(s)], alone[b], rtol=1e-2, atol=1e-2)
        start += len(s)


@pytest.mark.parametrize("impl", ["longattn", "longattn_dilated"])
def test_generation_through_the_decode_kernels(impl):
    """float16 greedy generation with the cache (decode kernels, a left-padded row): the logits of every generated
    step equal those of one forward pass over the final sequences (teacher forcing), within float16 tolerance."""
    _, ours = _twins(torch.float16, impl, longattn_dilated={"segment_lengths": [64, 128], "dilation_rates": [1, 2]})
    prompt = _ids(2, 200)
    mask = torch.ones_like(prompt)
    mask[1, :50] = 0
    new = 24
    with torch.no_grad():
        got = ours.generate(prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        full_mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype, device="cuda")], 1)
        position_ids = (full_mask.cumsum(1) - 1).clamp(min=0)
        full = ours(got.sequences, attention_mask=full_mask, position_ids=position_ids).logits
    steps = torch.stack(got.logits, 1).float()  # (2, new, vocab): logits that chose tokens 200 .. 200 + new - 1
    torch.testing.assert_close(steps, full[:, 199:199 + new].float(), rtol=2e-2, atol=2e-2)
