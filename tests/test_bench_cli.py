"""`longattn bench`: interleaved timing of the implementations of one case, rows that ran another row's kernel
("same kernel as"), the maxlen search's consistency and time-cap wording, the refused comparison's exit status, and
the plots (one colour per implementation, coincident lines visible, legend outside the axes). CPU only, fake clocks
and fake implementations where timing is involved."""
import json
import statistics
import time
import types

import pytest
import torch

from longattn import cli
from longattn.bench import decode_suite as DS
from longattn.bench import dispatch_suite as D
from longattn.bench import report as rep
from longattn.bench import suites as S
from longattn.bench import timing as T
from longattn.bench.peers import LongAttn, Peer, SdpaDefault
from longattn.bench.results import Row

CPU = torch.device("cpu")


def _config(peers, device=CPU, **sizes):
    base = dict(heads=2, head_dim=8, speed_n=(64,), speed_tokens=64, memory_n=(64,), scaling_n=(64,),
                scaling_batch_n=64, scaling_batches=(1,), maxlen_start=64, maxlen_cap=1 << 20, maxlen_probe_s=60.0,
                maxlen_budget_s=120.0, accuracy_n=48, accuracy_batch=1, accuracy_heads=2)
    base.update(sizes)
    return S.BenchConfig(device=device, dtype=torch.float32, quick=True, peers=peers, workloads=("dense",),
                         sizes=S.Sizes(**base))


# ------------------------------------------------------------------------------------------- interleaved timing
class _Clock:
    """A fake ``time`` module for :mod:`longattn.bench.timing`: each call of a fake peer advances it."""

    def __init__(self):
        self.now = 0.0
        self.calls = 0
        self.log = []

    def perf_counter(self):
        return self.now


class _Drifting(Peer):
    """Every call costs 10 ms, plus 0.5% per call made before it by any peer: the machine slows down steadily."""

    def __init__(self, name, clock):
        self.name, self.clock = name, clock

    def prepare(self, w, device, dtype):
        def fn(q, k, v):
            c = self.clock
            c.log.append((self.name, torch.is_grad_enabled()))
            c.now += 0.010 * (1 + 0.005 * c.calls)
            c.calls += 1
            return q * 1.0
        return fn


def test_speed_rows_are_timed_in_interleaved_rounds_and_the_spread_shows_the_drift(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    rows = S.run_speed(_config([_Drifting("a", clock), _Drifting("b", clock)]))
    fwd = {r.impl: r for r in rows if r.pass_ == "fwd"}
    assert set(fwd) == {"a", "b"} and all(r.ok for r in fwd.values())
    # the forward case's calls: the two peers take turns (round r: a's calls, then b's), not a's then b's
    names = [name for name, grad in clock.log if not grad]
    blocks = 1 + sum(x != y for x, y in zip(names, names[1:]))
    assert blocks >= 2 * 3  # three rounds
    # the same cost, timed in turns: the rows agree within their ±, and the ± is the drift between rounds (several
    # calls' worth of 0.5%), not the spread within one round
    a, b = fwd["a"], fwd["b"]
    assert abs(a.time_ms - b.time_ms) <= min(a.spread_ms, b.spread_ms)
    assert a.spread_ms > 0.005 * 10.0 * 4


def test_time_in_turns_takes_turns_and_reports_the_spread_across_rounds():
    order = []
    drift = {"n": 0}

    def timer(step):  # each measurement 1 ms later than the one before: a steady drift
        order.append(step)
        drift["n"] += 1
        return {"x": 10.0, "y": 20.0, "z": 30.0}[step] + drift["n"]

    times = T.time_in_turns({"x": "x", "y": "y", "z": "z"}, CPU, True, rounds=3, timer=timer)
    assert order == ["x", "y", "z", "y", "z", "x", "z", "x", "y"]  # (round_order)
    # measurement i (from 1) reads i ms late: x at 1, 6, 8; y at 2, 4, 9; z at 3, 5, 7
    assert [times[s].median_ms for s in "xyz"] == [10.0 + 6, 20.0 + 4, 30.0 + 5]
    assert [times[s].spread_ms for s in "xyz"] == [3.5, 3.5, 2.0]  # half the range across rounds
    with pytest.raises(ValueError, match="rounds"):
        T.time_in_turns({"x": "x"}, CPU, True, rounds=0, timer=timer)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_order_puts_every_step_right_after_every_other_equally_often(n):
    names = [f"s{i}" for i in range(n)]
    rounds = n if n % 2 == 0 else 2 * n
    follows, places = {}, {}
    for r in range(rounds):
        row = T.round_order(names, r)
        assert sorted(row) == names
        for a, b in zip(row, row[1:]):
            follows[a, b] = follows.get((a, b), 0) + 1
        for i, s in enumerate(row):
            places[s, i] = places.get((s, i), 0) + 1
    if n > 1:
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    assert len(places) == n * n and len(set(places.values())) == 1
    assert T.round_order([], 3) == []


def test_a_step_failing_in_a_later_round_is_reported_not_raised():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 1:
            raise MemoryError()

    failed = {}
    times = T.time_in_turns({"ok": lambda: None, "flaky": flaky}, CPU, True, rounds=2, timer=lambda s: s() or 1.0,
                            failed=failed)
    assert set(times) == {"ok"} and isinstance(failed["flaky"], MemoryError)


# ----------------------------------------------------------------------------------------- same kernel as a peer
def test_longattn_running_sdpa_repeats_the_sdpa_row_and_says_so():
    """On a CPU backend='auto' runs SDPA's default kernel for dense attention: the longattn row is not a second
    measurement of it but the sdpa row's, labelled."""
    cfg = _config([LongAttn(), SdpaDefault()])
    rows = S.run_speed(cfg) + S.run_memory(cfg)
    for r in rows:
        assert r.ok, r
    for suite in ("speed", "memory"):
        for pass_ in T.PASSES:
            ours, theirs = (next(r for r in rows if (r.suite, r.impl, r.pass_) == (suite, name, pass_))
                            for name in ("longattn", "sdpa"))
            assert ours.same_as == "sdpa" and not theirs.same_as and ours.note == "sdpa"  # the kernel auto ran
            assert (ours.time_ms, ours.spread_ms, ours.peak_mb) == (theirs.time_ms, theirs.spread_ms, theirs.peak_mb)
    text = rep.terminal_report({}, rows)
    speed_line = next(line for line in text.splitlines() if line.startswith("longattn ") and "fwd " in line)
    assert "same kernel as sdpa" in speed_line
    memory_table = text.split("== Memory")[1]
    assert "ok, same kernel as sdpa" in memory_table
    md = rep.markdown_report({}, rows)
    assert "| longattn | dense | 64 | 1 | fwd | same kernel as sdpa |" in md


def test_a_peer_whose_kernel_is_another_rows_is_never_run():
    class Twin(Peer):
        name = "twin"
        calls = 0

        def prepare(self, w, device, dtype):
            def fn(q, k, v):
                Twin.calls += 1
                return q * 1.0
            return fn

        def same_kernel_as(self, w, device, dtype, pass_):
            return "sdpa"

    rows = S.run_speed(_config([Twin(), SdpaDefault()]))
    assert Twin.calls == 0 and {r.same_as for r in rows if r.impl == "twin"} == {"sdpa"}
    # without the row it names, the peer is measured on its own
    alone = S.run_speed(_config([Twin()]))
    assert Twin.calls > 0 and all(r.ok and not r.same_as and r.time_ms for r in alone)


def test_dispatch_longattn_row_is_the_sdpa_row_where_auto_runs_sdpa(monkeypatch):
    monkeypatch.setattr(D, "cases", lambda device, quick: [(64, False, False, 128, 1)])
    monkeypatch.setattr(D, "decode_cases", lambda device, quick: [])
    rows = D.run_dispatch(_config([]))
    for pass_ in T.PASSES:
        ours, theirs = (next(r for r in rows if r.impl == name and r.pass_ == pass_) for name in ("longattn", "sdpa"))
        assert ours.same_as == "sdpa" and ours.time_ms == theirs.time_ms and ours.note == "auto ran sdpa"
    assert "same kernel as sdpa" in rep.terminal_table("dispatch", rows)


def test_dispatch_times_decode_against_sdpa_and_labels_auto(monkeypatch):
    """One new token against a contiguous cache of an int length: SDPA's default is timed, the auto row names the
    kernel auto ran and repeats that row (SDPA on a CPU; our kernel's row where auto runs ours)."""
    monkeypatch.setattr(D, "cases", lambda device, quick: [])
    monkeypatch.setattr(D, "decode_cases", lambda device, quick: [(2, 64, 4, 2, 8), (1, 96, 4, 4, 8)])
    rows = D.run_dispatch(_config([]))
    assert {(r.impl, r.workload, r.pass_, r.n, r.batch) for r in rows} == {
        (impl, w, "decode", n, b) for impl in ("sdpa", "longattn") for w, n, b in (("decode-gqa", 64, 2),
                                                                                   ("decode", 96, 1))}
    for w in ("decode-gqa", "decode"):
        ours, theirs = (next(r for r in rows if r.impl == name and r.workload == w) for name in ("longattn", "sdpa"))
        assert theirs.ok and theirs.time_ms > 0 and not theirs.same_as
        assert ours.note == "auto ran sdpa" and ours.same_as == "sdpa" and ours.time_ms == theirs.time_ms
    # where auto runs our kernel, the auto row is that kernel's row
    impls = D._decode_impls
    monkeypatch.setattr(D, "_decode_impls", lambda q, k, v: {**impls(q, k, v), "longattn-triton": lambda: None})
    monkeypatch.setattr(D, "auto_decode_backend", lambda q, k_cache, cache_seqlens: "triton")
    monkeypatch.setattr(D, "decode_cases", lambda device, quick: [(2, 64, 4, 2, 8)])
    rows = D.run_dispatch(_config([]))
    ours, forced = (next(r for r in rows if r.impl == name) for name in ("longattn", "longattn-triton"))
    assert ours.note == "auto ran triton" and ours.same_as == "longattn-triton" and ours.time_ms == forced.time_ms
    assert "decode-gqa" in rep.terminal_table("dispatch", rows)


def _dispatch_row(impl, workload, pass_, n, batch, ms, d=128):
    return Row(suite="dispatch", impl=impl, workload=workload, n=n, batch=batch, heads=32, head_dim=d,
               dtype="bfloat16", pass_=pass_, time_ms=ms)


def test_derive_table_fills_decode_entries_from_every_batch_and_length():
    """Decode rows of one cache length differ by batch: our kernel gets the entry only if it won every row."""
    won_all = [_dispatch_row(impl, "decode-gqa", "decode", 4096, b, ms) for b in (1, 32)
               for impl, ms in (("sdpa", 1.0), ("longattn-triton", 0.9))]
    lost_one = [_dispatch_row("sdpa", "decode-gqa", "decode", 4096, 32, 1.0),
                _dispatch_row("longattn-triton", "decode-gqa", "decode", 4096, 32, 1.1),
                _dispatch_row("sdpa", "decode-gqa", "decode", 4096, 1, 1.0),
                _dispatch_row("longattn-triton", "decode-gqa", "decode", 4096, 1, 0.9)]
    key = ("sm90", "decode", False, True, 128)
    assert D.derive_table(won_all, "sm90") == {key: "triton"}
    assert D.derive_table(lost_one, "sm90") == {key: "sdpa"}
    dense = [_dispatch_row("sdpa", "causal", "fwd", 1024, 16, 1.0, d=64),
             _dispatch_row("longattn-triton", "causal", "fwd", 1024, 16, 0.5, d=64)]
    assert D.derive_table(dense + lost_one, "sm90") == {key: "sdpa", ("sm90", "fwd", True, False, 64): "triton"}


def test_decode_suite_names_the_kernel_auto_ran(monkeypatch):
    """One new token, cache length an int: auto runs SDPA's default on a CPU, and the longattn row is the sdpa row;
    several new tokens: the PyTorch backend, timed on its own. Every longattn row says which kernel ran."""
    monkeypatch.setattr(DS, "cases", lambda device, quick: [(2, 128, 1, 4, 2, 8), (2, 128, 2, 4, 2, 8)])
    rows = DS.run_decode(_config([]))
    by = {(r.impl, r.workload): r for r in rows}
    assert set(by) == {(i, w) for i in ("longattn", "longattn-paged", "sdpa", "copy")
                       for w in ("decode-nq1", "decode-nq2")}
    one, sdpa = by["longattn", "decode-nq1"], by["sdpa", "decode-nq1"]
    assert one.same_as == "sdpa" and one.time_ms == sdpa.time_ms and one.note.startswith("auto ran sdpa, K+V ")
    # The copy of the same K and V: half its time is the bound each row's note measures itself against.
    copy = by["copy", "decode-nq1"]
    assert copy.ok and copy.note.startswith("K+V read and written ")
    bound = copy.time_ms / 2 / sdpa.time_ms
    assert sdpa.note.endswith(f", {bound:.2f} of the copy bound") and "copy bound" not in copy.note
    two = by["longattn", "decode-nq2"]
    assert not two.same_as and two.ok and two.time_ms > 0 and two.note.startswith("auto ran torch, K+V ")
    assert all(by["longattn-paged", w].note.startswith("auto ran torch, ") for w in ("decode-nq1", "decode-nq2"))
    assert "same kernel as sdpa" in rep.terminal_table("decode", rows)


@pytest.mark.parametrize("n_new, lengths, paged", [(1, "int", False), (1, "tensor", False), (2, "int", False),
                                                   (1, "int", True), (1, "tensor", True)])
def test_auto_decode_backend_is_what_flash_attention_with_kvcache_runs(monkeypatch, n_new, lengths, paged):
    import longattn
    from longattn import runner

    ran = []
    decode = runner.decode
    monkeypatch.setattr(runner, "decode", lambda impl, *a, **kw: ran.append(impl) or decode(impl, *a, **kw))
    q = torch.randn(2, n_new, 4, 8)
    k_cache, v_cache = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    table = None
    if paged:
        k_cache, v_cache, table = DS.paged_copy(k_cache, v_cache, 8, torch.Generator().manual_seed(0))
    seqlens = 12 if lengths == "int" else torch.full((2,), 12, dtype=torch.int32)
    longattn.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    assert ran == [DS.auto_decode_backend(q, k_cache, cache_seqlens=seqlens, block_table=table)]


# ------------------------------------------------------------------------------------------------------- maxlen
class _Kernel:
    """A fake kernel that compiles once per sequence length (50 ms) and runs out of memory beyond 4096."""

    def __init__(self):
        self.compiled = set()
        self.calls = {}

    def peer(self, name, same_as=None):
        kernel = self

        class P(Peer):
            def prepare(self, w, device, dtype):
                def fn(q, k, v):
                    kernel.calls[name] = kernel.calls.get(name, 0) + 1
                    if w.n > 4096:
                        raise MemoryError()
                    if w.n not in kernel.compiled:
                        time.sleep(0.05)
                        kernel.compiled.add(w.n)
                    return q * 1.0
                return fn

            def same_kernel_as(self, w, device, dtype, pass_):
                return same_as

        p = P()
        p.name = name
        return p


def test_maxlen_rows_running_one_kernel_get_one_answer_and_time_caps_say_so(monkeypatch):
    """The first row searched pays the compilations out of its time budget; a row running the same kernel must not
    get a shorter answer for that: it repeats the searched row's. A search the time budget stopped says so."""
    kernel = _Kernel()
    tiny = torch.zeros(1, 1, 1, 8)
    monkeypatch.setattr(S, "make_inputs", lambda w, device, dtype, seed=0: (tiny, tiny, tiny))
    # maxlen is skipped on a CPU: a device that is not one, the fake kernel needs none
    cfg = _config([kernel.peer("auto", same_as="forced"), kernel.peer("forced")], device=torch.device("meta"),
                  maxlen_budget_s=0.2)
    rows = S.run_maxlen(cfg)
    assert [r.impl for r in rows] == ["auto", "forced", "auto", "forced"]
    for pass_ in T.PASSES:
        auto, forced = (next(r for r in rows if r.impl == name and r.pass_ == pass_) for name in ("auto", "forced"))
        assert (auto.max_n, auto.note, auto.status) == (forced.max_n, forced.note, forced.status)
        assert auto.same_as == "forced"
    assert "auto" not in kernel.calls
    capped = next(r for r in rows if r.impl == "forced" and r.pass_ == "fwd")
    assert capped.note.startswith("time budget, not memory: the search used its 0.2 s"), capped.note
    table = rep.terminal_table("maxlen", rows, status_width=80)
    assert "time budget, not memory" in table and "ok, same kernel as forced" in table


def test_maxlen_says_which_time_limit_stopped_it_and_does_not_count_compilation():
    class Slow(Peer):
        name = "slow"

        def prepare(self, w, device, dtype):
            return lambda q, k, v: time.sleep(0.1) or q * 1.0

    slow = Slow()
    row = S.find_maxlen(slow, "dense", "fwd", _config([slow], maxlen_probe_s=0.03))
    assert row.max_n == 64 and row.note.startswith("time budget, not memory: one call at N=64 took")
    # a kernel compiling at every new length (a slow first call, fast ones after) is limited by memory
    compiling = _Kernel().peer("compiling")
    row = S.find_maxlen(compiling, "dense", "fwd", _config([compiling], maxlen_probe_s=0.03))
    assert 4096 * 7 // 8 <= row.max_n <= 4096 and row.note.startswith("oom at"), row.note


# ------------------------------------------------------------------------------------------- refused comparison
def test_refused_comparison_exit_status_is_distinct(tmp_path, capsys, monkeypatch):
    from longattn.bench import stability

    monkeypatch.setattr(stability, "assess", lambda before, rows: {"unstable": True, "reasons": ["load average 9.0"]})
    argv = ["bench", "accuracy", "--quick", "--device", "cpu", "--impl", "materialized", "--workload", "dense",
            "--no-plots", "--no-progress"]
    baseline = tmp_path / "baseline.json"  # a stable baseline: this run's instability alone refuses
    baseline.write_text(json.dumps(rep.to_json({"stability": {"unstable": False}}, [
        Row(suite="scaling", impl="materialized", workload="dense", n=256, batch=1, heads=4, head_dim=32,
            dtype="float32", pass_="fwd", time_ms=1e-9, sweep="N")])))
    baseline = str(baseline)
    status = cli.main(argv + ["--out", str(tmp_path / "b"), "--compare", baseline, "--fail-on-regression"])
    assert status == 3 and status not in (0, cli.EXIT_REGRESSION, cli.EXIT_USAGE) and cli.EXIT_REFUSED == 3
    out, err = capsys.readouterr()
    assert "not compared" in out and "load average 9.0" in out
    assert "comparison refused" in err and "exit status 3" in err
    assert "Not compared" in (tmp_path / "b" / "report.md").read_text()
    assert json.loads((tmp_path / "b" / "results.json").read_text())["meta"]["compare_refused"]
    # without --fail-on-regression the comparison only informs
    assert cli.main(argv + ["--out", str(tmp_path / "c"), "--compare", baseline]) == 0


def test_help_documents_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "1 with --fail-on-regression when --compare flags regressions" in text
    assert "3 with --fail-on-regression when the comparison is refused" in text


# ------------------------------------------------------------------------------------------------------- plots
def _plot_row(suite, impl, kind, n, pass_, **kw):
    return Row(suite=suite, impl=impl, workload=kind, n=n, batch=1, heads=2, head_dim=8, dtype="float32",
               pass_=pass_, **kw)


def _plot_rows():
    rows = []
    for kind in ("dense", "dilated"):
        for n in (256, 512, 1024):
            for i, impl in enumerate(("longattn", "sdpa-flash", "materialized")):  # scaling's set
                rows.append(_plot_row("scaling", impl, kind, n, "fwd", time_ms=(i + 1) * n / 100, sweep="N"))
            for pass_ in ("fwd", "fwd_bwd"):
                for i, impl in enumerate(("sdpa", "sdpa-math", "materialized", "sdpa-flash")):
                    rows.append(_plot_row("memory", impl, kind, n, pass_, mb_per_token=(i + 1) * 1e-3 * n))
                # longattn ran sdpa's kernel: exactly the sdpa line
                rows.append(_plot_row("memory", "longattn", kind, n, pass_, mb_per_token=1e-3 * n))
                rows[-1].same_as = "sdpa"
    return rows


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """The figures ``make_plots`` saves, drawn (Agg)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved = {}
    real = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        saved[str(path).rsplit("/", 1)[-1]] = fig
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    from longattn.bench.plots import make_plots

    written, _ = make_plots(_plot_rows(), tmp_path)
    assert {p.rsplit("/", 1)[-1] for p in written} == {"time_vs_n.png", "memory_vs_n.png"}
    return saved


def _lines(fig):
    """``[(axes, impl, line)]`` of the data lines (labels are ``impl`` or ``impl pass``)."""
    return [(ax, line.get_label().split()[0], line) for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")]


def test_plots_give_an_implementation_one_colour_everywhere(figures):
    from matplotlib.colors import to_hex

    colours = {}
    for name in ("time_vs_n.png", "memory_vs_n.png"):
        for _, impl, line in _lines(figures[name]):
            colours.setdefault(impl, set()).add(to_hex(line.get_color()))
    assert {"longattn", "sdpa-flash", "materialized", "sdpa", "sdpa-math"} <= set(colours)
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours)  # and different implementations differ


def _points(ax, impl):
    """``{N: (marker hollow?, size)}`` of ``impl``'s markers and ``[(N0, N1, dashed?)]`` of its segments in ``ax``."""
    marks, segments = {}, []
    for line in ax.get_lines():
        label = line.get_label()
        if label == impl:
            for x in line.get_xdata():
                marks[x] = (line.get_markerfacecolor() == "none", line.get_markersize())
        elif label == f"_{impl} segment":
            x0, x1 = line.get_xdata()
            segments.append((x0, x1, line.get_linestyle() != "-"))
    return marks, sorted(segments)


def test_plots_keep_coincident_lines_visible(figures):
    fig = figures["memory_vs_n.png"]
    assert fig.axes
    for ax in fig.axes:
        ours, sdpa = _points(ax, "longattn"), _points(ax, "sdpa")
        assert set(ours[0]) == set(sdpa[0]) == {256, 512, 1024}  # the same values: one line lies on the other
        assert all(hollow for hollow, _ in ours[0].values()) and not any(h for h, _ in sdpa[0].values())
        assert all(dashed for *_, dashed in ours[1]) and not any(dashed for *_, dashed in sdpa[1])


def test_plots_decide_overlap_point_by_point(tmp_path):
    """Two lines meeting at one N lie on each other there only: hollow markers at that N, solid lines elsewhere."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from longattn.bench import plots

    crossing = {256: (1.0, 4.0), 512: (2.0, 2.0), 1024: (4.0, 1.0)}  # materialized rises, sdpa-flash falls
    rows = [_plot_row("scaling", impl, "dense", n, "fwd", time_ms=ys[i], sweep="N")
            for n, ys in crossing.items() for i, impl in enumerate(("sdpa-flash", "materialized"))]
    series = plots._series(rows, lambda r: r.time_ms)
    assert plots.point_depths(series, ["sdpa-flash", "materialized"]) == {"sdpa-flash": [0, 0, 0],
                                                                          "materialized": [0, 1, 0]}
    fig = plots.loglog_figure(plt, rows, lambda r: r.time_ms, "time (ms)", "t")
    marks, segments = _points(fig.axes[0], "materialized")
    assert [marks[n][0] for n in (256, 512, 1024)] == [False, True, False]
    assert marks[512][1] > marks[256][1]
    assert not any(dashed for *_, dashed in segments)  # no segment lies on the other line
    plt.close(fig)


def test_tflops_bars_of_sparse_workloads_stay_visible(tmp_path):
    """Dense attention at hundreds of TFLOP/s beside block-sparse at a few hundredths: a log axis, every bar at
    least a tenth of the tallest's height on screen."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from longattn.bench import plots

    tflops = {"dense": 400.0, "window": 3.0, "dilated": 1.0, "block_sparse": 0.02}
    rows = [_plot_row("speed", impl, kind, 4096, pass_, tflops=t * (1 + i))
            for kind, t in tflops.items() for pass_ in ("fwd", "fwd_bwd")
            for i, impl in enumerate(("longattn", "materialized"))]
    fig = plots.tflops_figure(plt, rows)
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        heights = [p.get_window_extent().height for p in ax.patches]
        assert len(heights) == 8 and min(heights) >= 0.1 * max(heights), heights
    plt.close(fig)


def test_the_unstable_warning_reaches_every_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from longattn.bench.plots import make_plots

    texts = {}
    real = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        texts[str(path).rsplit("/", 1)[-1]] = " ".join(t.get_text() for t in fig.texts)
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    rows = _plot_rows() + [_plot_row("speed", "longattn", "dense", 256, "fwd", tflops=1.0)]
    warning = "WARNING: unstable machine, timings unreliable: load average 9.0"
    written, _ = make_plots(rows, tmp_path, [warning])
    assert len(written) == 3 and set(texts) == {"time_vs_n.png", "memory_vs_n.png", "tflops.png"}
    assert all(warning in text for text in texts.values()), texts


def test_plot_legends_lie_outside_the_axes(figures):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for name, fig in figures.items():
        canvas = FigureCanvasAgg(fig)  # make_plots closed the figure, taking its canvas
        canvas.draw()
        renderer = canvas.get_renderer()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert legends, name
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), name


@pytest.mark.parametrize("suite", ["speed", "decode", "score_mods", "models"])
def test_markdown_table_shows_each_note_once(suite):
    """Suites whose columns include the note (decode, score_mods, models) get no second note column in the
    Markdown report; the others get one."""
    row = Row(suite=suite, impl="longattn", workload="dense", n=256, batch=1, heads=2, head_dim=8, dtype="float32",
              pass_="fwd", note="a note")
    table = rep.markdown_table(suite, [row])
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header.count("note") == 1
    assert table.count("a note") == 1


def test_paired_ratio_cancels_a_clock_shared_by_the_steps_of_a_round(monkeypatch):
    """Each round runs at its own clock (1x, 1.5x, 1x, 2x slower) shared by its steps; b takes 5 ms, a about 4 with
    a little noise of its own. The ratio of medians (6.25 / 5.075) misses b's 1.25x of a's per round; the median of
    the per-round ratios keeps it. A step that fails on its first call has no samples and a NaN ratio."""
    from longattn.bench import interleaved as I

    clocks = {"a": iter([1.0, 1.5, 1.0, 2.0]), "b": iter([1.0, 1.5, 1.0, 2.0])}
    own = {"a": iter([4.0, 4.0, 4.1, 3.9, 4.0]), "b": iter([5.0] * 5)}  # (the first: the warm-up call)
    monkeypatch.setattr(I, "bench_ms", lambda step, **kw: step() * next(clocks[step.name]))
    monkeypatch.setattr(I.torch.cuda, "synchronize", lambda: None)

    def step(name):
        def run():
            if name == "c":
                raise RuntimeError("no kernel")
            return next(own[name])
        run.name = name
        return run

    samples = I.time_rounds({n: step(n) for n in "abc"}, rounds=4)
    assert samples["a"] == [4.0, 4.1 * 1.5, 3.9, 8.0] and samples["b"] == [5.0, 7.5, 5.0, 10.0]
    assert samples["c"] == []
    assert I.paired_ratio(samples, "b", "a") == 1.25
    assert abs(statistics.median(samples["b"]) / statistics.median(samples["a"]) - 1.25) > 0.01  # (the medians')
    assert I.paired_ratio(samples, "c", "a") != I.paired_ratio(samples, "c", "a")  # NaN
