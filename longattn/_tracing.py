"""Which tracer runs a call: ``torch.export``'s flag, read in this one place (a private attribute of
``torch.compiler``, which a later PyTorch may rename)."""
from __future__ import annotations

from typing import Optional

import torch


def export_flag() -> Optional[bool]:
    """True while ``torch.export`` traces the call, False otherwise; None on a PyTorch without the flag (before
    2.5). The flag, not ``torch.compiler.is_exporting()``: Dynamo up to PyTorch 2.11 traces that call as a constant
    True inside ``torch.compile`` too."""
    return getattr(torch.compiler, "_is_exporting_flag", None)
