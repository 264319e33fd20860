"""`longattn bench score_mods`: the suite's registration, ALiBi's slopes, FlexAttention's score_mod computing what
flash_attention's modifications compute, the rows (Flex n/a for sinks, the ratios taken from the measured times,
"same kernel as"), the bars, and the command line writing the table. CPU only, tiny sizes; FlexAttention runs
uncompiled where the suite needs it on a CPU."""
import json
import math

import pytest
import torch

from longattn import cli
from longattn import runner
from longattn.bench import report as rep
from longattn.bench import score_mods_suite as SM
from longattn.bench import suites as S
from longattn.bench.results import Row

CPU = torch.device("cpu")


def _config():
    return S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=[])


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention in the suite on a CPU: uncompiled (compiling for a CPU takes minutes)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(SM, "flex_unsupported", lambda device: None)
    monkeypatch.setattr(SM, "_flex_kernel", lambda: flex_attention)


def _materialized_flex(q, k, v, score_mod=None, block_mask=None):
    """FlexAttention's call written plainly (causal, the ``score_mod`` on index tensors): the suite's rows on a CPU,
    where FlexAttention has no backward."""
    B, H, N, D = q.shape
    s = q @ k.transpose(-1, -2) * D ** -0.5
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    if score_mod is not None:
        s = score_mod(s, torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None], i, j)
    return torch.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


@pytest.fixture
def plain_flex(monkeypatch):
    monkeypatch.setattr(SM, "flex_unsupported", lambda device: None)
    monkeypatch.setattr(SM, "_flex_kernel", lambda: _materialized_flex)


def test_the_suite_is_registered_in_the_runner_and_the_command_line():
    assert "score_mods" in S.SUITES and "score_mods" in cli.SUITES and S.RUNNERS["score_mods"] is SM.run_score_mods
    assert cli.parse_args(["bench", "score_mods", "--device", "cpu"]).suites == ["score_mods"]
    assert "score_mods" not in cli.parse_args(["bench", "--device", "cpu"]).suites  # run by name only


def test_alibi_slopes_are_the_papers_geometric_ones():
    assert SM.alibi_slopes(8).tolist() == [2.0 ** -(h + 1) for h in range(8)]
    # not a power of two: the 4 of 4 heads, then every other one of 8 heads
    assert SM.alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert SM.alibi_slopes(1).dtype == torch.float32
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="heads must be a positive int"):
            SM.alibi_slopes(bad)


def test_mod_kwargs_name_each_modification_and_reject_others():
    assert SM.mod_kwargs("none", 4, CPU) == {}
    assert set(SM.mod_kwargs("all", 4, CPU)) == {"softcap", "alibi_slopes", "sinks"}
    assert SM.mod_kwargs("softcap", 4, CPU) == {"softcap": SM.SOFTCAP}
    with pytest.raises(ValueError, match="modification must be one of"):
        SM.mod_kwargs("tanh", 4, CPU)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mod", ["softcap", "alibi"])
def test_flex_score_mod_computes_flash_attentions_modification(mod, eager_flex):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 40, 4, 16) * 4 for _ in range(3))  # scores large enough for the cap to bite
    kw = SM.mod_kwargs(mod, 4, CPU)
    if mod == "softcap":
        kw["softcap"] = 2.0
    want = SM.ours_fn(kw, "torch")(q, k, v)
    got = SM.flex_fn(kw, SM._causal_block_mask(40, CPU))(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = SM.ours_fn({}, "torch")(q, k, v)
    assert (got - plain).abs().max() > 1e-2  # the modification changes the result: the comparison means something
    assert SM.flex_score_mod({}) is None


def test_flex_score_mod_refuses_sinks():
    with pytest.raises(ValueError, match="n/a: sinks"):
        SM.flex_score_mod(SM.mod_kwargs("sinks", 2, CPU))


@pytest.mark.parametrize("mod", SM.MODS)
@pytest.mark.parametrize("needs_grad", [False, True])
def test_auto_kernel_is_what_flash_attention_runs(monkeypatch, mod, needs_grad):
    ran = []
    run_on = runner.run_on
    monkeypatch.setattr(runner, "run_on", lambda impl, *a, **kw: ran.append(impl) or run_on(impl, *a, **kw))
    q, k, v = (torch.randn(1, 32, 2, 8, requires_grad=needs_grad) for _ in range(3))
    kw = SM.mod_kwargs(mod, 2, CPU)
    SM.ours_fn(kw, "auto")(q, k, v)
    assert ran == [SM.auto_kernel(q, k, kw, needs_grad=needs_grad)]


def _by(rows):
    return {(r.impl, r.workload, r.head_dim, r.pass_): r for r in rows}


def test_rows_flex_na_for_sinks_and_ratios_from_the_measured_times(monkeypatch, plain_flex):
    monkeypatch.setattr(SM, "cases", lambda device, quick: [(64, 1, 2, 8)])
    rows = SM.run_score_mods(_config())
    by = _by(rows)
    assert set(by) == {(i, m, 8, p) for i in ("longattn", "flex") for m in SM.MODS for p in ("fwd", "fwd_bwd")}
    assert all(r.suite == "score_mods" and r.n == 64 and r.heads == 2 and r.dtype == "float32" for r in rows)
    for p in ("fwd", "fwd_bwd"):
        for m in ("sinks", "all"):
            na = by["flex", m, 8, p]
            assert na.status == SM.FLEX_NA and na.status.startswith("n/a") and na.time_ms is None
            assert by["longattn", m, 8, p].speedup is None
        for m in ("none", "softcap", "alibi"):
            assert by["flex", m, 8, p].ok and by["flex", m, 8, p].time_ms > 0
        for (impl, m, _, ps), r in by.items():
            if ps != p or not r.ok:
                continue
            assert r.time_ms > 0 and r.spread_ms is not None
            assert r.vs_plain == pytest.approx(r.time_ms / by[impl, "none", 8, p].time_ms)
            if m in ("none", "softcap", "alibi"):
                assert r.speedup == pytest.approx(by["flex", m, 8, p].time_ms / r.time_ms)
        assert by["longattn", "none", 8, p].vs_plain == pytest.approx(1.0)
        assert by["longattn", "softcap", 8, p].note == "auto ran torch"
    # the command line's speedup pass (fill_speedups, whatever --baseline) gives the same "vs flex"
    before = [r.speedup for r in rows]
    rep.fill_speedups(rows, "materialized")
    assert [r.speedup for r in rows] == before
    table = rep.terminal_table("score_mods", rows)
    assert "n/a: sinks" in table and "vs plain" in table and "vs flex" in table


def test_auto_running_the_triton_rows_kernel_repeats_that_rows_measurement(monkeypatch):
    calls = []

    def fake(kwargs, backend):
        def fn(q, k, v):
            calls.append(backend)
            return q * (2.0 if kwargs else 1.0)
        return fn

    monkeypatch.setattr(SM, "cases", lambda device, quick: [(32, 1, 2, 8)])
    monkeypatch.setattr(SM, "_impls", lambda device: ("longattn", "longattn-triton", "flex"))
    monkeypatch.setattr(SM, "ours_fn", fake)
    monkeypatch.setattr(SM, "auto_kernel", lambda q, k, kwargs, needs_grad: "triton" if kwargs else "sdpa")
    by = _by(SM.run_score_mods(_config()))
    assert "auto" in calls and "triton" in calls
    for p in ("fwd", "fwd_bwd"):
        plain = by["longattn", "none", 8, p]
        assert plain.note == "auto ran sdpa" and not plain.same_as and plain.time_ms > 0
        for m in ("softcap", "alibi", "sinks", "all"):
            ours, triton = by["longattn", m, 8, p], by["longattn-triton", m, 8, p]
            assert ours.same_as == "longattn-triton" and ours.time_ms == triton.time_ms
            assert ours.vs_plain == pytest.approx(triton.time_ms / plain.time_ms)
            assert "same kernel as longattn-triton" in rep.terminal_table("score_mods", [ours])
        assert by["flex", "none", 8, p].status.startswith("unsupported: GPU only")


def test_fa4_runs_its_modifications_and_our_rows_note_its_time(monkeypatch):
    """Where FA4 runs, its rows time plain, soft-capped and sink calls (soft-capping and float32 sinks passed as FA4
    takes them), say n/a for ALiBi, and each of our rows notes FA4's time over its own."""
    seen = []

    def fake_fa4(kwargs):
        seen.append(kwargs)
        return lambda q, k, v: q * 3.0

    monkeypatch.setattr(SM, "cases", lambda device, quick: [(32, 1, 2, 8)])
    monkeypatch.setattr(SM, "_impls", lambda device: ("longattn", "flex", "fa4"))
    monkeypatch.setattr(SM, "fa4_unsupported", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(SM, "fa4_fn", fake_fa4)
    by = _by(SM.run_score_mods(_config()))
    assert sorted(tuple(sorted(k)) for k in seen) == sorted([(), ("softcap",), ("sinks",)] * 2)
    for p in ("fwd", "fwd_bwd"):
        for m in ("none", "softcap", "sinks"):
            mine, theirs = by["longattn", m, 8, p], by["fa4", m, 8, p]
            assert theirs.ok and theirs.time_ms > 0
            assert f"FA4 / this {theirs.time_ms / mine.time_ms:.2f}" in mine.note
        for m in ("alibi", "all"):
            assert by["fa4", m, 8, p].status == SM.FA4_NA and "FA4" not in by["longattn", m, 8, p].note


def test_fa4_fn_passes_the_modifications_as_fa4_takes_them(monkeypatch):
    import sys
    import types

    got = {}
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = lambda q, k, v, **kw: (got.update(kw) or q, None)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    sinks = torch.randn(2, dtype=torch.float16)
    SM.fa4_fn(dict(softcap=30.0, sinks=sinks))(torch.ones(1), None, None)
    assert got["causal"] and got["softcap"] == 30.0 and got["learnable_sink"].dtype == torch.float32
    assert torch.equal(got["learnable_sink"], sinks.float())
    with pytest.raises(ValueError, match="ALiBi"):
        SM.fa4_fn(dict(alibi_slopes=torch.ones(2)))


def _row(impl="longattn-triton", mod="softcap", pass_="fwd", vs_plain=None, speedup=None, head_dim=64):
    return Row(suite="score_mods", impl=impl, workload=mod, n=16384, batch=1, heads=16, head_dim=head_dim,
               dtype="bfloat16", pass_=pass_, time_ms=1.0, vs_plain=vs_plain, speedup=speedup)


def test_bar_verdict_applies_the_issues_bars_to_our_modified_rows():
    assert SM.bar_verdict(_row(vs_plain=1.08, speedup=1.5)) == "met"
    assert SM.bar_verdict(_row(vs_plain=1.12, speedup=1.5)) == "missed: costs 1.12x > 1.10x"
    assert SM.bar_verdict(_row(pass_="fwd_bwd", vs_plain=1.12, speedup=1.5)) == "met"
    assert SM.bar_verdict(_row(pass_="fwd_bwd", vs_plain=1.2, speedup=1.2)) == \
        "missed: costs 1.20x > 1.15x; 1.20x < 1.3x vs flex"
    assert SM.bar_verdict(_row(mod="sinks", vs_plain=1.05)) == "met"  # no Flex row: the cost bar only
    assert SM.bar_verdict(_row(impl="flex", vs_plain=1.5, speedup=1.0)) == "-"
    assert SM.bar_verdict(_row(mod="none", vs_plain=1.0, speedup=1.0)) == "-"
    assert SM.bar_verdict(_row()) == "-"


def test_rows_of_two_head_dims_are_distinct_cases_for_compare():
    assert _row(head_dim=64).key() != _row(head_dim=128).key()
    flags = rep.compare([_row(head_dim=64), _row(head_dim=128)],
                        [Row.from_json({**_row(head_dim=128).to_json(), "time_ms": 0.5})])
    assert [f.row.head_dim for f in flags] == [128]


def test_command_line_writes_the_table(monkeypatch, tmp_path):
    monkeypatch.setattr(SM, "cases", lambda device, quick: [(32, 1, 2, 8)])
    status = cli.main(["bench", "score_mods", "--quick", "--device", "cpu", "--no-plots", "--no-progress",
                       "--out", str(tmp_path)])
    assert status == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 2 * len(SM.MODS) * 2 and {r["suite"] for r in rows} == {"score_mods"}
    timed = [r for r in rows if r["impl"] == "longattn"]
    assert all(r["status"] == "ok" and math.isfinite(r["vs_plain"]) for r in timed)
    md = (tmp_path / "report.md").read_text()
    assert rep.SUITE_TITLES["score_mods"] in md and "| bar |" in md
