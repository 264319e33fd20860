"""Context-parallel training through the transformers plug-in with what the first suite (test_context_parallel.py)
leaves out, on 2 gloo ranks against one process running the whole sequence: logit soft-capping (a tiny Gemma 2)
and attention sinks (a tiny gpt-oss), both with every layer full attention (sliding windows are refused under context
parallelism); a packed batch given as ``cu_seq_lens_q/k`` without ``position_ids``; an unpacked batch whose
``position_ids`` start past 0; and ``shard``/``unshard``'s default layout for packed batches.

Models have random weights, float64 (gpt-oss float32: its experts take no float64); the loss and every parameter
gradient (reduced over the ranks) must equal the one-process copy's to float32 rounding (transformers computes the
loss in float32). The copy runs ``"sdpa"`` (Llama) or ``"eager"``, transformers' own soft-capping and sinks (Gemma 2,
gpt-oss), but for gpt-oss's packed batch the plug-in itself (eager gpt-oss lets packed documents see each other;
test_transformers_gpt_oss.py checks the plug-in's packed batches). The two workers run every case and record None or
the failure text.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _ranks import cases_fixture, check_case, compare, expect_value_error, gloo_group, run_cases

transformers = pytest.importorskip("transformers")

from longattn.distributed import ContextParallel, shard, unshard  # noqa: E402
from longattn.integrations.transformers import context_parallel  # noqa: E402

from test_context_parallel import SIZES, _batch, _tiny  # noqa: E402

WORLD = 2
TIMEOUT_S = 120
CU = (0, 5, 14, 16, 24)  # the documents of test_context_parallel's packed batch
FULL = dict(SIZES, head_dim=8, layer_types=["full_attention", "full_attention"])  # no sliding-window layer


def _gemma2():
    """Weights large enough for the soft cap to bite (with the default 0.02 the scores stay far below it)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(**FULL, attn_logit_softcapping=1.5, query_pre_attn_scalar=8,
                                          initializer_range=0.2)).double()


def _gpt_oss():
    """Sinks made non-zero (they start at zero); float32 (its experts' grouped matrix products take no float64)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **FULL, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _check_step(plan: ContextParallel, make, batch: dict, part: dict, reference: str) -> dict:
    """One forward and backward of ``make()`` under ``reference`` on the whole ``batch`` and of its copy under
    ``"longattn"`` in the plan on ``part``: the loss and every parameter gradient (summed over the ranks) compared.
    Returns the reference's gradients."""
    ref = make().train()
    model = copy.deepcopy(ref)
    ref.set_attn_implementation(reference)
    model.set_attn_implementation("longattn")
    want = ref(**batch).loss
    want.backward()
    with context_parallel(plan=plan):
        got = model(**part).loss
        got.backward()
    plan.all_reduce_gradients(model)
    compare("loss", plan.reduce_loss(got), want.detach())
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        compare(f"gradient of {name}", p.grad, grads[name].grad)
    return {name: p.grad for name, p in grads.items()}


def _case_packed_cu_without_position_ids(group, rank):
    batch = _batch("packed", True)  # the collator's cu_seq_lens and per-document position_ids
    given = {k: v for k, v in batch.items() if k != "position_ids"}
    for plan in (ContextParallel(group, mode="ring"), ContextParallel(group, mode="ulysses")):
        part = plan.shard_batch(given)
        _check_step(plan, _tiny, batch, part, "sdpa")
        n = part["input_ids"].shape[1]
        if not torch.equal(part["position_ids"], plan.positions(n, batch["cu_seq_lens_q"])[None]) or \
                not torch.equal(part["position_ids"], plan.take(batch["position_ids"], cu_seqlens=CU_T)):
            raise AssertionError(f"{plan}: position_ids {part['position_ids'].tolist()} are not each document's")
        short = CU_T[:-1]  # documents ending before the batch does: no positions can be made up for the rest
        expect_value_error(lambda: plan.shard_batch({**given, "cu_seq_lens_q": short, "cu_seq_lens_k": short}),
                           "cu_seq_lens_q must end at the packed length 24")


def _case_offset_positions(group, rank):
    rows = _batch("rows", False)
    batch = {**rows, "position_ids": torch.arange(16)[None] + torch.tensor([[100], [7]])}  # windows of longer texts
    plan = ContextParallel(group, mode="ring")
    part = plan.shard_batch(batch)
    _check_step(plan, _tiny, batch, part, "sdpa")
    model = _tiny()
    model.set_attn_implementation("longattn")
    with context_parallel(plan=plan):  # still caught: position_ids left out (each shard from 0), offsets that differ
        expect_value_error(lambda: model(input_ids=part["input_ids"]), "position_ids must be the positions",
                           "shard_batch")
        moved = {**part, "position_ids": part["position_ids"] + 3 * rank}
        expect_value_error(lambda: model(**moved), "offset of position_ids", "differs across ranks")


def _case_gemma2_softcap(group, rank):
    rows = _batch("rows", False)
    ring = ContextParallel(group, mode="ring")
    _check_step(ring, _gemma2, rows, ring.shard_batch(rows), "eager")
    packed = _batch("packed", True)
    ulysses = ContextParallel(group, mode="ulysses")
    _check_step(ulysses, _gemma2, packed, ulysses.shard_batch(packed), "eager")
    model = _gemma2()
    model.set_attn_implementation("longattn")
    with context_parallel(plan=ring):
        expect_value_error(lambda: model(**ring.shard_batch(packed)), "soft-capping", "mode='ulysses' only")


def _case_gpt_oss_sinks(group, rank):
    rows = _batch("rows", False)
    ring = ContextParallel(group, mode="ring")
    grads = _check_step(ring, _gpt_oss, rows, ring.shard_batch(rows), "eager")
    if not any("sinks" in name and g is not None and bool(g.abs().sum() > 0) for name, g in grads.items()):
        raise AssertionError("the sinks got no gradient")
    # packed (the balanced layout) against the plug-in on one process: transformers' eager gpt-oss attention lets a
    # packed batch's documents see each other (test_transformers_gpt_oss checks the plug-in's packed batches)
    packed = _batch("packed", False)
    _check_step(ring, _gpt_oss, packed, ring.shard_batch(packed), "longattn")


def _case_shard_default_layout(group, rank):
    x = torch.arange(24)[None]
    got = shard(x, group, cu_seqlens=CU_T)  # the default for a packed batch: contiguous, as ring_attention's
    if not torch.equal(got, x.chunk(2, 1)[rank]) or not torch.equal(unshard(got, group, cu_seqlens=CU_T), x):
        raise AssertionError(f"shard of a packed batch without a layout gave {got.tolist()}")
    balanced = shard(x, group, "balanced", cu_seqlens=CU_T)
    if not torch.equal(unshard(balanced, group, "balanced", cu_seqlens=CU_T), x):
        raise AssertionError("the balanced layout's round trip changed the batch")
    zigzag = torch.cat([x.chunk(4, 1)[rank], x.chunk(4, 1)[3 - rank]], 1)
    if not torch.equal(shard(x, group), zigzag) or not torch.equal(unshard(zigzag, group), x):
        raise AssertionError("an unpacked tensor without a layout is not cut zigzag")
    expect_value_error(lambda: shard(x, group, "zigzag", cu_seqlens=CU_T), "'balanced' or 'contiguous'")


CU_T = torch.tensor(CU, dtype=torch.int32)
CASES = {name[len("_case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("_case_")}


def _worker(rank: int, world: int, store_dir: str) -> None:
    with gloo_group(rank, world, store_dir):
        from longattn.integrations.transformers import register

        register()
        run_cases(rank, store_dir, CASES, lambda name: CASES[name](dist.group.WORLD, rank), limit=8)


results = cases_fixture(_worker, WORLD, TIMEOUT_S, "context-parallel workers")


@pytest.mark.parametrize("case", sorted(CASES))
def test_context_parallel_case(results, case):
    check_case(results, case)
