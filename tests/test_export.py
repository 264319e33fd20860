"""``torch.export`` of attention calls on the PyTorch backend: a dynamic sequence length (a ``Dim``) in the
non-strict export of dilated and block-sparse attention, the exported program equal to eager calls at two lengths
(or a clear error where the length cannot be dynamic), and the strict export of flash attention."""
import pytest
import torch
from torch.export import Dim

import longattn
from longattn import patterns as P
from longattn.models import LongNet, LongNetConfig
from longattn.nn import MultiheadDilatedAttention


class Call(torch.nn.Module):
    def __init__(self, fn, **kwargs):
        super().__init__()
        self.fn, self.kwargs = fn, kwargs

    def forward(self, q, k, v):
        return self.fn(q, k, v, **self.kwargs)


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, 2, 16, generator=g) for _ in range(3))


def export_dynamic(mod, n, seq):
    return torch.export.export(mod, inputs(n), dynamic_shapes={name: {1: seq} for name in "qkv"}, strict=False)


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_exports_with_a_dynamic_length(causal):
    """The branch planning hashed a symbolic length (its ``min`` is symbolic under a non-strict export): "unhashable
    type: non-nested SymInt". A length declared a multiple of the segments exports, and runs at other lengths."""
    mod = Call(longattn.dilated_attention, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=causal,
               backend="torch")
    program = export_dynamic(mod, 32, 16 * Dim("blocks", min=2, max=8))
    for n in (32, 64):
        torch.testing.assert_close(program.module()(*inputs(n, seed=n)), mod(*inputs(n, seed=n)))


def test_dilated_export_of_a_length_no_multiple_of_the_segments_names_them():
    mod = Call(longattn.dilated_attention, segment_lengths=[8, 16], dilation_rates=[1, 2], backend="torch")
    with pytest.raises(ValueError, match=r"multiple of every segment length; got segment_lengths=\(8, 16\)"):
        export_dynamic(mod, 40, Dim("seq", min=16, max=256))


@pytest.mark.parametrize("as_pattern", [False, True])
def test_block_sparse_exports_with_a_dynamic_length_inside_its_grid(as_pattern):
    """A dynamic length whose range stays inside the mask's grid exports (it was specialized to the example's)."""
    mask = torch.tensor([[True, False], [True, True]])[None, None]
    mod = Call(longattn.block_sparse_attention, block_mask=P.BlockSparsePattern(mask, 16) if as_pattern else mask,
               block_size=None if as_pattern else 16, backend="torch")
    program = export_dynamic(mod, 32, Dim("seq", min=17, max=32))
    for n in (20, 32):
        torch.testing.assert_close(program.module()(*inputs(n, seed=n)), mod(*inputs(n, seed=n)))


def test_block_sparse_export_past_the_grid_names_the_lengths_allowed():
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    mod = Call(longattn.block_sparse_attention, block_mask=mask, block_size=16, backend="torch")
    with pytest.raises(ValueError, match="block_mask's grid fixes N to 17..32"):
        export_dynamic(mod, 32, Dim("seq", min=16, max=256))
    fixed = Call(longattn.block_sparse_attention, block_mask=P.BlockSparsePattern(mask, 16, seq_lens=(32, 32)),
                 backend="torch")
    with pytest.raises(ValueError, match="without seq_lens"):
        export_dynamic(fixed, 32, Dim("seq", min=17, max=32))


def test_strict_export_of_the_torch_backend():
    """The PyTorch backend ran eagerly under every Dynamo trace (a graph break), which a strict export refuses:
    "Attempted to call function marked as skipped". An export traces it."""
    mod = Call(longattn.flash_attention, causal=True, backend="torch")
    program = torch.export.export(mod, inputs(32), strict=True)
    torch.testing.assert_close(program.module()(*inputs(32, seed=1)), mod(*inputs(32, seed=1)))


def test_strict_export_of_a_module_with_parameters_on_the_torch_backend():
    """Parameters require grad, so the PyTorch backend checkpointed its chunks, asking autograd whether saved-tensor
    hooks were on: a call a strict export cannot trace ("Dynamo does not know how to trace the builtin
    ..._saved_tensors_hooks_is_enabled"). The exported layer computes the eager one's outputs and gradients."""
    layer = MultiheadDilatedAttention(32, 4, [4, 8], [1, 2], causal=True, rotary=True, backend="torch",
                                      dtype=torch.float64)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    exported = torch.export.export(layer, (x,), strict=True).module()
    x_eager, x_exported = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_eager, out_exported = layer(x_eager), exported(x_exported)
    torch.testing.assert_close(out_exported, out_eager)
    out_eager.square().sum().backward()
    out_exported.square().sum().backward()
    torch.testing.assert_close(x_exported.grad, x_eager.grad)
    params = dict(exported.named_parameters())
    for name, p in layer.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, msg=name)


def test_strict_export_of_longnet_checks_the_token_ids_in_the_program():
    """The token-id check called ``is_fake``, which Dynamo refuses to trace: a strict export (and
    ``torch.compile(fullgraph=True)`` on the Triton backend) of LongNet failed. The check is the program's own."""
    config = LongNetConfig(vocab_size=50, embed_dim=32, num_heads=4, num_layers=2, segment_lengths=(4, 8),
                           dilation_rates=(1, 2), backend="torch")
    model = LongNet(config).eval()
    tokens = torch.randint(0, 50, (2, 16))
    program = torch.export.export(model, (tokens,), strict=True).module()
    torch.testing.assert_close(program(tokens), model(tokens))
    with pytest.raises(RuntimeError, match=r"LongNet: tokens must be token ids in \[0, 50\)"):
        program(tokens.masked_fill(tokens == tokens[0, 0], 50))
