"""A copy-engine call's results set to NaN on the GPU where a peer aborted the call
(:meth:`longattn.distributed.copy_engine.Link.end`), without the host waiting for the GPU to know.

An aborting rank writes every flag of the call with one number, the call's plus
:data:`~longattn.distributed.copy_engine.ABORTED`; a flag holding it means a peer aborted this call (a peer's next
call writes the next number, which a result of this call still waiting for its check must not mistake for an abort;
and an aborted link makes no further call). One small kernel per result reads the flags and, only where one
is above, writes NaN over the result: a call that went well costs a launch and a read of the flags, not a pass over
its results (a masked fill, the fallback without Triton or for a strided result, reads and writes all of it)."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # (the fallback below)
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["n_flags", "mark", "numel"])  # (one compilation whatever the call number)
    def _poison_kernel(FLAGS, n_flags, mark, OUT, numel, FLAG_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, FLAG_BLOCK)
        f = tl.load(FLAGS + i, mask=i < n_flags, other=0)
        if tl.max((f == mark).to(tl.int32), axis=0) > 0:
            nan = float("nan")
            step = tl.num_programs(0).to(tl.int64) * BLOCK
            for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
                offs = start + tl.arange(0, BLOCK)
                tl.store(OUT + offs, nan, mask=offs < numel)


def poison(flags: Tensor, mark: int, outputs: Sequence[Tensor]) -> None:
    """On the current stream: every tensor of ``outputs`` (floating point) set to NaN if any of ``flags`` (int64,
    on its device) holds ``mark``."""
    for out in outputs:
        if out.numel() == 0:
            continue
        if triton is not None and out.is_cuda and out.is_contiguous() and flags.is_contiguous():
            block = 2048
            grid = (max(1, min(triton.cdiv(out.numel(), block), 1024)),)
            _poison_kernel[grid](flags, flags.numel(), mark, out, out.numel(),
                                 FLAG_BLOCK=triton.next_power_of_2(flags.numel()), BLOCK=block)
        else:
            out.masked_fill_((flags == mark).any(), float("nan"))
