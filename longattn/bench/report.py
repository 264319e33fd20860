"""Reports of a benchmark run: speedups, the terminal tables, the Markdown report, the JSON file, and the
regression comparison against a saved JSON."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from longattn.bench import models_suite as MS
from longattn.bench import score_mods_suite as SM
from longattn.bench.stability import warning_lines
from longattn.bench.results import Row

SUITE_ORDER = ("speed", "memory", "maxlen", "scaling", "accuracy")
SUITE_TITLES = {
    "speed": "Speed: forward and forward+backward",
    "memory": "Memory: peak beyond the inputs, per token",
    "maxlen": "Longest sequence (batch 1)",
    "scaling": "Scaling: forward time against N and against the batch",
    "accuracy": "Accuracy against the float64 reference",
    "dispatch": "Dispatch: SDPA's default kernel against ours (the data behind backend='auto')",
    "varlen": "Packed variable-length batch: flash_attention_varlen against SDPA on the padded batch",
    "decode": "Decode: new tokens against a KV cache",
    "score_mods": "Score modifications (soft-cap, ALiBi, sinks): cost against the plain kernel, speed against Flex",
    "models": "Models: one training step of gpt-oss- and Gemma-2-shaped models under each attention implementation",
}
SUITE_NOTES = {
    "speed": ("The implementations of a case take turns over 3 rounds (round r times each once); time: the median "
              "of the round medians, ± half their range, so a drift of the machine between rows shows here. 'same "
              "kernel as X': backend='auto' ran X's kernel, the row repeats X's measurement. TFLOP/s count "
              "FlashAttention's 4·B·D·pairs forward (pairs = H·N² dense, half for causal, the exact band for "
              "window, the allowed blocks' area for block-sparse, every branch's selected pairs for dilated), "
              "backward 2.5× forward. Speedup: the baseline implementation's time over this row's, same case. "
              "MB/token: peak memory beyond the inputs (q, k, v and, for forward+backward, dO) over B·N."),
    "memory": ("Peak memory of one call beyond the inputs (q, k, v and dO), per token (B·N), batch 1. 'same kernel "
               "as X': backend='auto' ran X's kernel, the row repeats X's measurement."),
    "maxlen": ("N doubles until a run fails for lack of memory, then bisects to 1/8 of N. 'time budget, not "
               "memory' (a call slower than the limit per call, or the search's budget used up) and 'size cap' mean "
               "the search stopped before memory ran out: the true limit is higher. 'same kernel as X': "
               "backend='auto' runs X's kernel, the row repeats X's search."),
    "scaling": ("Forward time at batch 1 against N, and at fixed N against the batch; the implementations of a case "
                "take turns over 3 rounds (± half the range of the round medians)."),
    "dispatch": ("Median over interleaved rounds (± half the range of the round medians). sdpa: "
                 "F.scaled_dot_product_attention with no backend chosen (what a user gets by default); "
                 "longattn-triton: our kernels forced; longattn: backend='auto' (its note says which kernel it ran; "
                 "'same kernel as X': the row repeats X's measurement). Speedup: sdpa's time over this row's. "
                 "'-gqa': grouped-query heads (Hq = 4 Hk; decode Hq = 32, Hk = 8). Pass decode: one new token against "
                 "a contiguous cache of N keys given as an int cache_seqlens (flash_attention_with_kvcache; sdpa over "
                 "the whole cache). backend='auto' runs our kernel for a kind of call only where it beat sdpa on "
                 "every case."),
    "varlen": ("Median over interleaved rounds. N: total tokens, B: documents (log-uniform lengths, the note gives "
               "the range). sdpa: no backend chosen, on the batch padded to the longest document (copies in and out "
               "timed). TFLOP/s count same-document pairs only. Speedup: sdpa's time over this row's."),
    "decode": ("Median over interleaved rounds. N: cached keys per sequence, B: sequences; workload decode-nqK: K new "
               "query tokens. longattn: backend='auto', the cache length given as an int; longattn-triton: our "
               "kernel forced on the same call; longattn-paged: the same cache in scattered pages, lengths in a "
               "tensor. The note of a longattn row names the kernel auto ran ('same kernel as X': the row repeats "
               "X's measurement). sdpa: no backend chosen, on the contiguous cache, grouped-query heads, no mask. "
               "Note: K+V bytes read / time, and the fraction of the copy bound reached. copy: the same K and V "
               "copied on the device (read and written); half its time is that bound. Speedup: sdpa's time over "
               "this row's."),
    "score_mods": ("Causal self-attention, median over interleaved rounds (every implementation and modification of "
                   "a case takes turns). Modifications: none; softcap (soft-capping at "
                   f"{SM.SOFTCAP:g}); alibi (ALiBi, geometric slopes); sinks (one learnable sink logit per head); "
                   "all (the three). longattn: backend='auto' (the note names the kernel it ran; 'same kernel as X': "
                   "the row repeats X's measurement); longattn-triton: our kernels forced; flex: compiled "
                   "FlexAttention with a causal BlockMask and the equivalent score_mod (tanh soft-cap, ALiBi bias "
                   "-slope·(q_idx - kv_idx)); sinks are no score_mod: n/a; fa4: FlashAttention-4 where installed "
                   "(softcap and learnable_sink; no ALiBi: n/a), our rows' notes giving 'FA4 / this', its time over "
                   "theirs. vs plain: the row's time over the same "
                   "implementation's 'none' row (for longattn-triton the modification's cost in our kernel; for "
                   "longattn what a user pays, a change of kernel included where auto runs SDPA without "
                   "modification); vs flex: flex's time over the row's. Bar "
                   f"(the issue's): a modification costs at most {SM.COST_BAR['fwd']:.2f}x forward and "
                   f"{SM.COST_BAR['fwd_bwd']:.2f}x forward+backward, and runs at least {SM.FLEX_BAR:.1f}x faster than "
                   "flex where flex runs it."),
    "models": ("One training step (forward of (1, N) token ids with labels, loss.backward()) of models built from a "
               "transformers config with random weights: gpt-oss (gpt-oss-20b's attention: 64 query heads, 8 KV "
               "heads, D = 64, a sliding window of 128 alternating with full layers, sinks) and gemma2 (Gemma-2-9B's: "
               "16 query heads, 8 KV heads, D = 256, soft-capping at 50, a window of 4096 alternating with full "
               f"layers); {MS.LAYERS} layers, vocabulary {MS.VOCAB}, small MLPs. Every implementation runs a copy of "
               "the same weights; they take turns over interleaved rounds (± half the range of the round medians). "
               "An implementation transformers refuses for the model, or one that fails, says why. longattn "
               "speedup: the row's time over longattn's. Bar (the issue's): at least "
               f"{MS.BARS['eager']:.1f}x eager and {MS.BARS['flex_attention']:.1f}x flex_attention. The longattn "
               "row's note: its loss against eager's on the same tokens (no gradients)."),
    "accuracy": ("Max absolute error of the output and of dq, dk, dv against the float64 reference "
                 "(longattn.reference) on the same inputs, N and batch small; float32 and the benchmark dtype."),
}


# ------------------------------------------------------------------------------------------------------ speedups
def fill_speedups(rows: Sequence[Row], baseline: str) -> None:
    """Set ``row.speedup`` = time of ``baseline`` on the same case / ``row.time_ms`` (timed rows only). The models
    suite's rows keep theirs: longattn's speedup over the row (:func:`longattn.bench.models_suite.fill_ratios`)."""
    base: Dict[tuple, float] = {}
    for r in rows:
        if r.impl == _baseline_of(r, baseline) and r.ok and r.time_ms:
            base[_case(r)] = r.time_ms
    for r in rows:
        if r.suite == MS.SUITE or r.impl == "copy":  # (the decode suite's copy of K and V is a bound, not a peer)
            continue
        t = base.get(_case(r))
        r.speedup = t / r.time_ms if (t and r.ok and r.time_ms) else None


def _baseline_of(r: Row, baseline: str) -> str:
    # these suites compare with SDPA's default (what a user gets)
    if r.suite == SM.SUITE:  # speedup: FlexAttention's time over the row's (score_mods_suite.fill_ratios)
        return "flex"
    return "sdpa" if r.suite in ("dispatch", "varlen", "decode") else baseline


def _case(r: Row) -> tuple:
    return (r.suite, r.workload, r.n, r.batch, r.head_dim, r.dtype, r.pass_, r.sweep)


# ---------------------------------------------------------------------------------------------------- formatting
def _num(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _si(x: Optional[float]) -> str:
    if x is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _tokens(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}k"
    return str(n)


def _time(r: Row) -> str:
    if r.same_as:  # backend="auto" ran that row's kernel: its measurement, not a second one
        return f"same kernel as {r.same_as}"
    if r.time_ms is None:
        return "-"
    return f"{r.time_ms:.4g} ± {r.spread_ms:.2g}" if r.spread_ms is not None else f"{r.time_ms:.4g}"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _err(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2e}"


def columns(suite: str) -> List[Tuple[str, Any]]:
    """``(header, row -> text)`` of each column of ``suite``'s table."""
    status = ("status", lambda r: r.status)
    if suite in ("memory", "maxlen"):  # no time column to say it in
        status = ("status", lambda r: f"{r.status}, same kernel as {r.same_as}" if r.same_as else r.status)
    if suite == "dispatch":
        return [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload),
                ("D", lambda r: str(r.head_dim)), ("N", lambda r: _tokens(r.n)), ("B", lambda r: str(r.batch)),
                ("pass", lambda r: r.pass_), ("time ms", _time),
                ("vs sdpa", lambda r: "-" if r.speedup is None else f"{r.speedup:.2f}x"), status]
    if suite == "decode":
        return [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload),
                ("N", lambda r: _tokens(r.n)), ("B", lambda r: str(r.batch)), ("time ms", _time),
                ("vs sdpa", lambda r: "-" if r.speedup is None else f"{r.speedup:.2f}x"),
                ("note", lambda r: r.note or "-"), status]
    if suite == SM.SUITE:
        return [("implementation", lambda r: r.impl), ("modification", lambda r: r.workload),
                ("D", lambda r: str(r.head_dim)), ("N", lambda r: _tokens(r.n)), ("B", lambda r: str(r.batch)),
                ("pass", lambda r: r.pass_), ("time ms", _time), ("vs plain", lambda r: _ratio(r.vs_plain)),
                ("vs flex", lambda r: _ratio(r.speedup)), ("bar", SM.bar_verdict), ("note", lambda r: r.note or "-"),
                status]
    if suite == MS.SUITE:
        return [("implementation", lambda r: r.impl), ("model", lambda r: r.workload), ("D", lambda r: str(r.head_dim)),
                ("N", lambda r: _tokens(r.n)), ("pass", lambda r: r.pass_), ("time ms", _time),
                ("longattn speedup", lambda r: _ratio(r.speedup)), ("bar", MS.bar_verdict),
                ("peak MB", lambda r: _num(r.peak_mb)), ("note", lambda r: r.note or "-"), status]
    if suite == "varlen":
        return [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload),
                ("N", lambda r: _tokens(r.n)), ("docs", lambda r: str(r.batch)), ("pass", lambda r: r.pass_),
                ("time ms", _time), ("vs sdpa", lambda r: "-" if r.speedup is None else f"{r.speedup:.2f}x"),
                ("TFLOP/s", lambda r: _num(r.tflops)), status]
    if suite in ("speed", "scaling"):
        cols = [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload),
                ("N", lambda r: _tokens(r.n)), ("B", lambda r: str(r.batch)), ("pass", lambda r: r.pass_),
                ("time ms", _time), ("speedup", lambda r: "-" if r.speedup is None else f"{r.speedup:.2f}x"),
                ("TFLOP/s", lambda r: _num(r.tflops)), ("tokens/s", lambda r: _si(r.tokens_per_s)),
                ("MB/token", lambda r: _num(r.mb_per_token)), status]
        return cols
    if suite == "memory":
        return [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload),
                ("N", lambda r: _tokens(r.n)), ("pass", lambda r: r.pass_), ("peak MB", lambda r: _num(r.peak_mb)),
                ("MB/token", lambda r: _num(r.mb_per_token)), status]
    if suite == "maxlen":
        return [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload),
                ("pass", lambda r: r.pass_), ("longest N", lambda r: f"{r.max_n:,}" if r.max_n else "-"),
                ("stopped by", lambda r: r.note or "-"), status]
    return [("implementation", lambda r: r.impl), ("workload", lambda r: r.workload), ("N", lambda r: str(r.n)),
            ("dtype", lambda r: r.dtype), ("max err out", lambda r: _err(r.err_out)),
            ("max err grads", lambda r: _err(r.err_grad)), status]


def _cells(suite: str, rows: Sequence[Row], width_status: Optional[int]) -> Tuple[List[str], List[List[str]]]:
    cols = columns(suite)
    body = []
    for r in rows:
        line = [str(fn(r)) for _, fn in cols]
        if width_status and len(line[-1]) > width_status:
            line[-1] = line[-1][: width_status - 3] + "..."
        body.append(line)
    return [h for h, _ in cols], body


def terminal_table(suite: str, rows: Sequence[Row], status_width: int = 48) -> str:
    """Fixed-width text table of ``rows`` (all of one suite)."""
    head, body = _cells(suite, rows, status_width)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    lines = [fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(b) for b in body]
    return "\n".join(lines)


def header_lines(meta: Dict[str, Any]) -> List[str]:
    return [
        f"device: {meta.get('device')}",
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}, "
        f"longattn {meta.get('longattn')}, python {meta.get('python')}",
        f"date: {meta.get('date')}",
        f"command: {meta.get('command')}",
        f"dtype: {meta.get('dtype')}{', quick sizes' if meta.get('quick') else ''}"
        f"{', speedup baseline: ' + meta['baseline'] if meta.get('baseline') else ''}",
    ] + _timing_lines(meta) + warning_lines(meta)


END_LINES = ("budget_skipped", "compilation")  # meta lines the terminal gives once, at the end of the run


def _timing_lines(meta: Dict[str, Any]) -> List[str]:
    per_suite = meta.get("suite_seconds") or {}
    if not per_suite and meta.get("seconds") is None:
        return []
    parts = ", ".join(f"{k} {v} s" for k, v in per_suite.items())
    state = " (partial: interrupted or still running)" if meta.get("partial") else ""
    lines = [f"run time: {meta.get('seconds')} s{' (' + parts + ')' if parts else ''}{state}"]
    return lines + [meta[k] for k in ("quick_plan", *END_LINES) if meta.get(k)]


def by_suite(rows: Iterable[Row]) -> Dict[str, List[Row]]:
    out: Dict[str, List[Row]] = {}
    for r in rows:
        out.setdefault(r.suite, []).append(r)
    return {s: out[s] for s in sorted(out, key=lambda s: SUITE_ORDER.index(s) if s in SUITE_ORDER else 99)}


def unsupported_summary(rows: Sequence[Row]) -> List[str]:
    """One line per implementation and reason for the rows not run because unsupported here."""
    groups: Dict[Tuple[str, str], List[str]] = {}
    for r in rows:
        if r.status.startswith("unsupported"):
            kinds = groups.setdefault((r.impl, r.status[len("unsupported: "):] or "unsupported"), [])
            if r.workload not in kinds:
                kinds.append(r.workload)
    return [f"{impl} ({', '.join(kinds)}): {why}" for (impl, why), kinds in groups.items()]


STATUS_WIDTH = 48  # the terminal's status column; longer statuses are cut there and given in full below the table


def cut_statuses(rows: Sequence[Row], width: int = STATUS_WIDTH) -> List[str]:
    """The distinct statuses of ``rows`` too long for the terminal's status column, in full, in order."""
    return list(dict.fromkeys(r.status for r in rows if len(r.status) > width))


def terminal_report(meta: Dict[str, Any], rows: Sequence[Row]) -> str:
    """Header and one table per suite; unsupported rows are listed once below each table, not row by row, and
    statuses the status column cuts are given in full there."""
    head = {k: v for k, v in meta.items() if k not in END_LINES}  # the command prints those after the tables
    parts = ["longattn bench", *("  " + line for line in header_lines(head))]
    for suite, srows in by_suite(rows).items():
        shown = [r for r in srows if not r.status.startswith("unsupported")]
        parts += ["", f"== {SUITE_TITLES.get(suite, suite)} ==", terminal_table(suite, shown, STATUS_WIDTH)]
        parts += [f"  unsupported here: {line}" for line in unsupported_summary(srows)]
        parts += [f"  status in full: {status}" for status in cut_statuses(shown)]
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------------ Markdown
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(suite: str, rows: Sequence[Row]) -> str:
    """``suite``'s rows as a Markdown table: its terminal columns, and each row's note where no column shows it."""
    head, body = _cells(suite, rows, None)
    if "note" not in head:
        head = head + ["note"]
        body = [b + [r.note or ""] for b, r in zip(body, rows)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_md_escape(c) for c in b) + " |" for b in body]
    return "\n".join(lines)


def markdown_report(meta: Dict[str, Any], rows: Sequence[Row], plots: Sequence[str] = (),
                    plot_note: str = "", flags: Optional[Sequence["Flag"]] = None,
                    workloads: Sequence[str] = ()) -> str:
    """The Markdown report: header, one section per suite (explanation, table), plots, regressions."""
    out = ["# longattn benchmark", ""]
    out += [f"- {line}" for line in header_lines(meta)]
    if workloads:
        out += ["", "Workloads (self-attention, `(B, N, H, D)` inputs):", ""]
        out += [f"- {w}" for w in workloads]
    for suite, srows in by_suite(rows).items():
        out += ["", f"## {SUITE_TITLES.get(suite, suite)}", "", SUITE_NOTES.get(suite, ""), "",
                markdown_table(suite, srows)]
    if plots or plot_note:
        out += ["", "## Plots", ""]
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        if plot_note:
            out.append(plot_note)
    if flags is not None:
        out += ["", "## Regressions against the baseline", ""]
        out += [f"- {f.describe()}" for f in flags] if flags else ["None."]
        out += [f"- {line}" for line in meta.get("compare_notes", [])]
    elif meta.get("compare_refused"):
        out += ["", "## Regressions against the baseline", "",
                "Not compared: these timings would flag noise as regressions ("
                + " / ".join(meta["compare_refused"]) + ")."]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------- JSON
def to_json(meta: Dict[str, Any], rows: Sequence[Row]) -> Dict[str, Any]:
    return {"meta": meta, "rows": [r.to_json() for r in rows]}


def load_json(path) -> Tuple[Dict[str, Any], List[Row]]:
    """Read a report written by :func:`write_reports`; ValueError if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        rows = [Row.from_json(d) for d in data["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--compare: {path} is not a longattn bench JSON report ({err})") from err
    return data.get("meta", {}), rows


def write_reports(out_dir, meta: Dict[str, Any], rows: Sequence[Row], plots: Sequence[str] = (),
                  plot_note: str = "", flags=None, workloads: Sequence[str] = ()) -> Tuple[Path, Path]:
    """Write ``results.json`` and ``report.md`` into ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "results.json", out / "report.md"
    payload = to_json(meta, rows)
    if flags is not None:
        payload["regressions"] = [f.to_json() for f in flags]
    js.write_text(json.dumps(payload, indent=1) + "\n")
    md.write_text(markdown_report(meta, rows, plots, plot_note, flags, workloads))
    return js, md


# -------------------------------------------------------------------------------------------- regression check
@dataclass
class Flag:
    """A row slower than its baseline by more than the threshold, or failing where the baseline ran."""

    row: Row
    base_ms: Optional[float]
    base_status: str

    @property
    def ratio(self) -> Optional[float]:
        if self.base_ms and self.row.time_ms:
            return self.row.time_ms / self.base_ms
        return None

    def describe(self) -> str:
        r = self.row
        case = f"{r.suite} {r.impl} {r.workload} N={r.n} B={r.batch} {r.dtype} {r.pass_}"
        if self.ratio is None:
            return f"{case}: now '{r.status}', baseline ran ({self.base_ms:.4g} ms)"
        return (f"{case}: {r.time_ms:.4g} ms vs {self.base_ms:.4g} ms in the baseline "
                f"({(self.ratio - 1) * 100:+.0f}%)")

    def to_json(self) -> Dict[str, Any]:
        return {"key": list(self.row.key()), "time_ms": self.row.time_ms, "baseline_ms": self.base_ms,
                "ratio": self.ratio, "status": self.row.status}


@dataclass
class Comparison:
    """What :func:`compare_rows` found: the flagged rows, and the matched rows it did not judge."""

    flags: List[Flag]
    noisy: List[Row]  # a spread (± between timing rounds, this run's or the baseline's) wider than the threshold
    shared: List[Row]  # rows repeating another row's measurement (same kernel): judged once, on that row

    def notes(self, threshold: float) -> List[str]:
        """Lines saying which rows were not judged, and why."""
        out = []
        if self.noisy:
            out.append(f"{len(self.noisy)} row(s) not compared: their spread between timing rounds (this run's or "
                       f"the baseline's) is wider than the {threshold:.0%} threshold, so noise could not be told "
                       "from a slow-down")
        if self.shared:
            out.append(f"{len(self.shared)} row(s) ran another row's kernel (same kernel as ...): judged once, on "
                       "that row")
        return out


def resolves(row: Row, threshold: float) -> bool:
    """Whether ``row``'s spread between timing rounds is narrow enough to see a slow-down of ``threshold``."""
    return row.spread_ms is None or row.spread_ms <= threshold * row.time_ms


def slower(r: Row, b: Row, threshold: float) -> bool:
    """``r`` more than ``threshold`` slower than ``b``, by more than their two spreads added up."""
    gap = r.time_ms - b.time_ms
    return gap > threshold * b.time_ms and gap > (r.spread_ms or 0.0) + (b.spread_ms or 0.0)


def compare_rows(rows: Sequence[Row], baseline: Sequence[Row], threshold: float = 0.10) -> Comparison:
    """Rows more than ``threshold`` slower than the baseline row of the same implementation, workload, N, batch,
    dtype and pass, by more than the two rows' spreads (and timed rows that fail where the baseline ran). Rows
    whose spread, or whose baseline's, is wider than the threshold are not judged (``noisy``), nor rows repeating
    another row's kernel (``shared``: a kernel counts once). Unmatched rows are ignored."""
    base = {b.key(): b for b in baseline if b.time_ms is not None and b.status == "ok"}
    found = Comparison([], [], [])
    for r in rows:
        b = base.get(r.key())
        if b is None:
            continue
        if r.same_as:
            found.shared.append(r)
        elif r.ok and r.time_ms is not None:
            if not (resolves(r, threshold) and resolves(b, threshold)):
                found.noisy.append(r)
            elif slower(r, b, threshold):
                found.flags.append(Flag(r, b.time_ms, b.status))
        elif not r.ok and not r.status.startswith("unsupported"):
            found.flags.append(Flag(r, b.time_ms, b.status))
    return found


def compare(rows: Sequence[Row], baseline: Sequence[Row], threshold: float = 0.10) -> List[Flag]:
    """The flagged rows of :func:`compare_rows`."""
    return compare_rows(rows, baseline, threshold).flags
