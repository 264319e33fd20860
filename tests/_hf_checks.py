"""Test-local checks shared by the transformers model tests that compare ``"longattn"`` with ``"eager"``
(test_transformers_gpt_oss.py, test_transformers_gemma2.py): ``ids(*shape, seed=)`` draws token ids."""
from __future__ import annotations

import torch


def close(a, b, tol=2e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def logits_and_gradients(models, x) -> list:
    """``(logits, {parameter name: gradient})`` of each model on ``x`` (loss: the mean squared logit)."""
    results = []
    for m in models:
        m.zero_grad()
        logits = m(x).logits
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    return results


def assert_same_logits_and_gradients(eager, ours, x) -> dict:
    """``ours`` gives ``eager``'s logits and parameter gradients on ``x``; returns eager's gradients."""
    (want, want_grads), (got, got_grads) = logits_and_gradients((eager, ours), x)
    close(got, want)
    for name, g in want_grads.items():
        close(got_grads[name], g, tol=1e-4)
    return want_grads


def assert_padded_and_packed_equal_one_by_one(model, ids) -> None:
    """A left-padded batch and a padding-free packed batch (DataCollatorWithFlattening) give each sequence's
    logits as the sequence alone does."""
    from transformers import DataCollatorWithFlattening

    lengths = [11, 4, 8]
    x = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        x[b, 11 - n:] = ids(n, seed=b)
        mask[b, 11 - n:] = 1
    logits = model(x, attention_mask=mask).logits
    for b, n in enumerate(lengths):
        close(logits[b, 11 - n:], model(ids(1, n, seed=b)).logits[0])
    seqs = [ids(n, seed=b).tolist() for b, n in enumerate(lengths)]
    batch = DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    batch.pop("labels", None)
    packed = model(**batch).logits[0]
    start = 0
    for s in seqs:
        close(packed[start:start + len(s)], model(torch.tensor([s])).logits[0])
        start += len(s)


def assert_same_greedy_generation(eager, ours, ids) -> None:
    """Greedy generation from a batch with a left-padded prompt gives the same tokens."""
    prompt = ids(2, 7)
    mask = torch.ones_like(prompt)
    prompt[0, :2] = 0
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kw), eager.generate(prompt, **kw))
