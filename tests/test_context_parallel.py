"""Context-parallel training through the transformers plug-in (``longattn.integrations.transformers.context_parallel``
with :class:`longattn.distributed.ContextParallel`), on the CPU with gloo.

A tiny Llama (random weights, float64) trains for a few AdamW steps on one sequence split over the ranks (ring and
Ulysses over 2 ranks, and over 4; the 2 x 2 hybrid; whole and packed batches), beside a copy of it that runs the
whole sequence in one process (``attn_implementation="sdpa"``): at every step the loss and every parameter's
gradient of the split run (reduced over the ranks) must equal the copy's, and the weights after the last step too.
Transformers' causal-LM loss is computed in float32 whatever the model's dtype, so they agree to float32 rounding.

Four processes are spawned once (a module-scoped fixture); 2-rank cases run in the pairs {0, 1} and {2, 3} at the
same time, 4-rank ones over all four. The workers run every case and record None or the failure text.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist

from _ranks import cases_fixture, check_case, compare, expect_value_error, gloo_group, run_cases

transformers = pytest.importorskip("transformers")

from longattn.distributed import ContextParallel, shard  # noqa: E402
from longattn.integrations.transformers import context_parallel  # noqa: E402

WORLD = 4
TIMEOUT_S = 120
STEPS = 3
VOCAB = 61
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, use_cache=False)
DOCS = (5, 9, 2, 8)  # a packed batch of 24 tokens: documents cross the shards at 2 and 4 ranks
# name -> (ranks: 2 (a pair) or 4, plan arguments (hybrid: the 2 x 2 grid's groups added), batch: "rows" (2 x 16)
# or "packed", the packed batch's cu_seq_lens given (else found from its position_ids))
TRAIN_CASES = {
    "ring-zigzag-2": (2, dict(mode="ring"), "rows", False),
    "ring-contiguous-2": (2, dict(mode="ring", layout="contiguous"), "rows", False),
    "ulysses-2": (2, dict(mode="ulysses"), "rows", False),
    "ulysses-zigzag-2": (2, dict(mode="ulysses", layout="zigzag"), "rows", False),
    "ring-packed-2": (2, dict(mode="ring"), "packed", False),  # the balanced layout (a ring plan without a layout)
    "ring-packed-contiguous-cu-2": (2, dict(mode="ring", layout="contiguous"), "packed", True),
    "ulysses-packed-cu-2": (2, dict(mode="ulysses"), "packed", True),
    "ring-zigzag-4": (4, dict(mode="ring"), "rows", False),
    "ulysses-packed-4": (4, dict(mode="ulysses"), "packed", False),
    "hybrid-zigzag-2x2": (4, dict(mode="hybrid"), "rows", False),
    "hybrid-packed-cu-2x2": (4, dict(mode="hybrid"), "packed", True),
}
ERROR_CASES = ("error-batch", "error-padding", "error-positions", "error-model", "error-unattended")  # in the pairs
ALL_CASES = tuple(TRAIN_CASES) + ERROR_CASES


# ----------------------------------------------------------------------------------------------------------------
# worker side

def _tiny(model: str = "llama", **config):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    if model == "mistral":
        return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=5, **config)).double()
    return LlamaForCausalLM(LlamaConfig(**SIZES, **config)).double()


def _ids(*shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _batch(kind: str, cu_given: bool) -> dict:
    """The whole batch: 2 rows of 16 tokens, or the documents of DOCS packed into one row as transformers'
    DataCollatorWithFlattening packs them (labels -100 at each document's first token)."""
    from transformers import DataCollatorWithFlattening

    if kind == "rows":
        ids = _ids(2, 16)
        labels = ids.clone()
        labels[1, 3] = -100  # an ignored target
        return {"input_ids": ids, "labels": labels}
    docs = [{"input_ids": _ids(n, seed=n).tolist()} for n in DOCS]
    batch = dict(DataCollatorWithFlattening(return_flash_attn_kwargs=cu_given)(docs))
    if cu_given:  # the collator's cu_seq_lens are what shard_batch takes; position_ids restart at each document
        assert torch.equal(batch["cu_seq_lens_q"].long(), torch.tensor([0, 5, 14, 16, 24]))
    return batch


def _train_case(plan: ContextParallel, kind: str, cu_given: bool) -> None:
    """STEPS AdamW steps of the split model and of the one-process copy; losses, gradients, weights compared."""
    batch = _batch(kind, cu_given)
    ref = _tiny().train()
    model = copy.deepcopy(ref)
    ref.set_attn_implementation("sdpa")
    model.set_attn_implementation("longattn")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    part = plan.shard_batch(batch)
    n = batch["input_ids"].shape[1]
    if part["input_ids"].shape[1] != n // plan.size or part["position_ids"].shape[1] != n // plan.size:
        raise AssertionError(f"shard_batch gave {tuple(part['input_ids'].shape)} of {n} tokens over {plan.size}")
    if kind == "packed" and plan.mode == "ring":  # without a layout, documents dealt out whole (balanced)
        layout = "balanced" if plan.layout is None else "contiguous"
        want = shard(batch["input_ids"], plan.group, layout, cu_seqlens=torch.tensor([0, *itertools.accumulate(DOCS)]))
        if not torch.equal(part["input_ids"], want):
            raise AssertionError(f"a packed batch on a ring plan with layout {plan.layout!r} is not cut {layout}")
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        want = ref(**batch).loss
        want.backward()
        with context_parallel(plan=plan):
            got = model(**part).loss
            got.backward()
        plan.all_reduce_gradients(model)
        compare(f"step {step}: loss", plan.reduce_loss(got), want.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            compare(f"step {step}: gradient of {name}", p.grad, q.grad)
        for opt in optimizers:
            opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        compare(f"weights {name} after {STEPS} steps", p.detach(), q.detach())


def _error_case(name: str, pair, rank: int) -> None:
    ring = ContextParallel(pair, mode="ring")
    rows = _batch("rows", False)
    if name == "error-batch":
        expect_value_error(lambda: ContextParallel(mode="tree"), "mode must be one of")
        expect_value_error(lambda: ContextParallel(mode="hybrid"), "ring_group and ulysses_group")
        expect_value_error(lambda: ContextParallel(pair, ring_group=dist.group.WORLD), "mode='hybrid'")
        expect_value_error(lambda: ContextParallel(layout="spiral"), "layout must be None or one of")
        expect_value_error(lambda: ring.shard_batch({"input_ids": _ids(1, 6)}), "multiple of 4", "zigzag")
        expect_value_error(lambda: ring.shard_batch({**rows, "token_type_ids": rows["input_ids"]}),
                           "unknown batch keys ['token_type_ids']")
        expect_value_error(lambda: ring.shard_batch({**rows, "shift_labels": rows["labels"]}), "not both")
        expect_value_error(lambda: ring.shard_batch({"labels": rows["labels"]}), "input_ids and inputs_embeds")
        packed = _batch("packed", False)
        expect_value_error(lambda: ContextParallel(pair, layout="zigzag").shard_batch(packed), "cut contiguously")
        # labels shifted over the whole sequence: the last token of rank 0's shard keeps its target
        part = ContextParallel(pair, layout="contiguous").shard_batch(rows)
        want = torch.cat([rows["labels"][:, 1:], torch.full((2, 1), -100)], 1).chunk(2, 1)[rank]
        if not torch.equal(part["shift_labels"], want) or int(part["num_items_in_batch"]) != 2 * 15 - 1:
            raise AssertionError(f"shift_labels {part['shift_labels']}, count {part['num_items_in_batch']}")
    elif name == "error-padding":
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[0, 14:] = 0  # right padding: zeros on rank 0's shard only (zigzag: it holds the last chunk)
        expect_value_error(lambda: ring.shard_batch({**rows, "attention_mask": mask}), "padding", "pack")
        model = _tiny()
        model.set_attn_implementation("longattn")
        part = ring.shard_batch(rows)
        with context_parallel(plan=ring):
            expect_value_error(lambda: model(**part, attention_mask=ring.take(mask)), "takes no attention_mask")
    elif name == "error-positions":
        # position_ids left out: the model numbers each shard from 0, right on rank 0 of the contiguous layout only,
        # and every rank raises
        plan = ContextParallel(pair, layout="contiguous")
        model = _tiny()
        model.set_attn_implementation("longattn")
        part = plan.shard_batch(rows)
        with context_parallel(plan=plan):
            second = dist.get_global_rank(pair, 1)  # errors name global ranks (the pair {2, 3}: rank 3)
            expect_value_error(lambda: model(input_ids=part["input_ids"]), "position_ids must be the positions",
                               f"rank {second}", "shard_batch")
            model(**part)  # and the next call runs
    elif name == "error-model":
        part = ring.shard_batch(rows)
        mistral = _tiny("mistral")
        mistral.set_attn_implementation("longattn")
        llama = _tiny()
        llama.set_attn_implementation("longattn_dilated")
        with context_parallel(plan=ring):
            expect_value_error(lambda: mistral(**part), "does not support sliding_window")
            expect_value_error(lambda: llama(**part), "'longattn_dilated' does not run under context parallelism")
    elif name == "error-unattended":
        # a model switched to another attention (as a shared config object does): it attends within each shard,
        # and the loss and gradients it gives are refused, on every rank, before any reduction
        model = _tiny()
        model.set_attn_implementation("sdpa")
        part = ring.shard_batch(rows)
        with context_parallel(plan=ring):
            out = model(**part)
            out.loss.backward()
        expect_value_error(lambda: ring.reduce_loss(out.loss), "no attention of this plan", "longattn")
        expect_value_error(lambda: ring.all_reduce_gradients(model), "no attention of this plan")
        model.set_attn_implementation("longattn")
        model.zero_grad()
        with context_parallel(plan=ring):
            out = model(**part)  # the plan's attention ran: the batch's results are the whole sequence's
            out.loss.backward()
        ring.all_reduce_gradients(model)
        ring.reduce_loss(out.loss)


def _groups(rank: int):
    """This rank's pair ({0, 1} or {2, 3}: also the Ulysses group of the 2 x 2 grid) and its ring group of the grid
    ({0, 2} or {1, 3}); every rank creates every group, as new_group requires."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return pairs[rank // 2], rings[rank % 2]


def _case(name, pair, ring_group):
    if name in TRAIN_CASES:
        ranks, kwargs, kind, cu_given = TRAIN_CASES[name]
        if kwargs["mode"] == "hybrid":
            kwargs = dict(kwargs, ring_group=ring_group, ulysses_group=pair)
        elif ranks == 2:
            kwargs = dict(kwargs, group=pair)
        _train_case(ContextParallel(**kwargs), kind, cu_given)
    else:
        _error_case(name, pair, dist.get_rank(pair))


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        from longattn.integrations.transformers import register

        register()
        pair, ring_group = _groups(rank)
        run_cases(rank, store_dir, ALL_CASES, lambda name: _case(name, pair, ring_group), limit=8)


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "context-parallel workers")


# ----------------------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", ALL_CASES)
def test_context_parallel_case(results, case):
    check_case(results, case)


def test_plan_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ContextParallel()
    with pytest.raises(TypeError, match="plan must be a longattn.distributed.ContextParallel"):
        with context_parallel(plan="ring"):
            pass
    with pytest.raises(ValueError, match="not both"):
        with context_parallel(plan="ring", layout="zigzag"):
            pass
