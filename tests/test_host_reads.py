"""What longattn reads from a tensor's contents on the host, and when it reuses it (longattn._memo)."""
import pytest
import torch

pytest.importorskip("transformers")


def test_the_plugins_padding_mask_is_read_once_per_forward_pass(monkeypatch):
    """The mask transformers gets from our mask function is ours: every layer given it reuses its all-True check
    and unpad plans; a new mask (the next forward pass) is read again."""
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
