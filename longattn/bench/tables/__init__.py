"""The GPU benchmark tables behind ``docs/benchmarks.md``, one module per table, each runnable as
``python -m longattn.bench.tables.<name>``: ``flash`` (our kernels and SDPA's default against every SDPA backend and
FlexAttention), ``dilated`` (fused dilated attention against the best composition), ``block_sparse`` (against
FlexAttention, per pattern and density)."""
