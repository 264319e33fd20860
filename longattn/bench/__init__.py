"""The ``longattn bench`` suite: longattn against the attention a user would otherwise run.

Modules, one job each: :mod:`~longattn.bench.workloads` (problems and FLOP counts), :mod:`~longattn.bench.peers`
(implementations), :mod:`~longattn.bench.composition` (plain dilated composition), :mod:`~longattn.bench.timing`
(time, memory, failure classification), :mod:`~longattn.bench.suites` (what each suite measures),
:mod:`~longattn.bench.report` (tables, Markdown, JSON, regression check), :mod:`~longattn.bench.plots` (PNGs),
:mod:`~longattn.bench.progress` (stderr progress), :mod:`~longattn.bench.first_calls` (compilation said once),
:mod:`~longattn.bench.quick` (the GPU ``--quick`` plan and the time budget). The command line is :mod:`longattn.cli`; see ``docs/cli.md``.
"""
