"""How the sequence-parallel functions run, as one value passed down every call: :class:`ParallelOptions`.

Every public function of :mod:`longattn.distributed` takes ``options=`` (keyword-only; ``None``: the defaults) and
passes it down; :class:`~longattn.distributed.ContextParallel` and the ``nn`` modules hold one for their group.
Nothing in the package reads a module-level setting at call time. Every rank passes the same options: those that
change which collectives run (``transport``, and Ulysses' ``head_chunks``) are compared across the ranks with the
call's other options, so that a rank passing a different one gets the same named ``ValueError`` as for any option.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

# The names ParallelOptions.transport takes; longattn.distributed.transport.choose decides among them (and re-exports
# them). Here, at the bottom of the package's imports, so that every module may read the options.
TRANSPORTS = ("auto", "nccl", "copy_engine")


@dataclass(frozen=True)
class ParallelOptions:
    """How a sequence-parallel call runs (the same on every rank of its group).

    Args:
        transport: how the blocks travel, one of ``("auto", "nccl", "copy_engine")``: ``"auto"`` (the default)
            picks NCCL (the group's ``isend``/``irecv`` for the ring, NCCL's all-to-alls for Ulysses), as ``"nccl"``
            does; ``"copy_engine"`` writes straight into the peers' memory on the copy engines
            (:mod:`longattn.distributed.copy_engine`: NCCL, every rank on one host, PyTorch's symmetric memory; no
            SM taken from the attention kernels), an explicit choice until its checks on 2 and 4 GPUs are done, and
            an error where it cannot run. Compared across ranks.
        head_chunks: the head groups a Ulysses call is cut into, whose all-to-alls overlap another group's attention
            (1: no overlap); fewer where they do not divide a rank's heads
            (:func:`longattn.distributed.ulysses.head_chunks`). Measured on 2 GPUs in docs/benchmarks.md. Compared
            across ranks (ranks cutting the heads differently would issue different collectives).
        host_checks: the cross-rank option check exchanges on a gloo twin of an NCCL group (an all-gather on the GPU
            stream makes the host wait for every kernel queued before it); False: on the group itself. Compared
            across ranks: the ranks of a group agree on where they compare on their first call (one exchange on
            the group itself), and a rank passing another value then or later gets the same named ``ValueError``
            as for any option; a new value every rank passes takes effect from the next call.
        copy_engine_timeout_s: seconds a copy-engine flag wait may last once its stream reached it before the
            process ends with an error (a peer that died); None: the process group's own timeout.
    """

    transport: str = "auto"
    head_chunks: int = 2
    host_checks: bool = True
    copy_engine_timeout_s: Optional[float] = None

    def __post_init__(self):
        name = "ParallelOptions"
        if not isinstance(self.transport, str) or self.transport not in TRANSPORTS:
            raise ValueError(f"{name}.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if isinstance(self.head_chunks, bool) or not isinstance(self.head_chunks, int):
            raise TypeError(f"{name}.head_chunks must be an int >= 1, got {type(self.head_chunks).__name__} "
                            f"{self.head_chunks!r}")
        if self.head_chunks < 1:
            raise ValueError(f"{name}.head_chunks must be an int >= 1, got {self.head_chunks}")
        if not isinstance(self.host_checks, bool):
            raise TypeError(f"{name}.host_checks must be True or False, got {type(self.host_checks).__name__} "
                            f"{self.host_checks!r}")
        t = self.copy_engine_timeout_s
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise TypeError(f"{name}.copy_engine_timeout_s must be None (the group's timeout) or a number of "
                                f"seconds > 0, got {type(t).__name__} {t!r}")
            if math.isnan(t) or t <= 0:
                raise ValueError(f"{name}.copy_engine_timeout_s must be None (the group's timeout) or a number of "
                                 f"seconds > 0, got {t!r}")

    def compared(self, *names: str) -> Dict[str, Any]:
        """The fields ``names`` as options of the cross-rank check (``"options.<field>"``: value)."""
        return {f"options.{n}": getattr(self, n) for n in names}


DEFAULT = ParallelOptions()
FIELDS = tuple(f.name for f in fields(ParallelOptions))


def check_options(options: Optional[ParallelOptions], fn: str) -> ParallelOptions:
    """``options`` (``None``: :data:`DEFAULT`), or ``TypeError`` naming ``fn`` if it is not a
    :class:`ParallelOptions`."""
    if options is None:
        return DEFAULT
    if not isinstance(options, ParallelOptions):
        raise TypeError(f"{fn}: options must be a longattn.distributed.ParallelOptions or None, got "
                        f"{type(options).__name__} {options!r:.80}")
    return options


def host_checks_of(options: Any) -> bool:
    """Whether the cross-rank check of a call given ``options`` exchanges on the host (``options.host_checks``;
    the default for anything not a :class:`ParallelOptions`, whose error the check itself reports)."""
    return options.host_checks if isinstance(options, ParallelOptions) else DEFAULT.host_checks
