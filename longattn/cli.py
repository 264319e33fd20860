"""The ``longattn`` command line (also ``python -m longattn``).

``longattn bench [SUITE ...] [--quick] [--device cuda|cpu] [--dtype float16|bfloat16|float32] [--out DIR]
[--compare BASELINE.json] [--time-budget SECONDS] ...`` runs the benchmark suites (on a GPU, ``--quick`` without named
suites: a first look, :mod:`longattn.bench.quick`), prints a table per suite, and writes ``report.md``,
``results.json`` and PNG plots into ``--out``. See ``docs/cli.md``.

Exit status: 0 on success (also when implementations fail: their rows say so); 1 (:data:`EXIT_REGRESSION`) when
``--fail-on-regression`` is given and ``--compare`` found regressions; 2 (:data:`EXIT_USAGE`) for invalid arguments;
3 (:data:`EXIT_REFUSED`) when ``--fail-on-regression`` is given and the comparison was refused because this run or
the baseline was marked unstable (nothing was checked, so a CI gate must not pass).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

SUITES = ("speed", "memory", "maxlen", "scaling", "accuracy", "dispatch", "varlen", "decode", "score_mods",
          "models")
# "all": every suite but score_mods, which compiles a dozen FlexAttention graphs, and models, which trains models
# built with transformers: both are run by name, so that the default run stays as long as the README's "Measured
# times" says.
BY_NAME_ONLY = ("score_mods", "models")
ALL = tuple(s for s in SUITES if s not in BY_NAME_ONLY)
DTYPES = ("float16", "bfloat16", "float32")
DEVICES = ("cuda", "cpu")


GPU_OPT_IN = ("sdpa-math",)  # implementations a GPU run includes only when --impl names them

EXIT_REGRESSION = 1  # --fail-on-regression: --compare flagged rows
EXIT_USAGE = 2  # invalid arguments, unreadable --compare file (argparse's own status for usage errors)
EXIT_REFUSED = 3  # --fail-on-regression: --compare refused (this run or the baseline unstable): nothing was checked
EXIT_STATUS_HELP = (f"Exit status: 0 when the run completes (failing implementations are rows of the tables); "
                    f"{EXIT_REGRESSION} with --fail-on-regression when --compare flags regressions; {EXIT_USAGE} for "
                    f"invalid arguments or an unreadable --compare file; {EXIT_REFUSED} with --fail-on-regression "
                    f"when the comparison is refused because this run or the baseline was marked unstable.")


def _csv_list(text: str) -> List[str]:
    return [t for t in (s.strip() for s in text.split(",")) if t]


def build_parser() -> argparse.ArgumentParser:
    from longattn import __version__

    parser = argparse.ArgumentParser(prog="longattn", description="longattn: exact attention for long sequences.")
    parser.add_argument("--version", action="version", version=f"longattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser(
        "bench", help="benchmark longattn against SDPA, FlexAttention and plain attention",
        description="Benchmark longattn against the attention implementations present on this machine. "
                    f"Suites: {', '.join(SUITES)} (default: all, which is every suite but "
                    f"{' and '.join(BY_NAME_ONLY)}).",
        epilog=EXIT_STATUS_HELP)
    bench.add_argument("suites", nargs="*", metavar="SUITE", help=f"suites to run: {', '.join(SUITES)} or all")
    bench.add_argument("--quick", action="store_true",
                       help="small sizes and short timing windows; on a GPU without named suites, a first look: a "
                            "few rows of speed, memory, varlen and decode, within a time budget (times: the "
                            "README's \"Measured times\")")
    bench.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                       help="stop starting new cases after this many seconds of measuring and list what was not "
                            "run (default: 60 for --quick on a GPU, no limit otherwise; 0: no limit)")
    bench.add_argument("--device", choices=DEVICES, default=None, help="default: cuda if available, else cpu")
    bench.add_argument("--dtype", choices=DTYPES, default=None,
                       help="input dtype; default bfloat16 on cuda, float32 on cpu")
    bench.add_argument("--out", default="longattn-bench", metavar="DIR",
                       help="directory for report.md, results.json and plots (default: ./longattn-bench)")
    bench.add_argument("--compare", metavar="BASELINE.json", default=None,
                       help="flag rows more than --threshold slower than this earlier results.json")
    bench.add_argument("--threshold", type=float, default=0.10,
                       help="relative slow-down flagged by --compare (default 0.10 = 10%%)")
    bench.add_argument("--fail-on-regression", action="store_true",
                       help=f"exit with status {EXIT_REGRESSION} when --compare flags any row, {EXIT_REFUSED} when it "
                            "refuses to compare (this run or the baseline was on an unstable machine)")
    bench.add_argument("--impl", type=_csv_list, action="append", default=None, metavar="NAMES",
                       help="comma-separated implementations to run in the speed, memory, maxlen, scaling and accuracy "
                            "suites (default: all; on a GPU all but sdpa-math); the other suites run their own rows")
    bench.add_argument("--workload", type=_csv_list, action="append", default=None, metavar="NAMES",
                       help="comma-separated workloads of the speed, memory, maxlen, scaling and accuracy suites "
                            "(default: each suite's own set); for the models suite alone, its models (gpt-oss, "
                            "gemma2)")
    bench.add_argument("--baseline", default="materialized", metavar="IMPL",
                       help="implementation the speedup column compares with (default: materialized)")
    bench.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    bench.add_argument("--no-progress", action="store_true", help="no progress indicator on stderr")
    return parser


def _flatten(lists: Optional[Sequence[Sequence[str]]]) -> List[str]:
    return [x for group in (lists or []) for x in group]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and validate ``argv`` (without the program name); exits with status 2 on invalid input."""
    from longattn.bench.peers import PEER_NAMES
    from longattn.bench.models_suite import MODELS
    from longattn.bench.workloads import WORKLOADS

    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.command is None:
        parser.error("a command is required: longattn bench ...")
    bench = parser._subparsers._group_actions[0].choices["bench"]  # for error messages naming the subcommand
    suites = list(dict.fromkeys(args.suites)) or ["all"]
    unknown = [s for s in suites if s not in SUITES and s != "all"]
    if unknown:
        bench.error(f"unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)} or all")
    for option, given in (("--impl", args.impl), ("--workload", args.workload)):
        if given is not None and not _flatten(given):  # (an empty list would mean the default: every one)
            bench.error(f"{option} names nothing; give comma-separated names, or leave {option} out for the "
                        "default")
    args.impl = _flatten(args.impl) or None
    for name in args.impl or []:
        if name not in PEER_NAMES:
            bench.error(f"unknown implementation {name!r} in --impl; choose from {', '.join(PEER_NAMES)}")
    args.workload = _flatten(args.workload) or None
    # The models suite's workloads are its models; the other suites' are the kernels' workloads.
    models_only = args.suites == ["models"]
    allowed = MODELS if models_only else WORKLOADS
    for name in args.workload or []:
        if name not in allowed:
            hint = "" if models_only or name not in MODELS else " (models are the models suite's: longattn bench models)"
            bench.error(f"unknown workload {name!r} in --workload{hint}; choose from {', '.join(allowed)}")
    if args.baseline not in PEER_NAMES:
        bench.error(f"unknown --baseline {args.baseline!r}; choose from {', '.join(PEER_NAMES)}")
    if not 0.0 <= args.threshold < 10.0:
        bench.error(f"--threshold must be a fraction in [0, 10), got {args.threshold}")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        bench.error("--device cuda: no CUDA GPU is available to this PyTorch (use --device cpu)")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    from longattn.bench.quick import default_budget, default_suites

    device = torch.device(args.device)
    if not args.suites:  # every suite, but on a GPU with --quick the plan's few (a first look, JIT included)
        args.suites = default_suites(device, args.quick, ALL)
    else:
        args.suites = list(ALL) if "all" in suites else suites
    if args.time_budget is None:
        args.time_budget = default_budget(device, args.quick)
    elif not math.isfinite(args.time_budget) or args.time_budget < 0:
        bench.error(f"--time-budget must be a finite number of seconds >= 0 (0: no limit), got {args.time_budget}")
    elif args.time_budget == 0:
        args.time_budget = None
    if args.fail_on_regression and not args.compare:
        bench.error("--fail-on-regression needs --compare BASELINE.json")
    return args


def run_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import torch

    from longattn.bench import report as R
    from longattn.bench.peers import all_peers
    from longattn.bench.plots import make_plots
    from longattn.bench.progress import Progress
    from longattn.bench.quick import TimeBudget, describe
    from longattn.bench.results import run_metadata
    from longattn.bench.suites import BenchConfig, run_suites
    from longattn.bench.workloads import WORKLOADS, make_workload

    from longattn.bench import stability

    there = next(p for p in (Path(args.out).absolute(), *Path(args.out).absolute().parents) if p.exists())
    if not there.is_dir():  # (checked before any suite runs, not after)
        print(f"longattn bench: error: --out {args.out!r}: {str(there)!r} is a file; --out must be a directory "
              "(created if missing)", file=sys.stderr)
        return EXIT_USAGE
    baseline_rows, baseline_meta = None, {}
    if args.compare:
        try:
            baseline_meta, baseline_rows = R.load_json(args.compare)
        except ValueError as err:
            print(f"longattn bench: error: {err}", file=sys.stderr)
            return EXIT_USAGE
    try:  # (made before any suite runs: a folder that cannot be made or written fails now, not after the suites)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        if not os.access(args.out, os.W_OK | os.X_OK):
            raise PermissionError("the folder is not writable")
    except OSError as err:
        print(f"longattn bench: error: --out {args.out!r} cannot be created or written: {err}", file=sys.stderr)
        return EXIT_USAGE
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.impl is None:
        # On a GPU SDPA's math backend materializes the N x N scores as `materialized` does, only slower: it is
        # left out of the default set there to keep the default run under ten minutes (--impl sdpa-math adds it).
        peers = [p for p in all_peers() if not (device.type == "cuda" and p.name in GPU_OPT_IN)]
    else:
        peers = [p for p in all_peers() if p.name in args.impl]
    cfg = BenchConfig(device=device, dtype=dtype, quick=args.quick, peers=peers,
                      workloads=tuple(args.workload) if args.workload else None,
                      progress=Progress(enabled=not args.no_progress), impl_chosen=args.impl is not None)
    meta = run_metadata(device, dtype, argv, args.quick)
    if cfg.plan is not None:
        meta["quick_plan"] = describe(cfg.plan)
        print(meta["quick_plan"], flush=True)
    load_before = stability.machine_load()
    meta["baseline"] = args.baseline
    meta["suites"] = list(args.suites)
    t0 = time.perf_counter()
    cfg.budget = TimeBudget(args.time_budget)
    rows = []
    meta["suite_seconds"] = {}
    with warnings.catch_warnings():
        # SDPA explains every kernel it cannot use, and longattn warns when a CUDA input falls back to the PyTorch
        # backend: the rows' status and note columns say the same, so these warnings would only bury the progress
        warnings.simplefilter("ignore", UserWarning)
        for suite in args.suites:
            t_suite = time.perf_counter()
            rows.extend(run_suites([suite], cfg))
            meta["suite_seconds"][suite] = round(time.perf_counter() - t_suite, 1)
            meta["seconds"] = round(time.perf_counter() - t0, 1)
            # Save what has been measured so far: an interrupted run keeps its finished suites.
            R.fill_speedups(rows, args.baseline)
            R.write_reports(args.out, dict(meta, partial=suite != args.suites[-1]), rows)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    meta["stability"] = stability.assess(load_before, rows)
    meta["compilation"] = cfg.first_calls.summary(meta["seconds"])
    meta["budget_skipped"] = cfg.budget.summary()
    R.fill_speedups(rows, args.baseline)
    flags, refused, comparison = None, [], None
    if baseline_rows is not None:
        refused = [f"{which} run: {why}" for which, m in (("this", meta), ("the baseline", baseline_meta))
                   if (why := stability.refusal(m))]
        if refused:
            meta["compare_refused"] = refused
        else:
            comparison = R.compare_rows(rows, baseline_rows, args.threshold)
            flags = comparison.flags
            meta["compare_notes"] = comparison.notes(args.threshold)
    plots, plot_note = (([], "Plots skipped (--no-plots).") if args.no_plots
                        else make_plots(rows, args.out, stability.warning_lines(meta)))
    s = cfg.sizes
    described = []
    for kind in [k for k in (args.workload or WORKLOADS) if k in WORKLOADS]:  # (not the models suite's models)
        w = make_workload(kind, s.speed_n[-1], batch=1, heads=s.heads, head_dim=s.head_dim)
        described.append(f"{kind}: {w.describe()} (at N={w.n})")
    described.append(f"heads {s.heads}, head_dim {s.head_dim} (accuracy: N={s.accuracy_n}, batch "
                     f"{s.accuracy_batch}, heads {s.accuracy_heads})")
    js, md = R.write_reports(args.out, meta, rows, plots, plot_note, flags, described)
    print(R.terminal_report(meta, rows))
    print()
    print(f"wrote {md}, {js}" + (f", {len(plots)} plots" if plots else ""))
    if plot_note:
        print(plot_note)
    for line in (meta["budget_skipped"], meta["compilation"]):
        if line:
            print(line)
    print(f"finished in {meta['seconds']} s")
    if refused:
        print(f"\nnot compared with {args.compare}: these timings would flag noise as regressions "
              f"({' / '.join(refused)})")
        if args.fail_on_regression:
            print(f"longattn bench: comparison refused, nothing was checked: exit status {EXIT_REFUSED} "
                  f"(--fail-on-regression)", file=sys.stderr)
            return EXIT_REFUSED
    if flags is not None:
        print(f"\n{len(flags)} regression(s) against {args.compare} (threshold {args.threshold:.0%}):")
        for f in flags:
            print(f"  REGRESSION {f.describe()}")
        for line in comparison.notes(args.threshold):
            print(f"  {line}")
        if flags and args.fail_on_regression:
            return EXIT_REGRESSION
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``longattn`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.command == "bench":
        return run_bench(args, argv)
    return EXIT_USAGE  # pragma: no cover - argparse admits only known commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
