"""The ``models`` suite: one training step of real model shapes under each attention implementation transformers
offers, the implementations taking turns in every round.

Two models are built from a transformers config with random weights (nothing downloaded), their attention shaped as
the released models' and the rest kept small, so that attention dominates the step (:func:`model_specs`):

- ``gpt-oss``: gpt-oss-20b's attention (hidden 2880, 64 query heads, 8 key/value heads, head dim 64, layers
  alternating a sliding window of 128 and full causal attention, one attention-sink logit per head, made non-zero);
  a small mixture of experts (4 experts, 2 per token, intermediate size 256);
- ``gemma2``: Gemma-2-9B's attention (hidden 3584, 16 query heads, 8 key/value heads, head dim 256, logit
  soft-capping at 50, layers alternating a sliding window of 4096 and full causal attention); intermediate size 2048.

Both have :data:`LAYERS` layers and a vocabulary of :data:`VOCAB` (the language-model head would otherwise cost more
than the attention). One step (:data:`PASS`) is the forward of ``(1, N)`` token ids with ``labels=ids``, and
``loss.backward()``, at N = 16k on a GPU (``--quick``: 4k) in the run's dtype; on a CPU tiny models and N (float32 by
default) that exercise the suite, not measure it.

Each implementation of :data:`IMPLS` gets a copy of one model (the same weights) switched with
``set_attn_implementation``: ``longattn`` (:func:`longattn.integrations.transformers.register`), transformers'
``eager``, ``sdpa`` and ``flex_attention``. One that transformers refuses for the model (:func:`twin`), that does
not run on this device (FlexAttention: GPUs only, as the ``flex`` peer), or that fails (out of memory, ...) gets a row
saying why. Times are the median of the round medians (:func:`longattn.bench.timing.time_in_turns`, each round
:data:`REPS` synchronised steps of each implementation), ± half their range; peak memory (GPU) is that of one step
beyond the weights and inputs.

:func:`fill_ratios` gives every other implementation's row longattn's speedup over it (its time over longattn's);
:func:`bar_verdict` checks the issue's bars (:data:`BARS`). The longattn row's note says whether its loss equals
eager's on the first :data:`SANITY_N` tokens of the same batch within the dtype's tolerance (:func:`loss_check`).
"""
from __future__ import annotations

import copy
import importlib.util
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from longattn.bench import timing as T
from longattn.bench.peers import Flex, Unsupported
from longattn.bench.results import Row

SUITE = "models"
PASS = "train"  # forward with labels, loss.backward()
OURS = "longattn"
IMPLS = ("longattn", "eager", "sdpa", "flex_attention")
MODELS = ("gpt-oss", "gemma2")  # the suite's workloads (``--workload`` picks among them)
BARS = {"eager": 2.0, "flex_attention": 1.2}  # the issue's: longattn's speedup over the implementation, at least
LAYERS = 2
VOCAB = 8192
SANITY_N = 5120  # tokens of the loss check: past Gemma 2's window of 4096, small enough for eager to fit
LOSS_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}  # other dtypes (bfloat16, float16): LOSS_RTOL_HALF
LOSS_RTOL_HALF = 2e-2
SINK_STD = 2.0  # gpt-oss's sink logits drawn N(0, SINK_STD) (transformers initialises them to zero)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the suite: its name (the rows' workload), transformers' class and config names, and the
    config's keyword arguments."""

    name: str
    model_class: str
    config_class: str
    config: Dict[str, Any] = field(default_factory=dict)

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.config["head_dim"]


def _layer_types(layers: int) -> List[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def model_specs(device: torch.device, quick: bool, *, layers: int = LAYERS, vocab: int = VOCAB) -> List[ModelSpec]:
    """The suite's models (see the module's docstring): on a GPU the released models' attention shapes with
    ``layers`` layers and a vocabulary of ``vocab``; on a CPU (``quick`` or not) tiny ones of the same structure
    (sliding window, sinks, soft-capping), windows short enough to bite at the CPU's N."""
    for name, x in (("layers", layers), ("vocab", vocab)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"model_specs: {name} must be a positive int, got {x!r}")
    common = dict(num_hidden_layers=layers, layer_types=_layer_types(layers), vocab_size=vocab, attention_dropout=0.0)
    if device.type == "cuda":
        gpt_oss = dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                       num_local_experts=4, num_experts_per_tok=2, intermediate_size=256)
        gemma2 = dict(hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                      sliding_window=4096, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                      intermediate_size=2048, max_position_embeddings=1 << 17)
    else:
        gpt_oss = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
        gemma2 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
                      attn_logit_softcapping=50.0, query_pre_attn_scalar=32, intermediate_size=64)
    return [ModelSpec("gpt-oss", "GptOssForCausalLM", "GptOssConfig", {**common, **gpt_oss}),
            ModelSpec("gemma2", "Gemma2ForCausalLM", "Gemma2Config", {**common, **gemma2})]


def seq_len(device: torch.device, quick: bool) -> int:
    """Tokens of the step: 16k on a GPU (``quick``: 4k), 256 on a CPU (``quick``: 64)."""
    if device.type == "cuda":
        return 4096 if quick else 16384
    return 64 if quick else 256


def head_dim_note(head_dim: int) -> str:
    """What the head dim means for longattn's Triton kernels ('' for the fast ones, 64 and 128)."""
    from longattn._validation import MAX_HEAD_DIM

    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is beyond the Triton kernels' {MAX_HEAD_DIM}: the PyTorch backend runs"
    if head_dim > 128:
        return (f"head_dim {head_dim}: the Triton kernels take it (up to {MAX_HEAD_DIM}), their slowest head dim "
                f"(small tiles), except on Hopper at 256 (the Gluon forward and fused backward)")
    return ""


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """``spec``'s model with random weights (seeded), in training mode, on ``device`` in ``dtype``; gpt-oss's sink
    logits drawn N(0, :data:`SINK_STD`) so that the sinks weigh in the softmax. ImportError without the model's
    class in this transformers."""
    import transformers

    model_cls = getattr(transformers, spec.model_class, None)
    config_cls = getattr(transformers, spec.config_class, None)
    if model_cls is None or config_cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {spec.model_class}")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**spec.config))
    with torch.no_grad():
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):
                sinks.normal_(0.0, SINK_STD)
    return model.to(device=device, dtype=dtype).train()


def twin(model, impl: str, device: torch.device):
    """A copy of ``model`` (the same weights) running attention implementation ``impl``. Raises
    :class:`~longattn.bench.peers.Unsupported` saying why where ``impl`` does not run here: for ``flex_attention``
    the ``flex`` peer's reason (FlexAttention compiles; GPUs only in the benchmark), or transformers' own refusal
    (``set_attn_implementation`` raising for the model)."""
    if impl == "flex_attention":
        reason = Flex().unsupported(None, device, None)
        if reason:
            raise Unsupported(reason)
    from longattn.integrations.transformers import IMPLEMENTATIONS, register

    if impl in IMPLEMENTATIONS:
        register()
    copied = copy.deepcopy(model)
    try:
        copied.set_attn_implementation(impl)
    except (ValueError, ImportError) as err:
        text = str(err).strip()
        first = text.split(". ")[0].splitlines()[0] if text else type(err).__name__
        raise Unsupported(f"transformers: {first}") from err
    return copied


def _step(model, ids: torch.Tensor) -> Callable[[], None]:
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], None]], float]:
    """Median wall time (ms) of ``reps`` synchronised calls: a step lasts tens of milliseconds or more, so no
    per-call event timing is needed, and every call is a whole step."""
    def timer(step: Callable[[], None]) -> float:
        times = []
        for _ in range(reps):
            T.sync(device)
            t0 = time.perf_counter()
            step()
            T.sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return timer


def losses_agree(ours: float, eager: float, dtype: torch.dtype) -> bool:
    """Whether two losses of one batch are equal within ``dtype``'s tolerance: relative :data:`LOSS_RTOL` (float32,
    float64), :data:`LOSS_RTOL_HALF` for 16-bit dtypes; False for a non-finite loss."""
    rtol = LOSS_RTOL.get(dtype, LOSS_RTOL_HALF)
    if not (math.isfinite(ours) and math.isfinite(eager)):
        return False
    return abs(ours - eager) <= rtol * max(1.0, abs(eager))


def loss_check(ours, eager, ids: torch.Tensor, dtype: torch.dtype) -> str:
    """The note saying whether ``ours``'s loss on ``ids`` (no gradients) equals ``eager``'s (:func:`losses_agree`),
    with the largest difference of their logits."""
    try:
        with torch.no_grad():
            a, b = (m(input_ids=ids, labels=ids) for m in (ours, eager))
            diff = (a.logits.float() - b.logits.float()).abs().max().item()
            la, lb = a.loss.item(), b.loss.item()
    except Exception as err:  # noqa: BLE001 - the check is a note, never a failure of the row
        return f"loss vs eager not checked ({T.classify(err)})"
    verdict = "equal" if losses_agree(la, lb, dtype) else "DIFFERENT"
    return (f"loss vs eager ({ids.shape[1]} tokens): {la:.5g} vs {lb:.5g}, {verdict} within "
            f"{LOSS_RTOL.get(dtype, LOSS_RTOL_HALF):g} (max |d logit| {diff:.2g})")


def model_rows(cfg, spec: ModelSpec, n: int, impls: Sequence[str] = IMPLS, rounds: Optional[int] = None) -> List[Row]:
    """One row per implementation of ``impls`` for ``spec``'s training step at ``n`` tokens (see the module's
    docstring); ratios not filled."""
    device, dtype = cfg.device, cfg.dtype
    rows = {impl: Row(suite=SUITE, impl=impl, workload=spec.name, n=n, batch=1, heads=spec.heads,
                      head_dim=spec.head_dim, dtype=cfg.dtype_name, pass_=PASS) for impl in impls}
    try:
        base = build_model(spec, device, dtype)
    except ImportError as err:
        for row in rows.values():
            row.status = f"unsupported: {err}"
        return list(rows.values())
    except Exception as err:  # noqa: BLE001 - e.g. out of memory building it
        for row in rows.values():
            row.status = T.classify(err)
        return list(rows.values())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.config["vocab_size"], (1, n), generator=gen).to(device)
    models, steps = {}, {}
    for impl in impls:
        row = rows[impl]
        try:
            model = models[impl] = twin(base, impl, device)
        except Unsupported as err:
            row.status = T.classify(err)
            continue
        step = _step(model, ids)
        try:
            step()  # warm-up: compilation (FlexAttention), autotuning, caches
            T.sync(device)
            if device.type == "cuda":
                model.zero_grad(set_to_none=True)
                peak = T.peak_bytes(step, device)
                row.peak_mb, row.mb_per_token = peak / 1e6, peak / 1e6 / n
            steps[impl] = step
        except Exception as err:  # noqa: BLE001 - a failing implementation must never end the run
            row.status = T.classify(err)
        if not row.ok:
            model.zero_grad(set_to_none=True)
            T.free_memory(device)
    del base
    cuda = device.type == "cuda"
    rounds = rounds or (3 if cuda and not cfg.quick else 2)
    failed: Dict[str, BaseException] = {}
    times = T.time_in_turns(steps, device, cfg.quick, rounds, timer=_timer(device, 2 if cuda else 1), failed=failed)
    for impl, t in times.items():
        row = rows[impl]
        row.time_ms, row.spread_ms = t.median_ms, t.spread_ms
        row.tokens_per_s = n / (t.median_ms * 1e-3)
    for impl, err in failed.items():
        rows[impl].status = T.classify(err)
        rows[impl].peak_mb = rows[impl].mb_per_token = None
    if failed:
        failed.clear()
        T.free_memory(device)
    for model in models.values():
        model.zero_grad(set_to_none=True)
    _notes(rows, models, spec, ids[:, :SANITY_N], dtype)
    return list(rows.values())


def _notes(rows: Dict[str, Row], models: Dict[str, Any], spec: ModelSpec, ids: torch.Tensor,
           dtype: torch.dtype) -> None:
    ours = rows.get(OURS)
    if ours is not None and ours.ok:
        parts = [head_dim_note(spec.head_dim)]
        if "eager" in models:
            parts.append(loss_check(models[OURS], models["eager"], ids, dtype))
        ours.note = "; ".join(p for p in parts if p)
    if "flex_attention" in rows and rows["flex_attention"].ok:
        rows["flex_attention"].note = "transformers' torch.compile of flex_attention"


def run_models(cfg, *, n: Optional[int] = None, specs: Optional[Sequence[ModelSpec]] = None,
               impls: Sequence[str] = IMPLS) -> List[Row]:
    """The suite's rows (see the module's docstring) for ``specs`` (default :func:`model_specs`) at ``n`` tokens
    (default :func:`seq_len`), their ratios filled (:func:`fill_ratios`). Without transformers every row says so."""
    device = cfg.device
    n = seq_len(device, cfg.quick) if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"run_models: n must be an int >= 2 (tokens of the step), got {n!r}")
    specs = list(model_specs(device, cfg.quick) if specs is None else specs)
    if cfg.workloads:  # the models named (the command line checked that they are of MODELS)
        specs = [s for s in specs if s.name in cfg.workloads]
    missing = None if importlib.util.find_spec("transformers") else (
        "unsupported: needs transformers (pip install 'longattn[hf]')")
    cfg.progress.begin(SUITE, len(specs))
    rows: List[Row] = []
    for spec in specs:
        cfg.progress.step(f"{spec.name} N={n}")
        if not cfg.budget.allow(SUITE):
            continue
        if missing:
            rows += [Row(suite=SUITE, impl=impl, workload=spec.name, n=n, batch=1, heads=spec.heads,
                         head_dim=spec.head_dim, dtype=cfg.dtype_name, pass_=PASS, status=missing) for impl in impls]
            continue
        rows += model_rows(cfg, spec, n, impls)
        T.free_memory(device)
    cfg.progress.end()
    fill_ratios(rows)
    return rows


def _case(r: Row) -> Tuple:
    return r.workload, r.n, r.batch, r.dtype, r.pass_


def fill_ratios(rows: Sequence[Row]) -> None:
    """Set ``speedup`` on the suite's rows: longattn's speedup over the row's implementation, the row's time over
    longattn's on the same model, N and dtype; None on longattn's own row and where either time is missing."""
    ours = {_case(r): r.time_ms for r in rows if r.suite == SUITE and r.impl == OURS and r.ok and r.time_ms}
    for r in rows:
        if r.suite != SUITE:
            continue
        mine, theirs = (r.time_ms if r.ok and r.time_ms else None), ours.get(_case(r))
        r.speedup = mine / theirs if r.impl != OURS and mine and theirs else None


def bar_verdict(row: Row) -> str:
    """Whether longattn's speedup over ``row``'s implementation meets the issue's bar (:data:`BARS`): ``"met"``,
    ``"missed: <ratio> < <bar>"``, or ``"-"`` (no bar for the implementation, or no ratio)."""
    bar = BARS.get(row.impl)
    if bar is None or row.suite != SUITE or row.speedup is None:
        return "-"
    return "met" if row.speedup >= bar else f"missed: {row.speedup:.2f}x < {bar:.1f}x"
