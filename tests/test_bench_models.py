"""`longattn bench models` (a training step of gpt-oss- and Gemma-2-shaped models under each attention
implementation, longattn's speedup over each and the issue's bars) and the decode suite's attention-sinks variant.
CPU only: tiny models and caches in float32."""
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longattn import cli  # noqa: E402
from longattn.bench import decode_suite as DS  # noqa: E402
from longattn.bench import models_suite as MS  # noqa: E402
from longattn.bench import report as rep  # noqa: E402
from longattn.bench import suites as S  # noqa: E402
from longattn.bench.results import Row  # noqa: E402

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config():
    return S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=[])


def _by(rows):
    return {(r.workload, r.impl): r for r in rows}


# ---------------------------------------------------------------------------------------------------- the models
def test_the_suite_is_registered_in_the_runner():
    assert "models" in S.SUITES and S.RUNNERS["models"] is MS.run_models


def test_gpu_models_have_the_released_models_attention_shapes():
    gpt_oss, gemma2 = (s.config for s in MS.model_specs(torch.device("cuda"), quick=False))
    assert {k: gpt_oss[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                    "sliding_window")} == dict(hidden_size=2880, num_attention_heads=64,
                                                               num_key_value_heads=8, head_dim=64, sliding_window=128)
    assert {k: gemma2[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "sliding_window", "attn_logit_softcapping")} == dict(
        hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=4096,
        attn_logit_softcapping=50.0)
    for c in (gpt_oss, gemma2):
        assert c["layer_types"] == ["sliding_attention", "full_attention"] and c["num_hidden_layers"] == MS.LAYERS
    assert MS.seq_len(torch.device("cuda"), quick=False) == 16384
    assert [s.config["num_hidden_layers"] for s in MS.model_specs(CPU, True, layers=3)] == [3, 3]
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="layers must be a positive int"):
            MS.model_specs(CPU, True, layers=bad)


def test_head_dim_note_names_the_slow_and_the_unsupported_head_dims():
    assert MS.head_dim_note(64) == MS.head_dim_note(128) == ""
    assert "slowest" in MS.head_dim_note(256)
    assert "PyTorch backend" in MS.head_dim_note(512)


def test_gpt_oss_sinks_are_made_non_zero_and_twins_share_the_weights():
    spec = MS.model_specs(CPU, True)[0]
    model = MS.build_model(spec, CPU, torch.float32)
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    assert len(sinks) == spec.config["num_hidden_layers"] and all(s.abs().min() > 0 for s in sinks)
    twin = MS.twin(model, "longattn", CPU)
    assert twin.config._attn_implementation == "longattn" and model.config._attn_implementation != "longattn"
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name


def test_workloads_pick_the_models():
    specs = MS.model_specs(CPU, True)
    cfg = S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=[], workloads=("gemma2",))
    rows = MS.run_models(cfg, specs=specs, impls=("longattn",))
    assert {r.workload for r in rows} == {"gemma2"} and [s.name for s in specs] == list(MS.MODELS)


def test_quick_cpu_rows_time_longattn_and_eager_and_say_why_the_others_did_not_run():
    rows = MS.run_models(_config())
    by = _by(rows)
    assert set(by) == {(m, i) for m in ("gpt-oss", "gemma2") for i in MS.IMPLS}
    for model, cls in (("gpt-oss", "GptOssForCausalLM"), ("gemma2", "Gemma2ForCausalLM")):
        ours, eager = by[model, "longattn"], by[model, "eager"]
        for r in (ours, eager):
            assert r.ok and r.time_ms > 0 and r.spread_ms is not None and r.n == 64 and r.pass_ == "train", r
        assert ours.speedup is None
        assert eager.speedup == pytest.approx(eager.time_ms / ours.time_ms)
        assert MS.bar_verdict(eager) in ("met", f"missed: {eager.speedup:.2f}x < 2.0x")
        assert "equal within" in ours.note and "DIFFERENT" not in ours.note
        sdpa = by[model, "sdpa"]
        if getattr(transformers, cls)._supports_sdpa:
            assert sdpa.ok
        else:  # transformers' own refusal, with its reason
            assert sdpa.status.startswith("unsupported: transformers: ") and "scaled_dot_product" in sdpa.status
            assert sdpa.time_ms is None and sdpa.speedup is None
        assert by[model, "flex_attention"].status == "unsupported: GPU only here (compiling for the CPU takes minutes)"


def test_a_refused_or_failing_implementation_is_a_row_never_a_crash(monkeypatch):
    step = MS._step

    def failing_eager(model, ids):
        if model.config._attn_implementation == "eager":
            def oom():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 34.00 GiB")
            return oom
        return step(model, ids)

    monkeypatch.setattr(MS, "_step", failing_eager)
    spec = MS.model_specs(CPU, True)[1]
    rows = {r.impl: r for r in MS.model_rows(_config(), spec, 32, ("longattn", "no_such_attention", "eager"))}
    assert rows["no_such_attention"].status.startswith("unsupported: transformers: ")
    assert "no_such_attention" in rows["no_such_attention"].status
    assert rows["eager"].status == "oom" and rows["eager"].time_ms is None
    assert rows["longattn"].ok and rows["longattn"].time_ms > 0
    assert "equal within" in rows["longattn"].note  # eager's model still answers the loss check without gradients


def _row(impl, model, ms, status="ok", n=16384):
    return Row(suite="models", impl=impl, workload=model, n=n, batch=1, heads=16, head_dim=256, dtype="bfloat16",
               pass_="train", status=status, time_ms=ms)


def test_ratios_are_longattns_speedup_over_each_implementation_of_the_same_model_and_n():
    rows = [_row("longattn", "gemma2", 10.0), _row("eager", "gemma2", 25.0), _row("flex_attention", "gemma2", 11.0),
            _row("sdpa", "gemma2", None, "unsupported: transformers: no"), _row("longattn", "gpt-oss", 5.0),
            _row("eager", "gpt-oss", 20.0), _row("flex_attention", "gpt-oss", 30.0, "oom"),
            _row("eager", "gemma2", 40.0, n=4096),  # no longattn row at this N: no ratio
            Row(suite="speed", impl="eager", workload="gemma2", n=16384, batch=1, heads=16, head_dim=256,
                dtype="bfloat16", pass_="train", time_ms=1.0, speedup=7.0)]
    MS.fill_ratios(rows)
    got = [r.speedup for r in rows]
    assert got[:8] == [None, pytest.approx(2.5), pytest.approx(1.1), None, None, pytest.approx(4.0), None, None]
    assert got[8] == 7.0  # another suite's row is left alone
    assert [MS.bar_verdict(r) for r in rows[:7]] == ["-", "met", "missed: 1.10x < 1.2x", "-", "-", "met", "-"]


def test_losses_agree_within_the_dtypes_tolerance():
    assert MS.losses_agree(9.0, 9.0 + 5e-4, torch.float32)
    assert not MS.losses_agree(9.0, 9.0 + 2e-3, torch.float32)
    assert MS.losses_agree(9.0, 9.1, torch.bfloat16) and not MS.losses_agree(9.0, 9.3, torch.bfloat16)
    assert not MS.losses_agree(math.nan, math.nan, torch.bfloat16)


def test_loss_check_says_different_for_different_weights():
    spec = MS.model_specs(CPU, True)[1]
    ids = torch.randint(0, spec.config["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    a = MS.twin(MS.build_model(spec, CPU, torch.float32, seed=0), "longattn", CPU)
    b = MS.build_model(spec, CPU, torch.float32, seed=0)
    assert "equal within" in MS.loss_check(a, b, ids, torch.float32)
    other = MS.build_model(spec, CPU, torch.float32, seed=5)
    assert "DIFFERENT" in MS.loss_check(a, other, ids, torch.float32)


def test_command_line_runs_the_models_suite_by_name_only(tmp_path):
    assert cli.parse_args(["bench", "models", "--device", "cpu"]).suites == ["models"]
    assert "models" not in cli.parse_args(["bench", "--device", "cpu"]).suites  # not part of "all"
    out = tmp_path / "run"
    assert cli.main(["bench", "models", "--quick", "--device", "cpu", "--out", str(out), "--no-plots",
                     "--no-progress"]) == 0
    rows = [Row.from_json(d) for d in json.loads((out / "results.json").read_text())["rows"]]
    eager = {r.workload: r for r in rows if r.impl == "eager"}
    ours = {r.workload: r for r in rows if r.impl == "longattn"}
    assert set(eager) == {"gpt-oss", "gemma2"}
    for model, r in eager.items():  # the command line's speedup pass keeps the suite's ratio
        assert r.speedup == pytest.approx(r.time_ms / ours[model].time_ms)
    table = rep.terminal_table("models", rows)
    assert "longattn speedup" in table and "bar" in table
    assert "## Models" in (out / "report.md").read_text()


# ------------------------------------------------------------------------------------------ decode with sinks
def test_decode_sinks_rows_take_turns_with_the_plain_calls_and_give_their_ratio(monkeypatch):
    case = (2, 128, 1, 4, 2, 8)
    monkeypatch.setattr(DS, "cases", lambda device, quick: [case])
    monkeypatch.setattr(DS, "sinks_cases", lambda device, quick: [case])
    rows = DS.run_decode(_config())
    by = _by(rows)
    assert set(by) == {("decode-nq1", i) for i in ("longattn", "longattn-paged", "sdpa", "copy")} | {
        ("decode-nq1-sinks", i) for i in ("longattn", "longattn-paged")}
    for impl in ("longattn", "longattn-paged"):
        plain, sunk = by["decode-nq1", impl], by["decode-nq1-sinks", impl]
        assert sunk.ok and sunk.time_ms > 0 and not sunk.same_as
        assert sunk.vs_plain == pytest.approx(sunk.time_ms / plain.time_ms)
        verdict = "met" if sunk.vs_plain <= DS.SINKS_BAR else "missed"
        assert sunk.note.startswith("auto ran torch, K+V ") and f"(bar 1.05x: {verdict})" in sunk.note
        assert plain.vs_plain is None and "sinks" not in plain.note  # the plain rows are as before


def test_decode_sinks_variant_runs_on_every_gpu_case_and_not_on_a_cpu():
    gpu = torch.device("cuda")  # the case lists only: nothing runs on it
    for quick in (True, False):
        assert DS.sinks_cases(gpu, quick) == DS.cases(gpu, quick) != [] and DS.sinks_cases(CPU, quick) == []


def test_decode_sinks_steps_pass_the_sinks():
    gen = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, 128, 2, 8, generator=gen), torch.randn(2, 128, 2, 8, generator=gen)
    q = torch.randn(2, 1, 4, 8, generator=gen)
    seqlens = torch.full((2,), 128, dtype=torch.int32)
    paged = DS.paged_copy(kc, vc, 64, gen)
    plain, sunk = DS._steps(q, kc, vc, seqlens, paged), DS._steps(q, kc, vc, seqlens, paged, DS.sink_logits(4, CPU))
    assert set(sunk) == {"longattn", "longattn-paged"}
    for name, step in sunk.items():
        got, without = step(), plain[name]()
        assert (got - without).abs().max() > 1e-3, name  # the sinks change the output: they were passed
        assert torch.allclose(got, sunk["longattn"](), atol=1e-5)  # paged and contiguous agree


def test_sinks_verdict_against_the_bar():
    assert DS.sinks_verdict(1.04) == "sinks 1.040x plain (bar 1.05x: met)"
    assert DS.sinks_verdict(1.06).endswith("missed)") and DS.sinks_verdict(None) == ""


@pytest.mark.parametrize("paged", [False, True])
def test_auto_decode_backend_with_sinks_is_what_flash_attention_with_kvcache_runs(monkeypatch, paged):
    import longattn
    from longattn import runner

    ran = []
    decode = runner.decode
    monkeypatch.setattr(runner, "decode", lambda impl, *a, **kw: ran.append(impl) or decode(impl, *a, **kw))
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache, table = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8), None
    if paged:
        k_cache, v_cache, table = DS.paged_copy(k_cache, v_cache, 8, torch.Generator().manual_seed(0))
    seqlens = torch.full((2,), 12, dtype=torch.int32) if paged else 12
    sinks = DS.sink_logits(4, CPU)
    longattn.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, sinks=sinks)
    assert ran == [DS.auto_decode_backend(q, k_cache, cache_seqlens=seqlens, block_table=table, sinks=sinks)]
    if not paged:  # SDPA runs the call without sinks, never with them
        assert DS.auto_decode_backend(q, k_cache, cache_seqlens=12) == "sdpa" != ran[0]
