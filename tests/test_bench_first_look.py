"""`longattn bench --quick` on a GPU as a user's first look: the plan it runs (asked of the suites with a "cuda"
device description, nothing run), the line announcing each compilation and the compilation time said once at the
end, and the time budget that stops a run from starting more cases. CPU only: compilation is a fake peer's slow
first call."""
import io
import json
import time

import pytest
import torch

from longattn import cli
from longattn.bench import quick as Q
from longattn.bench import suites as S
from longattn.bench.first_calls import TRITON, FirstCalls
from longattn.bench.peers import Peer, all_peers
from longattn.bench.progress import Progress

GPU = torch.device("cuda")  # a description only: nothing here touches a GPU
CPU = torch.device("cpu")


def _gpu_config(**kw):
    peers = [p for p in all_peers() if p.name not in cli.GPU_OPT_IN]
    return S.BenchConfig(device=GPU, dtype=torch.bfloat16, quick=True, peers=peers, **kw)


# ------------------------------------------------------------------------------------------------------ the plan
def test_gpu_quick_runs_a_few_rows_compiling_a_handful_of_kernel_variants():
    cfg = _gpu_config()
    suites = Q.default_suites(GPU, True, cli.ALL)
    assert suites == ["speed", "memory", "varlen", "decode"]
    jobs = S.planned_jobs(cfg, suites)
    assert len(jobs) <= 16, jobs
    assert not [j for j in jobs if j[1] in ("flex", "composition", "sdpa-efficient")]  # compile or add nothing new
    assert {(s, w, p) for s, _, w, p, _ in jobs} == {
        ("speed", "dense", "fwd"), ("speed", "causal", "fwd_bwd"), ("memory", "dense", "fwd"),
        ("varlen", "varlen-causal", "fwd"), ("decode", "decode-nq1", "fwd")}
    assert len(Q.triton_variants(jobs)) <= 5  # each a first call that compiles our kernels (seconds each)
    assert {n for s, _, _, _, n in jobs if s == "speed"} == {4096}
    # the full quick sizes, for comparison: every workload, both passes, flex among the implementations
    unplanned = _gpu_config()
    unplanned.plan = None
    full = S.planned_jobs(unplanned, ["speed", "memory", "varlen", "decode"])
    assert len(Q.triton_variants(full)) >= 3 * len(Q.triton_variants(jobs)) and any(j[1] == "flex" for j in full)


def test_gpu_quick_follows_impl_and_workload_choices():
    chosen = [p for p in all_peers() if p.name in ("sdpa", "materialized")]
    cfg = _gpu_config(impl_chosen=True)
    cfg.peers = chosen
    assert {j[1] for j in S.planned_jobs(cfg, ["speed"])} == {"sdpa", "materialized"}
    cfg = _gpu_config(workloads=("window",))
    assert {(j[2], j[3]) for j in S.planned_jobs(cfg, ["speed", "memory"])} == {("window", "fwd")}


def test_cpu_quick_and_gpu_full_runs_keep_every_suite_and_no_budget():
    assert Q.default_suites(CPU, True, cli.ALL) == list(cli.ALL)
    assert Q.default_suites(GPU, False, cli.ALL) == list(cli.ALL)
    assert Q.default_budget(CPU, True) is None and Q.default_budget(GPU, False) is None
    assert Q.default_budget(GPU, True) == Q.GPU_QUICK_BUDGET_S <= 60


def test_the_command_line_picks_the_plan_and_the_budget_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = cli.parse_args(["bench", "--quick"])
    assert (args.device, args.suites, args.time_budget) == ("cuda", ["speed", "memory", "varlen", "decode"], 60.0)
    args = cli.parse_args(["bench", "maxlen", "--quick", "--time-budget", "0"])  # named: run; 0: no limit
    assert (args.suites, args.time_budget) == (["maxlen"], None)
    assert cli.parse_args(["bench", "all", "--quick"]).suites == list(cli.ALL)
    assert cli.parse_args(["bench"]).time_budget is None


# ------------------------------------------------------------------------------------------- compilation, said
class _Compiling(Peer):
    """A kernel whose first call of each variant "compiles" (sleeps), fast afterwards."""

    name = "compiling"

    def __init__(self, delay=0.3):
        self.delay, self.compiled = delay, set()

    def compile_key(self, w, device, dtype, pass_):
        return (TRITON, w.kind, pass_)

    def prepare(self, w, device, dtype):
        def fn(q, k, v):
            if (w.kind, torch.is_grad_enabled()) not in self.compiled:
                self.compiled.add((w.kind, torch.is_grad_enabled()))
                time.sleep(self.delay)
            return q * 1.0
        return fn


def test_a_compiling_first_call_is_announced_once_and_its_time_summed():
    stream = io.StringIO()
    sizes = S.sizes_for(CPU, True)
    cfg = S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=[_Compiling()], workloads=("dense",),
                        progress=Progress(stream=stream), sizes=S.Sizes(**{**sizes.__dict__, "speed_n": (64, 128)}))
    rows = S.run_speed(cfg)
    assert all(r.ok for r in rows) and len(rows) == 4
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("compiling")]
    # one line per variant (dense forward, dense forward+backward), not per size
    assert lines == ["compiling Triton/Gluon kernels for compiling dense N=64 fwd (first call, once)...",
                     "compiling Triton/Gluon kernels for compiling dense N=64 fwd_bwd (first call, once)..."]
    assert 0.5 <= cfg.first_calls.total_s() < 1.5
    summary = cfg.first_calls.summary(12.3)
    assert summary.startswith("first-call compilation took 0.") and "of the 12.3 s" in summary
    assert FirstCalls().summary(5.0) == ""  # nothing compiled (a CPU): nothing said


def test_the_run_says_the_compilation_time_once_at_the_end(tmp_path, capsys, monkeypatch):
    from longattn.bench import peers

    monkeypatch.setattr(peers, "all_peers", lambda: [_Compiling(0.2)])
    argv = ["bench", "speed", "--quick", "--device", "cpu", "--workload", "dense", "--out", str(tmp_path),
            "--no-plots"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err.count("compiling Triton/Gluon kernels for") == 2
    assert out.count("first-call compilation took") == 1
    assert out.index("first-call compilation took") > out.index("== Speed")  # at the end, after the tables
    assert "first-call compilation took" in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------------------------------------- the time budget
def test_a_spent_time_budget_skips_the_remaining_cases_and_says_so(tmp_path, capsys):
    argv = ["bench", "speed", "--quick", "--device", "cpu", "--impl", "materialized", "--workload", "dense",
            "--time-budget", "0.000001", "--out", str(tmp_path), "--no-plots", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) < 4  # 2 lengths x 2 passes without the budget
    assert f"time budget of 1e-06 s used up: not run: speed {4 - len(rows)} case" in out


def test_the_budget_counts_refused_cases_per_suite():
    budget = Q.TimeBudget(None)
    assert budget.allow("speed") and budget.summary() == ""
    budget = Q.TimeBudget(0.0, start=time.perf_counter() - 1)
    assert not budget.allow("speed") and not budget.allow("speed") and not budget.allow("decode")
    assert budget.skipped == {"speed": 2, "decode": 1}
    assert "not run: speed 2 cases, decode 1 case" in budget.summary()


@pytest.mark.parametrize("suite", ["varlen", "decode", "dispatch", "accuracy", "scaling", "memory", "score_mods",
                                   "models"])
def test_every_suite_stops_at_the_budget(suite):
    cfg = S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=all_peers(),
                        workloads=None if suite == "models" else ("dense",),  # (the models suite's are models)
                        budget=Q.TimeBudget(0.0, start=time.perf_counter() - 1))
    assert S.run_suites([suite], cfg) == [] and cfg.budget.skipped[suite] >= 1


def test_the_gpu_plan_runs_end_to_end(tmp_path):
    """The plan's suites run with it (here on a CPU, at N = 256): one row per planned job that runs on this device,
    the plan's implementations only, no sinks in decode."""
    from dataclasses import replace

    plan = tuple(replace(c, n=256) if c.suite in ("speed", "memory") else c for c in Q.GPU_QUICK_PLAN)
    cfg = S.BenchConfig(device=CPU, dtype=torch.float32, quick=True, peers=all_peers(), plan=plan)
    rows = S.run_suites(["speed", "memory", "varlen", "decode"], cfg)
    ran = {(r.suite, r.impl, r.workload, r.pass_) for r in rows if not r.status.startswith("unsupported")}
    assert ran == {(s, i, w, p) for s, i, w, p, _ in S.planned_jobs(cfg, ["speed", "memory", "varlen", "decode"])
                   if i != "longattn-triton"}  # (our kernels forced: GPU only)
    assert all(r.ok for r in rows if not r.status.startswith("unsupported")), [r for r in rows if not r.ok]
