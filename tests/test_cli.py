"""The `longattn` command line and the benchmark machinery: argument handling, workloads and peers against the
reference, failure rows, the maxlen search, the report writer and the regression check. No timings are tested."""
import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from longattn import cli
from longattn import reference as R
from longattn.bench import report as rep
from longattn.bench import suites as S
from longattn.bench import timing as T
from longattn.bench.peers import Peer, Unsupported, all_peers, dilated_multiplicity, pair_mask
from longattn.bench.results import Row
from longattn.bench.workloads import WORKLOADS, computed_pairs, make_inputs, make_workload

CPU = torch.device("cpu")
NO_CUDA = not torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------ argument parsing
def test_defaults_run_all_suites_on_cpu_in_float32():
    args = cli.parse_args(["bench"])
    assert args.suites == list(cli.ALL)
    if NO_CUDA:
        assert (args.device, args.dtype) == ("cpu", "float32")
    assert args.out == "longattn-bench" and args.compare is None and not args.quick


def test_suites_options_and_lists():
    args = cli.parse_args(["bench", "speed", "accuracy", "speed", "--quick", "--dtype", "bfloat16", "--device",
                           "cpu", "--impl", "longattn,sdpa-math", "--impl", "materialized", "--workload", "dense",
                           "--out", "somewhere", "--baseline", "sdpa-math"])
    assert args.suites == ["speed", "accuracy"]
    assert args.quick and args.dtype == "bfloat16" and args.device == "cpu"
    assert args.impl == ["longattn", "sdpa-math", "materialized"]
    assert args.workload == ["dense"] and args.out == "somewhere" and args.baseline == "sdpa-math"
    assert cli.parse_args(["bench", "all", "--device", "cpu"]).suites == list(cli.ALL)
    assert cli.parse_args(["bench", "models", "--workload", "gemma2", "--device", "cpu"]).workload == ["gemma2"]


def test_impl_help_names_the_suites_it_chooses_rows_of():
    """``--impl longattn`` leaves the varlen and decode suites' SDPA and copy rows in (they run their own rows): the
    help and docs/cli.md said "implementations to run" without saying which suites take it."""
    args = cli.parse_args(["bench", "varlen", "decode", "--impl", "longattn", "--device", "cpu", "--quick"])
    cfg = S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=[p for p in all_peers()
                                                                            if p.name in args.impl], impl_chosen=True)
    assert {"sdpa", "copy"} <= {impl for _, impl, *_ in S.planned_jobs(cfg, args.suites)}
    own = "speed, memory, maxlen, scaling and accuracy"
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert f"implementations to run in the {own} suites" in help_text
    docs = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--impl NAMES` |"))
    assert "`speed`, `memory`, `maxlen`, `scaling` and `accuracy` suites" in row


@pytest.mark.parametrize("argv, message", [
    (["bench", "sped"], "unknown suite 'sped'"),
    (["bench", "--dtype", "float64"], "invalid choice"),
    (["bench", "--device", "tpu"], "invalid choice"),
    (["bench", "--impl", "flash3"], "unknown implementation 'flash3'"),
    (["bench", "--workload", "sparse"], "unknown workload 'sparse'"),
    (["bench", "speed", "--workload", "gemma2"], "models are the models suite's"),
    (["bench", "models", "--workload", "dense"], "choose from gpt-oss, gemma2"),
    (["bench", "--baseline", "nope"], "unknown --baseline"),
    (["bench", "--fail-on-regression"], "needs --compare"),
    (["bench", "--threshold", "-0.5"], "--threshold"),
    # An empty list (a shell variable left empty) ran every implementation or workload, the default.
    (["bench", "--impl", ""], "--impl names nothing"),
    (["bench", "speed", "--workload", ","], "--workload names nothing"),
    ([], "a command is required"),
])
def test_invalid_arguments_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not NO_CUDA, reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["bench", "--device", "cuda"])
    assert exc.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err


def test_python_dash_m_longattn_runs():
    res = subprocess.run([sys.executable, "-m", "longattn", "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("longattn ")


# ---------------------------------------------------------------------------------------- workloads and FLOP counts
@pytest.mark.parametrize("kind", ["causal", "window", "block_sparse", "dilated"])
def test_computed_pairs_match_the_masks(kind):
    w = make_workload(kind, 136, batch=1, heads=4, head_dim=8)
    if kind == "dilated":
        expected = int(dilated_multiplicity(w, CPU).sum())  # each branch's pairs, shared ones counted per branch
    else:
        expected = int(pair_mask(w, CPU).sum()) * w.heads
    if kind == "causal":  # FlashAttention's convention: half of N^2, not N(N+1)/2
        assert computed_pairs(w) == w.heads * w.n * w.n // 2
        assert expected == w.heads * w.n * (w.n + 1) // 2
    else:
        assert computed_pairs(w) == expected


def test_make_workload_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        make_workload("sparse", 128, batch=1, heads=1, head_dim=8)
    with pytest.raises(ValueError, match="multiple of 8"):
        make_workload("dilated", 100, batch=1, heads=1, head_dim=8)


def _reference(w, q, k, v):
    if w.kind == "dilated":
        return R.dilated_attention(q, k, v, segment_lengths=w.segments, dilation_rates=w.rates)
    if w.kind == "block_sparse":
        return R.block_sparse_attention(q, k, v, block_mask=w.block_mask, block_size=w.block_size)
    return R.flash_attention(q, k, v, causal=w.causal, window=w.window)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_every_cpu_peer_computes_the_reference(kind):
    """The peers compute the same attention as the float64 reference (forward and gradients)."""
    w = make_workload(kind, 72, batch=2, heads=4, head_dim=8)
    q, k, v = (x.requires_grad_() for x in make_inputs(w, CPU, torch.float64, seed=3))
    ref = _reference(w, q, k, v)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    ran = []
    for peer in all_peers():
        if not peer.applies(kind) or peer.unsupported(w, CPU, torch.float64) or peer.name in ("sdpa-cudnn",
                                                                                               "sdpa-efficient"):
            continue
        out = peer.prepare(w, CPU, torch.float64)(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9, msg=f"{peer.name} {kind}")
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, rtol=1e-8, atol=1e-8, msg=f"{peer.name} {kind} grad")
        ran.append(peer.name)
    assert "longattn" in ran and "materialized" in ran
    assert ("composition" in ran) == (kind == "dilated")


# -------------------------------------------------------------------------------------------------- failure rows
class _Raising(Peer):
    def __init__(self, name, err, limit=None):
        self.name, self.err, self.limit = name, err, limit

    def prepare(self, w, device, dtype):
        def fn(q, k, v):
            if self.limit is None or w.n > self.limit:
                raise self.err
            return q * 1.0
        return fn


class _Passthrough(Peer):
    name = "passthrough"

    def prepare(self, w, device, dtype):
        return lambda q, k, v: v * 1.0


def _tiny_config(peers, **sizes):
    base = dict(heads=2, head_dim=8, speed_n=(64, 128), speed_tokens=128, memory_n=(64,), scaling_n=(64, 128),
                scaling_batch_n=64, scaling_batches=(1, 2), maxlen_start=64, maxlen_cap=4096, maxlen_probe_s=60.0,
                maxlen_budget_s=120.0, accuracy_n=48, accuracy_batch=1, accuracy_heads=2)
    base.update(sizes)
    return S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=peers, workloads=("dense",),
                         sizes=S.Sizes(**base))


def test_a_failing_peer_becomes_an_error_row_and_the_run_goes_on():
    peers = [_Raising("broken", RuntimeError("boom\nsecond line")), _Passthrough(),
             _Raising("hungry", torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")),
             _Raising("nokernel", Unsupported("not on this device"))]
    rows = S.run_speed(_tiny_config(peers))
    status = {(r.impl, r.n, r.pass_): r.status for r in rows}
    assert len(rows) == 2 * 2 * len(peers)
    for n in (64, 128):
        for pass_ in T.PASSES:
            assert status[("broken", n, pass_)] == "error: RuntimeError: boom"
            assert status[("passthrough", n, pass_)] == "ok"
            assert status[("nokernel", n, pass_)] == "unsupported: not on this device"
        # after an out-of-memory failure the larger sizes of that peer are not tried
    assert status[("hungry", 64, "fwd")] == "oom"
    assert status[("hungry", 128, "fwd")] == "skipped: oom at a smaller size"
    ok = [r for r in rows if r.impl == "passthrough"]
    assert all(r.time_ms is not None and r.tflops is not None and r.tokens_per_s is not None for r in ok)
    broken = [r for r in rows if r.impl == "broken"]
    assert all(r.time_ms is None and r.tflops is None for r in broken)


@pytest.mark.parametrize("err, expected", [
    (MemoryError(), "oom"),
    (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 GB"), "oom"),
    (RuntimeError("No available kernel. Aborting execution."), "unsupported: no kernel for these inputs"),
    (ValueError("x" * 300), "error: ValueError: " + "x" * 117 + "..."),
])
def test_classify(err, expected):
    assert T.classify(err) == expected


def test_maxlen_doubles_then_bisects_to_an_eighth():
    limit = 1500
    cfg = _tiny_config([_Raising("bounded", MemoryError(), limit=limit)])
    row = S.find_maxlen(cfg.peers[0], "dense", "fwd", cfg)
    assert row.status == "ok" and row.note.startswith("oom at")
    assert limit * 7 // 8 <= row.max_n <= limit
    capped = S.find_maxlen(_Passthrough(), "dense", "fwd_bwd", _tiny_config([], maxlen_cap=256))
    assert capped.max_n == 256 and capped.note == "size cap 256"
    broken = S.find_maxlen(_Raising("b", RuntimeError("bad")), "dense", "fwd", cfg)
    assert broken.max_n is None and broken.status == "error: RuntimeError: bad"


# ---------------------------------------------------------------------------------------------- report and JSON
META = {"device": "Fake GPU 9000", "torch": "9.9.9", "triton": "7.7.7", "cuda": "13.0", "longattn": "0.1.0",
        "python": "3.11", "date": "2030-01-02T03:04:05+00:00", "command": "longattn bench speed --quick",
        "dtype": "bfloat16", "quick": True, "baseline": "materialized"}


def _row(impl, ms, **kw):
    base = dict(suite="speed", impl=impl, workload="dense", n=4096, batch=1, heads=16, head_dim=64,
                dtype="bfloat16", pass_="fwd", time_ms=ms, spread_ms=None if ms is None else 0.01 * ms)
    base.update(kw)
    return Row(**base)


def _fake_rows():
    return [
        _row("longattn", 2.0, tflops=300.0, tokens_per_s=2e6, mb_per_token=0.001, note="triton"),
        _row("materialized", 4.0, tflops=150.0, tokens_per_s=1e6, mb_per_token=0.5),
        _row("sdpa-math", None, status="oom"),
        _row("flex", None, status="error: RuntimeError: compile failed"),
        _row("sdpa-flash", None, status="unsupported: no kernel for these inputs"),
        Row(suite="maxlen", impl="longattn", workload="dilated", n=4 << 20, batch=1, heads=16, head_dim=64,
            dtype="bfloat16", pass_="fwd_bwd", max_n=4 << 20, note="oom at 4718592"),
        Row(suite="accuracy", impl="longattn", workload="window", n=200, batch=2, heads=4, head_dim=64,
            dtype="float32", pass_="fwd_bwd", err_out=1.25e-7, err_grad=3.5e-7),
    ]


def test_report_writer_markdown_and_json(tmp_path):
    rows = _fake_rows()
    rep.fill_speedups(rows, "materialized")
    assert rows[0].speedup == pytest.approx(2.0) and rows[1].speedup == pytest.approx(1.0)
    assert rows[2].speedup is None
    js, md = rep.write_reports(tmp_path / "out", META, rows, plots=[str(tmp_path / "out" / "time_vs_n.png")],
                               workloads=["dense: dense (at N=4096)"])
    text = md.read_text()
    for needle in ("Fake GPU 9000", "torch 9.9.9", "triton 7.7.7", "2030-01-02", "longattn bench speed --quick",
                   "| implementation | workload | N | B | pass | time ms | speedup | TFLOP/s | tokens/s | MB/token |",
                   "| longattn | dense | 4k | 1 | fwd | 2 ± 0.02 | 2.00x | 300 | 2M | 0.001 | ok | triton |",
                   "| sdpa-math | dense | 4k | 1 | fwd | - | - | - | - | - | oom |",
                   "error: RuntimeError: compile failed", "unsupported: no kernel for these inputs",
                   "4,194,304", "oom at 4718592", "1.25e-07", "3.50e-07", "![time_vs_n](time_vs_n.png)",
                   "## Speed", "## Longest sequence", "## Accuracy"):
        assert needle in text, needle
    data = json.loads(js.read_text())
    assert data["meta"] == META
    assert [Row.from_json(d) for d in data["rows"]] == rows
    assert data["rows"][0]["pass"] == "fwd"
    meta, loaded = rep.load_json(js)
    assert loaded == rows and meta["device"] == "Fake GPU 9000"


def test_report_header_says_run_time_and_partial_runs(tmp_path):
    meta = dict(META, seconds=12.5, suite_seconds={"speed": 10.0, "memory": 2.5})
    _, md = rep.write_reports(tmp_path / "a", dict(meta, partial=True), _fake_rows())
    assert "run time: 12.5 s (speed 10.0 s, memory 2.5 s) (partial: interrupted or still running)" in md.read_text()
    _, md = rep.write_reports(tmp_path / "b", meta, _fake_rows())
    assert "run time: 12.5 s (speed 10.0 s, memory 2.5 s)\n" in md.read_text()


def test_terminal_report_lists_unsupported_once():
    rows = _fake_rows() + [_row("sdpa-flash", None, n=8192, status="unsupported: no kernel for these inputs")]
    text = rep.terminal_report(META, rows)
    assert "Fake GPU 9000" in text and "== Speed" in text and "oom" in text
    assert text.count("sdpa-flash") == 1
    assert "unsupported here: sdpa-flash (dense): no kernel for these inputs" in text


def test_terminal_gives_statuses_it_cuts_in_full():
    """On a CPU the maxlen suite is skipped with a reason longer than the status column: the terminal cuts it in the
    table and gives it whole below."""
    cfg = S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=all_peers())
    text = rep.terminal_report(META, S.run_maxlen(cfg))
    assert len(S.CPU_MAXLEN_SKIP) > rep.STATUS_WIDTH
    assert text.count(f"status in full: {S.CPU_MAXLEN_SKIP}") == 1


def test_docs_say_maxlen_is_skipped_on_a_cpu():
    from pathlib import Path

    table_row = next(line for line in (Path(__file__).parents[1] / "docs" / "cli.md").read_text().splitlines()
                     if line.startswith("| `maxlen` |"))
    cpu_quick, cpu = [c.strip() for c in table_row.strip("|").split("|")][3:5]
    assert cpu_quick.startswith("skipped") and cpu.startswith("skipped"), table_row


def test_load_json_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"something": 1}')
    with pytest.raises(ValueError, match="not a longattn bench JSON"):
        rep.load_json(bad)


# ---------------------------------------------------------------------------------------------- regression check
def test_compare_flags_20_percent_slower_not_5_percent():
    base = [_row("a", 10.0), _row("b", 10.0), _row("c", 10.0), _row("d", 10.0), _row("e", 10.0, n=8192)]
    new = [_row("a", 12.0), _row("b", 10.5), _row("c", 8.0), _row("d", None, status="oom"),
           _row("e", 50.0, n=16384), _row("f", 99.0)]
    flags = rep.compare(new, base, threshold=0.10)
    assert [(f.row.impl, f.ratio) for f in flags] == [("a", pytest.approx(1.2)), ("d", None)]
    assert "+20%" in flags[0].describe() and "now 'oom'" in flags[1].describe()
    assert rep.compare(new, base, threshold=0.25)[0].row.impl == "d"  # 20% is within a 25% threshold
    other_dtype = [_row("a", 20.0, dtype="float16")]
    assert rep.compare(other_dtype, base) == []


def test_compare_judges_rows_within_their_spread_and_a_shared_kernel_once():
    base = [_row("steady", 10.0, spread_ms=0.1), _row("noisy-base", 10.0, spread_ms=3.0),
            _row("noisy-now", 10.0, spread_ms=0.1), _row("in-spread", 10.0, spread_ms=0.9),
            _row("sdpa", 10.0, spread_ms=0.1), _row("longattn", 10.0, spread_ms=0.1, same_as="sdpa")]
    new = [_row("steady", 12.0, spread_ms=0.1), _row("noisy-base", 15.0, spread_ms=0.1),
           _row("noisy-now", 15.0, spread_ms=2.0), _row("in-spread", 11.5, spread_ms=0.9),
           _row("sdpa", 20.0, spread_ms=0.1), _row("longattn", 20.0, spread_ms=0.1, same_as="sdpa")]
    found = rep.compare_rows(new, base, threshold=0.10)
    # +15% but within the two spreads (0.9 + 0.9 ms): not a regression; the kernel auto shares with sdpa: once
    assert [f.row.impl for f in found.flags] == ["steady", "sdpa"]
    assert [r.impl for r in found.noisy] == ["noisy-base", "noisy-now"]
    assert [r.impl for r in found.shared] == ["longattn"]
    notes = found.notes(0.10)
    assert "2 row(s) not compared" in notes[0] and "1 row(s) ran another row's kernel" in notes[1]
    assert rep.compare(new, base, threshold=0.10) == found.flags


def test_compare_refuses_cpu_quick_runs_as_unstable():
    from longattn.bench import stability

    steady = {"stability": {"unstable": False, "reasons": []}}
    assert "--quick" in stability.refusal(dict(steady, device_type="cpu", quick=True))
    assert stability.refusal(dict(steady, device_type="cpu", quick=False)) == ""
    assert stability.refusal(dict(steady, device_type="cuda", quick=True)) == ""
    assert stability.refusal({"stability": {"unstable": True, "reasons": ["load 9"]}}) == "load 9"


def test_two_cpu_quick_runs_are_not_compared(tmp_path, capsys, monkeypatch):
    from longattn.bench import stability

    monkeypatch.setattr(stability, "assess", lambda before, rows: {"unstable": False, "reasons": []})
    fast = tmp_path / "fast.json"  # an earlier CPU --quick run, stable, every row absurdly fast
    fast.write_text(json.dumps(rep.to_json({"device_type": "cpu", "quick": True, "stability": {"unstable": False}}, [
        Row(suite="accuracy", impl="materialized", workload="dense", n=96, batch=2, heads=4, head_dim=32,
            dtype="float32", pass_="fwd_bwd", time_ms=1e-9, spread_ms=0.0)])))
    argv = ["bench", "accuracy", "--quick", "--device", "cpu", "--impl", "materialized", "--workload", "dense",
            "--no-plots", "--no-progress", "--out", str(tmp_path / "a")]
    status = cli.main(argv + ["--compare", str(fast), "--fail-on-regression"])
    out = capsys.readouterr().out
    assert status == cli.EXIT_REFUSED and "not compared" in out and "CPU --quick" in out and "REGRESSION" not in out


def _scaling_argv(out, *extra):
    return ["bench", "scaling", "--quick", "--device", "cpu", "--impl", "sdpa-math", "--workload", "dense",
            "--out", str(out), "--no-plots", "--no-progress", *extra]


@pytest.fixture
def steady_machine(monkeypatch):
    """Runs judged stable whatever this machine's load and spreads (the comparison logic is what is tested): no
    spread between timing rounds, CPU --quick runs compared as a GPU's would be."""
    from longattn.bench import stability

    timed = T.time_in_turns
    monkeypatch.setattr(T, "time_in_turns", lambda *a, **kw: {
        i: T.Timing(t.median_ms, 0.0, t.reps) for i, t in timed(*a, **kw).items()})

    real = stability.assess
    monkeypatch.setattr(stability, "assess", lambda before, rows: dict(real({"cpus": 1}, []), unstable=False,
                                                                          reasons=[]))
    monkeypatch.setattr(stability, "UNCOMPARABLE", ())


def test_compare_exit_status(tmp_path, capsys, steady_machine):
    assert cli.main(_scaling_argv(tmp_path / "first")) == 0
    meta, rows = rep.load_json(tmp_path / "first" / "results.json")
    assert rows and all(r.suite == "scaling" and r.impl == "sdpa-math" and r.ok for r in rows)
    # a baseline where every row was absurdly fast: all rows regress
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(rep.to_json(meta, [Row.from_json({**r.to_json(), "time_ms": 1e-9, "spread_ms": 0.0})
                                                  for r in rows])))
    assert cli.main(_scaling_argv(tmp_path / "a", "--compare", str(fast))) == 0  # flags only print
    assert "REGRESSION" in capsys.readouterr().out
    assert cli.main(_scaling_argv(tmp_path / "b", "--compare", str(fast), "--fail-on-regression")) == 1
    flagged = json.loads((tmp_path / "b" / "results.json").read_text())["regressions"]
    assert len(flagged) == len(rows)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(rep.to_json(meta, [Row.from_json({**r.to_json(), "time_ms": 1e9}) for r in rows])))
    assert cli.main(_scaling_argv(tmp_path / "c", "--compare", str(slow), "--fail-on-regression")) == 0
    assert cli.main(_scaling_argv(tmp_path / "d", "--compare", str(tmp_path / "missing.json"))) == 2


def test_compare_refuses_an_unstable_baseline(tmp_path, capsys, steady_machine):
    assert cli.main(_scaling_argv(tmp_path / "first")) == 0
    meta, rows = rep.load_json(tmp_path / "first" / "results.json")
    meta["stability"] = {"unstable": True, "reasons": ["load average 9.0 on 2 cores before the run"]}
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(rep.to_json(meta, [Row.from_json({**r.to_json(), "time_ms": 1e-9}) for r in rows])))
    # refused, not passed: --fail-on-regression exits with its own status, not 0 (nor 1: nothing was compared)
    assert cli.main(_scaling_argv(tmp_path / "a", "--compare", str(fast), "--fail-on-regression")) == cli.EXIT_REFUSED
    out = capsys.readouterr().out
    assert "not compared" in out and "load average 9.0" in out and "REGRESSION" not in out


def test_stability_assessment():
    from longattn.bench import stability

    def row(ms, spread):
        return Row(suite="speed", impl="x", workload="dense", n=1, batch=1, heads=1, head_dim=1, dtype="float32",
                   pass_="fwd", time_ms=ms, spread_ms=spread)

    calm = stability.assess({"load_1min": 0.2, "cpus": 2}, [row(10, 0.1)] * 4)
    assert not calm["unstable"] and not stability.warning_lines({"stability": calm})
    loaded = stability.assess({"load_1min": 6.0, "cpus": 2}, [row(10, 0.1)] * 4)
    assert loaded["unstable"] and "load average 6.0" in loaded["reasons"][0]
    noisy = stability.assess({"load_1min": 0.2, "cpus": 2}, [row(10, 5.0)] * 3 + [row(10, 0.1)])
    assert noisy["unstable"] and "3 of 4" in noisy["reasons"][0]
    assert "unstable machine" in stability.warning_lines({"stability": noisy})[0]


# ----------------------------------------------------------------------------------------------------- end to end
def test_bench_accuracy_quick_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "tmp"
    assert cli.main(["bench", "accuracy", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "Accuracy against the float64 reference" in printed.out and "[accuracy] done" in printed.err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["command"] == f"longattn bench accuracy --quick --device cpu --out {out}"
    rows = [Row.from_json(d) for d in data["rows"]]
    ours = {(r.workload, r.dtype): r for r in rows if r.impl == "longattn"}
    assert set(ours) == {(k, d) for k in WORKLOADS for d in ("float32", "bfloat16")}
    for (kind, dtype), r in ours.items():
        assert r.ok, r.status
        tol = 1e-4 if dtype == "float32" else 5e-2
        assert r.err_out < tol and r.err_grad < tol, (kind, dtype, r.err_out, r.err_grad)
    assert {r.impl for r in rows if r.workload == "dilated" and r.ok} == {"longattn", "materialized", "composition"}
    assert {r.status for r in rows if r.impl == "flex"} == {"unsupported: GPU only here (compiling for the CPU takes "
                                                            "minutes)"}
    assert "## Accuracy" in (out / "report.md").read_text()


def test_bench_varlen_and_decode_quick_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["bench", "varlen", "decode", "--quick", "--device", "cpu", "--out", str(out), "--no-plots"]) == 0
    rows = [Row.from_json(d) for d in json.loads((out / "results.json").read_text())["rows"]]
    varlen = [r for r in rows if r.suite == "varlen"]
    assert {(r.impl, r.workload, r.pass_) for r in varlen} == {
        (i, w, p) for i in ("longattn", "sdpa") for w in ("varlen-dense", "varlen-causal") for p in ("fwd", "fwd_bwd")}
    decode = [r for r in rows if r.suite == "decode" and r.impl != "copy"]
    assert {r.impl for r in decode} == {"longattn", "longattn-paged", "sdpa"}
    for r in varlen + decode:
        assert r.ok and r.time_ms > 0 and r.speedup > 0, r
    assert all(r.tflops > 0 for r in varlen) and all("TB/s" in r.note for r in decode)
    # The copy of the same K and V: a bound each decode row's note measures itself against, not a peer.
    copy, = [r for r in rows if r.suite == "decode" and r.impl == "copy"]
    assert copy.ok and copy.speedup is None and copy.note.startswith("K+V read and written")
    assert all(r.note.endswith("of the copy bound") for r in decode)
    report = (out / "report.md").read_text()
    assert "## Decode" in report and "## Packed variable-length batch" in report


def test_out_naming_a_file_is_a_usage_error_before_any_suite_runs(tmp_path, capsys, monkeypatch):
    from longattn.bench import suites
    monkeypatch.setattr(suites, "run_suites", None)  # reached only if the check came too late
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        assert cli.main(["bench", "accuracy", "--quick", "--device", "cpu", "--out", str(out), "--no-progress"]) == 2
        assert "is a file; --out must be a directory" in capsys.readouterr().err


def test_out_that_cannot_be_created_and_a_nan_budget_are_usage_errors_before_any_suite_runs(tmp_path, capsys,
                                                                                             monkeypatch):
    import os
    from longattn.bench import suites
    monkeypatch.setattr(suites, "run_suites", None)  # reached only if the check came too late
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # (root writes anywhere: /proc takes no new folder, for anyone)
            locked = "/proc/longattn-bench"
        args = ["bench", "accuracy", "--quick", "--device", "cpu", "--no-progress"]
        assert cli.main(args + ["--out", str(Path(locked) / "out")]) == 2
        assert "cannot be created" in capsys.readouterr().err
    finally:
        Path(tmp_path / "locked").chmod(0o700)
    for budget in ("nan", "inf"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", "accuracy", "--quick", "--device", "cpu", "--no-progress", "--time-budget", budget,
                      "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2 and "--time-budget must be a finite number" in capsys.readouterr().err
