"""What longattn reads from a tensor's contents on the host, and when it reuses it (longattn._memo)."""
import pytest
import torch

from longattn._memo import own, per_tensor


def test_the_plugins_padding_mask_is_read_once_per_forward_pass(monkeypatch):
    """The mask transformers gets from our mask function is ours: every layer given it reuses its all-True check
    and unpad plans; a new mask (the next forward pass) is read again."""
    pytest.importorskip("transformers")
    from longattn.integrations.transformers import batch as B

    reads = []
    real_all = torch.Tensor.all
    monkeypatch.setattr(torch.Tensor, "all", lambda t, *a, **kw: reads.append(1) or real_all(t, *a, **kw))
    user_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    for step in range(2):
        mask = B.padding_mask(2, 4, 4, attention_mask=user_mask)
        for _layer in range(3):
            assert not B.all_true(mask)
            plan = B.unpad_plan_of(mask, 4)
            assert plan.cu_seqlens.tolist() == [0, 3, 7]
        assert len(reads) == step + 1
    assert B.unpad_plan_of(mask, 4) is plan


def test_a_remembered_read_is_redone_when_the_tensor_gets_new_memory():
    """A remembered host read is keyed on the tensor object, its version counter and its data pointer: new memory
    under the same object (``t.data = other``, which leaves the version counter alone) is read again; a write into
    the same memory that bypasses the version counter is not seen (documented), a version bump is."""
    reads = []

    @per_tensor()
    def boundaries(t):
        reads.append(1)
        return t.tolist()

    cu = own(torch.tensor([0, 3, 7]))  # (remembered on any device, as a CUDA tensor is)
    assert boundaries(cu) == [0, 3, 7] and boundaries(cu) == [0, 3, 7] and len(reads) == 1
    version = cu._version
    cu.data = torch.tensor([0, 5, 7])
    assert cu._version == version  # (nothing else would tell)
    assert boundaries(cu) == [0, 5, 7] and len(reads) == 2
    cu.data.copy_(torch.tensor([0, 1, 7]))  # same memory, no version bump: cannot be seen without reading it
    assert boundaries(cu) == [0, 5, 7] and len(reads) == 2
    cu.add_(0)  # any in-place write through PyTorch bumps the version
    assert boundaries(cu) == [0, 1, 7] and len(reads) == 3
