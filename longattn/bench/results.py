"""The record of one measurement (a table row) and the run's metadata."""
from __future__ import annotations

import datetime
import platform
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional

import torch


@dataclass
class Row:
    """One implementation on one workload, size, dtype and pass.

    ``status`` is ``"ok"``, ``"oom"``, ``"unsupported: <why>"``, ``"skipped: <why>"`` or ``"error: <what>"``;
    the measured fields are None where they do not apply or the run failed.
    """

    suite: str
    impl: str
    workload: str
    n: int
    batch: int
    heads: int
    head_dim: int
    dtype: str
    pass_: str
    status: str = "ok"
    time_ms: Optional[float] = None
    spread_ms: Optional[float] = None
    tflops: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_mb: Optional[float] = None  # peak memory beyond the inputs, MB (1e6 bytes)
    mb_per_token: Optional[float] = None
    err_out: Optional[float] = None  # accuracy: max |out - reference|
    err_grad: Optional[float] = None  # accuracy: max over dq, dk, dv of max |grad - reference|
    max_n: Optional[int] = None  # maxlen: longest sequence that ran
    speedup: Optional[float] = None  # baseline implementation's time / this time (same case)
    vs_plain: Optional[float] = None  # score_mods: this time / the same implementation's without modification
    sweep: str = ""  # scaling: "N" or "batch"
    note: str = ""
    same_as: str = ""  # the implementation whose kernel this row ran: its measurement is that row's, not timed again

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def copy_measurement(self, src: "Row") -> None:
        """Make this row repeat ``src``'s result: ``src`` ran the same kernel (``backend="auto"`` chose it), so
        measuring it again would present one kernel's drift as a difference between two implementations."""
        for name in ("status", "time_ms", "spread_ms", "tflops", "tokens_per_s", "peak_mb", "mb_per_token", "max_n",
                     "n"):
            setattr(self, name, getattr(src, name))
        self.same_as = src.impl
        self.note = src.note or self.note

    def key(self):
        """What a row is matched on between runs (regression comparison)."""
        key = (self.suite, self.impl, self.workload, self.n, self.batch, self.dtype, self.pass_)
        return key + (self.head_dim,) if self.suite in ("dispatch", "score_mods") else key  # rows differ by head dim

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Row":
        d = dict(d)
        if "pass" in d:
            d["pass_"] = d.pop("pass")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_metadata(device: torch.device, dtype: torch.dtype, argv, quick: bool) -> Dict[str, Any]:
    """Header of every report: device, versions, date, command line."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - depends on the platform
        triton_version = "not installed"
    import longattn

    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",
        "longattn": longattn.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["longattn", *argv]),
        "dtype": str(dtype).replace("torch.", ""),
        "quick": quick,
    }
