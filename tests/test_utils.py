"""longattn.utils: cu_seqlens, padding and unpadding, the auto choice, a step in a CUDA graph."""
import pytest
import torch

import longattn
from longattn import reference as ref
from longattn.utils import auto_backend, cu_seqlens_of, pad_input, unpad_input


def test_cu_seqlens_of():
    assert cu_seqlens_of([3, 0, 5]).tolist() == [0, 3, 3, 8]
    assert cu_seqlens_of([]).tolist() == [0]
    assert cu_seqlens_of([2]).dtype == torch.int32
    with pytest.raises(ValueError, match="lengths"):
        cu_seqlens_of([3, -1])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert cu_seqlens_of(mask.sum(1)).tolist() == [0, 2, 2, 5]  # a tensor of lengths, as FlashAttention users hold
    assert cu_seqlens_of(torch.tensor([4], dtype=torch.int32)).tolist() == [0, 4]
    for bad in (mask, mask.sum(1).float(), mask.sum(1) > 0):
        with pytest.raises(TypeError, match="cu_seqlens_of: a tensor of lengths must be 1-D with an integer dtype"):
            cu_seqlens_of(bad)
    with pytest.raises(ValueError, match="lengths must be ints >= 0"):
        cu_seqlens_of(torch.tensor([2, -1]))


def test_cu_seqlens_of_refuses_unordered_lengths_and_tensors_without_values():
    """A set's order is not the batch's: {3, 1} would lay out [0, 1, 4]. A meta tensor has no lengths to read."""
    for bad in ({3, 1}, frozenset({2}), {3: 1}, {3: 1}.keys()):
        with pytest.raises(TypeError, match="cu_seqlens_of: lengths must be a sequence of ints in the batch's order"):
            cu_seqlens_of(bad)
    assert cu_seqlens_of({3: 1}.values()).tolist() == [0, 1]  # (insertion-ordered)
    with pytest.raises(ValueError, match="cu_seqlens_of: lengths is a meta tensor without values"):
        cu_seqlens_of(torch.tensor([1, 2], device="meta"))


def test_unpad_input_names_an_x_that_is_no_tensor():
    with pytest.raises(TypeError, match=r"unpad_input: x must be a torch.Tensor \(batch, seq, ...\), got list"):
        unpad_input([[1.0]], torch.ones(1, 1, dtype=torch.bool))


def test_unpad_then_varlen_then_pad_equals_attention_per_sequence():
    x = torch.randn(3, 7, 2, 8, dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 7], dtype=torch.bool)
    packed, indices, cu, longest = unpad_input(x, mask)
    assert cu.tolist() == [0, 7, 11, 11] and longest == 7 and packed.shape == (11, 2, 8)
    out = pad_input(longattn.flash_attention_varlen(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                    causal=True), indices, 3, 7)
    torch.testing.assert_close(out[0], ref.flash_attention(x[:1], x[:1], x[:1], causal=True)[0])
    torch.testing.assert_close(out[1, :4], ref.flash_attention(x[1:2, :4], x[1:2, :4], x[1:2, :4], causal=True)[0])
    assert (out[1, 4:] == 0).all() and (out[2] == 0).all()
    with pytest.raises(ValueError, match="mask"):
        unpad_input(x, mask[:, :3])


def test_unpad_input_takes_a_0_1_mask_and_refuses_an_additive_one():
    """transformers' attention_mask (int64 0/1) keeps what the bool mask keeps; an additive mask (0 keeps, -inf
    pads) would keep exactly the padded rows if cast to bool: refused."""
    x = torch.arange(12.0).view(2, 6, 1)
    ones = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    for got, want in zip(unpad_input(x, ones), unpad_input(x, ones.bool())):
        assert got == want if isinstance(got, int) else torch.equal(got, want)
    additive = torch.zeros(2, 6).masked_fill(ones == 0, float("-inf"))
    with pytest.raises(ValueError, match="mask == 0"):
        unpad_input(x, additive)


def test_auto_backend_on_cpu_tensors():
    q = torch.randn(1, 8, 2, 16)
    assert auto_backend(q, q) == "sdpa"  # SDPA computes it exactly; on the CPU it is PyTorch's own
    assert auto_backend(q, q, return_lse=True) == "torch"  # SDPA gives no log-sum-exp
    assert auto_backend(q[:, :4], q, causal=True) == "torch"  # bottom-right causal with N != M


def test_auto_backend_answers_with_the_plan_of_the_call():
    """``auto_backend`` is the backend of ``longattn.explain``'s plan of the same flash_attention call, and gives
    the whole plan with ``return_plan=True``; ``needs_grad`` decides whether the plan has a backward to run."""
    import longattn

    q = torch.randn(1, 8, 2, 16)
    plan = auto_backend(q, q, return_lse=True, return_plan=True)
    assert plan == longattn.explain(longattn.flash_attention, q, q, q, return_lse=True)
    assert plan.backend == "torch" == auto_backend(q, q, return_lse=True)
    assert plan.rejected[0].kernel == "sdpa" and "does not compute this call" in plan.rejected[0].reason
    # a deterministic call with a backward never runs SDPA; without one it does (q itself needs no gradient)
    assert auto_backend(q, q, causal=True, deterministic=True, needs_grad=True) == "torch"
    assert auto_backend(q, q, causal=True, deterministic=True, needs_grad=False) == "sdpa"
    assert not q.requires_grad


def test_auto_backend_flags_must_be_bools():
    """``needs_grad="False"`` would count as true: refused, as flash_attention's flags are."""
    q = torch.randn(1, 8, 2, 16)
    for name, value in (("needs_grad", "False"), ("needs_grad", 1), ("return_plan", "yes"), ("return_plan", None)):
        with pytest.raises(TypeError, match=f"auto_backend: {name} must be a bool"):
            auto_backend(q, q, **{name: value})
    assert auto_backend(q, q, needs_grad=torch.tensor(False), return_plan=torch.tensor(False)) == "sdpa"


def test_star_import_gives_the_helpers_only():
    """``from longattn.utils import *`` (as FlashAttention users write ``from flash_attn.bert_padding import *``)
    brings the helpers, not the module's own imports (``F``, ``V``, ``torch``, ``Tensor``, ...), which would
    overwrite the caller's names."""
    names = {}
    exec("from longattn.utils import *", names)
    assert sorted(n for n in names if n != "__builtins__") == ["auto_backend", "cu_seqlens_of", "cuda_graph",
                                                                "pad_input", "unpad_input"]


def test_cuda_graph_checks_its_arguments():
    """``cuda_graph`` names a step that is not callable and a warm-up of no runs; without a GPU it says so before
    running anything (its capture is checked on a GPU: tests/gpu/test_cuda_graphs_gpu.py)."""
    from longattn.utils import cuda_graph

    ran = []
    with pytest.raises(TypeError, match=r"^cuda_graph: step must be a callable of no arguments, got int$"):
        cuda_graph(3)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"^cuda_graph: warmup must be an int >= 1"):
            cuda_graph(lambda: ran.append(1), warmup=bad)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"^cuda_graph: CUDA graphs need a CUDA GPU"):
            cuda_graph(lambda: ran.append(1))
    assert not ran
