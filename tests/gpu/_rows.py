"""The GPU tests' error measure: a norm-relative error over the whole tensor hides a few wrong rows among thousands
(a wrong sinks weight on a packed document's first rows read 3e-3 there while those rows were off by 0.4 of the
largest output: docs/benchmarks.md, seventh session of 2026-11-29), so :func:`rel` also weighs the worst row."""
import torch

ROW_SLACK = 4.0  # a row may be this many times the tensor's norm-relative bound off (bf16 rounding of one row)


def worst_row(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest error of one row (the last dim) of ``a`` against ``b``: ``|a_r - b_r|`` over the larger of
    ``|b_r|`` and the rows' mean norm (a row near zero is not judged against itself). Rows where ``b`` is not finite
    are left out."""
    a, b = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    ok = torch.isfinite(b).all(dim=1)
    a, b = a[ok], b[ok]
    if b.numel() == 0:
        return 0.0
    norms = b.norm(dim=1)
    floor = norms.mean().clamp_min(1e-6)
    return ((a - b).norm(dim=1) / torch.maximum(norms, floor)).max().item()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The norm-relative error of ``a`` against ``b`` (where ``b`` is finite), or the worst row's error over
    :data:`ROW_SLACK` where that is larger."""
    a, b = a.double(), b.double()
    keep = torch.isfinite(b)
    whole = ((a - b)[keep].norm() / b[keep].norm().clamp_min(1e-6)).item()
    return max(whole, worst_row(a, b) / ROW_SLACK)
