"""Dilated-attention modules and the LongNet model (PyTorch backend on the CPU; sizes are tiny)."""
import importlib.util
import math
import os

import pytest
import torch

from longattn import reference
from longattn.models import LongNet, LongNetConfig
from longattn.nn import BlockSparseAttention, DilatedAttention, MultiheadBlockSparseAttention, MultiheadDilatedAttention
from longattn.nn.dilated import apply_rotary, rotary_tables
from longattn.patterns import Local

SEGMENTS, RATES = (4, 8, 16), (1, 2, 4)
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_longnet.py")


def expected_mha(mod: MultiheadDilatedAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer computed by hand: projections, reference dilated attention, Sub-LN, out projection."""
    b, n, e = x.shape
    d = mod.head_dim
    q = (x @ mod.q_proj.weight.T + mod.q_proj.bias).view(b, n, mod.num_heads, d)
    k = (x @ mod.k_proj.weight.T + mod.k_proj.bias).view(b, n, mod.num_kv_heads, d)
    v = (x @ mod.v_proj.weight.T + mod.v_proj.bias).view(b, n, mod.num_kv_heads, d)
    att = mod.attention
    out = reference.dilated_attention(q, k, v, segment_lengths=att.segment_lengths, dilation_rates=att.dilation_rates,
                                      causal=att.causal, head_split=att.head_split).reshape(b, n, e)
    if mod.norm is not None:
        out = torch.nn.functional.layer_norm(out, (e,), mod.norm.weight, mod.norm.bias, mod.norm.eps)
    return out @ mod.out_proj.weight.T + mod.out_proj.bias


@pytest.mark.parametrize("causal,head_split", [(False, False), (True, False), (True, True)])
def test_dilated_attention_module_matches_reference(causal, head_split):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 21, 4, 6, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 21, 2, 6, generator=g, dtype=torch.float64) for _ in range(2))
    mod = DilatedAttention(SEGMENTS, RATES, causal=causal, head_split=head_split, scale=0.3)
    want = reference.dilated_attention(q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES, causal=causal,
                                       head_split=head_split, scale=0.3)
    torch.testing.assert_close(mod(q, k, v), want)


@pytest.mark.parametrize("num_kv_heads,layer_norm,causal", [(None, True, False), (2, True, True), (1, False, True)])
def test_multihead_matches_projected_functional(num_kv_heads, layer_norm, causal):
    torch.manual_seed(1)
    mod = MultiheadDilatedAttention(24, 4, SEGMENTS, RATES, num_kv_heads=num_kv_heads, layer_norm=layer_norm,
                                    causal=causal, dtype=torch.float64)
    with torch.no_grad():  # non-trivial biases and norm parameters
        for p in (mod.q_proj.bias, mod.k_proj.bias, mod.v_proj.bias, mod.out_proj.bias):
            p.normal_()
        if mod.norm is not None:
            mod.norm.weight.normal_()
            mod.norm.bias.normal_()
    assert mod.k_proj.out_features == (num_kv_heads or 4) * 6
    assert (mod.norm is not None) == layer_norm
    x = torch.randn(2, 19, 24, dtype=torch.float64)
    torch.testing.assert_close(mod(x), expected_mha(mod, x))


def test_dropout_only_in_training():
    torch.manual_seed(2)
    mod = MultiheadDilatedAttention(16, 2, (8,), (2,), dropout=0.5, dtype=torch.float64)
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    mod.eval()
    torch.testing.assert_close(mod(x), expected_mha(mod, x))
    mod.train()
    assert not torch.allclose(mod(x), expected_mha(mod, x))


def test_initialisation_gain():
    torch.manual_seed(3)
    e, gain = 256, 2.0
    mod = MultiheadDilatedAttention(e, 4, (8,), (1,), init_gain=gain)
    xavier_std = math.sqrt(2.0 / (e + e))
    assert abs(mod.q_proj.weight.std().item() / xavier_std - 1.0) < 0.05
    assert abs(mod.v_proj.weight.std().item() / (gain * xavier_std) - 1.0) < 0.05
    assert abs(mod.out_proj.weight.std().item() / (gain * xavier_std) - 1.0) < 0.05
    assert torch.count_nonzero(mod.q_proj.bias) == 0


def test_causal_future_does_not_change_past():
    torch.manual_seed(4)
    mod = MultiheadDilatedAttention(16, 4, SEGMENTS, RATES, num_kv_heads=2, causal=True, rotary=True,
                                    dtype=torch.float64)
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    y = x.clone()
    y[:, 13:] = torch.randn(2, 10, 16, dtype=torch.float64)
    a, b = mod(x), mod(y)
    torch.testing.assert_close(a[:, :13], b[:, :13])
    assert not torch.allclose(a[:, 13:], b[:, 13:])
    # without the causal mask the past does change
    mod_nc = MultiheadDilatedAttention(16, 4, SEGMENTS, RATES, num_kv_heads=2, causal=False, dtype=torch.float64)
    assert not torch.allclose(mod_nc(x)[:, :13], mod_nc(y)[:, :13])


def test_rotary_scores_depend_on_relative_position():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    cos, sin = rotary_tables(40, 8, 10000.0, torch.device("cpu"))

    def score(i, j):
        return (apply_rotary(q, cos[i:i + 1], sin[i:i + 1]) * apply_rotary(k, cos[j:j + 1], sin[j:j + 1])).sum()

    torch.testing.assert_close(score(3, 1), score(30, 28))
    torch.testing.assert_close(apply_rotary(q, cos[:1], sin[:1]), q)  # position 0: identity
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_backward_finite_grads():
    torch.manual_seed(6)
    mod = MultiheadDilatedAttention(16, 4, SEGMENTS, RATES, num_kv_heads=2, causal=True, rotary=True)
    x = torch.randn(2, 17, 16, requires_grad=True)
    mod(x).square().mean().backward()
    grads = [x.grad] + [p.grad for p in mod.parameters()]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    assert x.grad.abs().sum() > 0 and mod.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(embed_dim=30, num_heads=4), "divisible by num_heads"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(embed_dim=514, num_heads=2), "head_dim"),
    (dict(segment_lengths=(8, 16), dilation_rates=(1,)), "same length"),
    (dict(segment_lengths=(0,), dilation_rates=(1,)), "segment_lengths"),
    (dict(dilation_rates=(1, 0)), "dilation_rates"),
    (dict(dropout=1.0), "dropout"),
    (dict(backend="cuda"), "backend"),
    (dict(embed_dim=12, num_heads=4, rotary=True), "even head_dim"),
])
def test_bad_configs_raise(kwargs, match):
    args = dict(embed_dim=32, num_heads=4, segment_lengths=(8, 16), dilation_rates=(1, 2))
    args.update(kwargs)
    e, h, s, r = (args.pop(n) for n in ("embed_dim", "num_heads", "segment_lengths", "dilation_rates"))
    with pytest.raises(ValueError, match=match):
        MultiheadDilatedAttention(e, h, s, r, **args)


def test_bad_inputs_raise():
    mod = MultiheadDilatedAttention(16, 2, (8,), (1,))
    with pytest.raises(ValueError, match="x must have shape"):
        mod(torch.randn(2, 5, 8))
    with pytest.raises(TypeError, match="causal"):
        DilatedAttention((8,), (1,), causal=1)
    with pytest.raises(ValueError, match="positive int"):
        LongNetConfig(vocab_size=0, embed_dim=16, num_heads=2, num_layers=1, segment_lengths=(8,), dilation_rates=(1,))


def tiny_config(**kw) -> LongNetConfig:
    args = dict(vocab_size=11, embed_dim=16, num_heads=4, num_layers=2, segment_lengths=(4, 16), dilation_rates=(1, 2),
                num_kv_heads=2)
    args.update(kw)
    return LongNetConfig(**args)


def test_longnet_shapes_tied_and_causal():
    torch.manual_seed(7)
    model = LongNet(tiny_config())
    tokens = torch.randint(0, 11, (3, 20))
    logits = model(tokens)
    assert logits.shape == (3, 20, 11)
    assert model.head_weight is model.embedding.weight
    assert sum(p is model.embedding.weight for p in model.parameters()) == 1
    other = tokens.clone()
    other[:, 12:] = (other[:, 12:] + 1) % 11
    torch.testing.assert_close(model(other)[:, :12], logits[:, :12])
    # the loss over every position equals cross-entropy of the logits
    targets = torch.randint(0, 11, (3, 20))
    torch.testing.assert_close(model(tokens, targets),
                               torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_longnet_checkpointing_same_gradients():
    torch.manual_seed(8)
    plain = LongNet(tiny_config())
    ckpt = LongNet(tiny_config(gradient_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    tokens, targets = torch.randint(0, 11, (2, 18)), torch.randint(0, 11, (2, 18))
    for m in (plain, ckpt):
        m.loss(tokens, targets).backward()
    for p1, p2 in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad)


def test_longnet_optimizer_steps_reduce_loss():
    torch.manual_seed(9)
    model = LongNet(tiny_config())
    tokens = torch.randint(0, 11, (4, 24))
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100  # ignored
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model.loss(tokens, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_example_runs():
    spec = importlib.util.spec_from_file_location("train_longnet_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokens, targets = example.make_batch(3, 40, 5, torch.Generator().manual_seed(0), torch.device("cpu"),
                                         filler=2, answer_len=4)
    keep = targets != example.IGNORE
    assert keep[:, -4:].all() and keep.sum() == 12
    needle = tokens[:, :10]  # the needle sits in the first quarter, exactly once
    assert ((needle >= 2) & (needle < 7)).sum(1).tolist() == [1, 1, 1]
    assert (targets[:, -1] == needle[(needle >= 2) & (needle < 7)]).all()
    result = example.main(["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
                           "--segment-lengths", "8,32", "--dilation-rates", "1,2", "--log-every", "1"])
    assert math.isfinite(result["final_loss"]) and 0.0 <= result["accuracy"] <= 1.0
    # the length curriculum: doubling stages from --curriculum-start, the last at --seq-len
    assert example.length_schedule(64, 10, 16) == [16] * 3 + [32] * 3 + [64] * 4
    assert example.length_schedule(48, 5, 16) == [16, 32, 48, 48, 48]
    assert example.length_schedule(64, 4, None) == [64] * 4 and example.length_schedule(64, 4, 128) == [64] * 4
    result = example.main(["--steps", "4", "--seq-len", "32", "--curriculum-start", "16", "--batch-size", "2",
                           "--eval-batches", "1", "--segment-lengths", "8,32", "--dilation-rates", "1,2"])
    assert math.isfinite(result["final_loss"])


def test_rotary_keeps_float64_in_a_float64_module():
    """The tables and the rotation are float64 for float64 inputs (float32 would cost 1e-7)."""
    m = MultiheadDilatedAttention(32, 4, [16], [1], rotary=True, layer_norm=False, dtype=torch.float64)
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    q, _, _ = m.project(x)
    raw = m.q_proj(x).view(1, 16, 4, 8)
    pos = torch.arange(16, dtype=torch.float64)[:, None, None]
    angle = pos * 10000.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
    x1, x2 = raw[..., :4], raw[..., 4:]
    want = torch.cat((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), -1)
    assert (q - want).abs().max() < 1e-12


@pytest.mark.parametrize("build", [
    lambda: DilatedAttention((8,), (1,), backend="fa4"),
    lambda: MultiheadDilatedAttention(16, 2, (8,), (1,), backend="fa4"),
    lambda: LongNet(tiny_config(backend="fa4")),
    lambda: BlockSparseAttention(Local(1).builder(block_size=8), backend="fa4"),
    lambda: MultiheadBlockSparseAttention(16, 2, Local(1).builder(block_size=8), backend="fa4"),
])
def test_modules_refuse_fa4_at_construction(build):
    """FlashAttention-4 computes neither dilated nor block-sparse attention: every call of such a module would be
    refused (on a CPU as "not a CUDA tensor"), so the construction is."""
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'triton' or 'torch', got 'fa4': FlashAttention-4"):
        build()


def test_dropout_takes_a_numpy_float():
    np = pytest.importorskip("numpy")
    assert MultiheadDilatedAttention(16, 2, (8,), (1,), dropout=np.float32(0.25)).dropout == 0.25
    assert MultiheadBlockSparseAttention(16, 2, Local(1).builder(block_size=8), dropout=np.float32(0.5)).dropout == 0.5
    with pytest.raises(ValueError, match="dropout must be a float in"):
        MultiheadDilatedAttention(16, 2, (8,), (1,), dropout=np.float32(1.5))


@pytest.mark.parametrize("flag", ["False", 0, None])
def test_longnet_config_refuses_a_gradient_checkpointing_that_is_not_a_bool(flag):
    """bool("False") is True: the flag would silently turn checkpointing on."""
    with pytest.raises(TypeError, match="LongNetConfig: gradient_checkpointing must be a bool"):
        tiny_config(gradient_checkpointing=flag)


def test_greedy_generate_of_a_model_in_training_mode_runs_without_dropout():
    torch.manual_seed(3)
    model = LongNet(tiny_config(dropout=0.5, num_layers=1))
    model.blocks[0].attn.eval()  # a mixed state, restored as it was
    tokens = torch.randint(0, 11, (2, 6))
    got = model.generate(tokens, 6)
    assert model.training and model.blocks[0].training and not model.blocks[0].attn.training
    want = tokens
    model.eval()
    with torch.no_grad():
        for _ in range(6):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, want)


def test_reset_parameters_after_meta_construction_gives_the_documented_initialisation():
    cfg = tiny_config(num_layers=3, mlp_ratio=8, embed_dim=64, vocab_size=400)
    model = LongNet(cfg, device="meta").to_empty(device="cpu")
    torch.manual_seed(0)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)  # the usual idiom
    gain = cfg.init_gain
    fc1 = model.blocks[0].fc1.weight
    assert abs(model.embedding.weight.std().item() - 64 ** -0.5) < 0.01  # nn.Embedding's own would be 1
    assert abs(fc1.std().item() - gain * (2 / sum(fc1.shape)) ** 0.5) < 0.01  # Xavier-normal, gain init_gain
    assert model.blocks[0].fc1.bias.abs().max() == 0 and model.blocks[2].attn.v_proj.bias.abs().max() == 0
    torch.testing.assert_close(model.final_norm.weight, torch.ones(64))
    model.embedding.weight.data.fill_(3)
    model.reset_parameters()
    assert abs(model.embedding.weight.std().item() - 64 ** -0.5) < 0.01


def test_multihead_block_sparse_repr_and_reset_parameters():
    layer = MultiheadBlockSparseAttention(16, 4, Local(1).builder(block_size=8), num_kv_heads=2, dropout=0.1)
    assert "embed_dim=16, num_heads=4, num_kv_heads=2, dropout=0.1" in repr(layer)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(7)
    layer.reset_parameters()
    assert all((p != 7).all() for p in layer.parameters())
