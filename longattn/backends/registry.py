"""The pass registry: which function runs one pass of a backend on a device.

A pass is one kernel stage of a call: ``"fwd"`` (forward), ``"bwd"`` (a whole backward in one kernel, where one
covers the call; its function returns None otherwise), ``"dkdv"`` and ``"dq"`` (the two-pass backward's two) and
``"decode"`` (KV-cache calls). A backend registers a function per pass with the lowest compute capability it runs
on; a lookup for a device takes the entry with the highest capability the device has, so a faster kernel for one
pass on one architecture (a Hopper-only forward, say) is one more :func:`register` call, and nothing above the
backend changes.
CPU tensors (the Triton interpreter) count as capability ``(0, 0)``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from longattn.backends.device import capability

Capability = Tuple[int, int]
_PASSES: Dict[Tuple[str, str], List[Tuple[Capability, Callable]]] = {}


def register(backend: str, pass_: str, min_capability: Capability = (0, 0)) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` runs ``pass_`` of ``backend`` on devices of compute capability ``>= min_capability``."""
    def add(fn: Callable) -> Callable:
        entries = _PASSES.setdefault((backend, pass_), [])
        entries[:] = [e for e in entries if e[0] != tuple(min_capability)] + [(tuple(min_capability), fn)]
        entries.sort(key=lambda e: e[0])
        return fn

    return add


def lookup(backend: str, pass_: str, device: torch.device) -> Callable:
    """The function registered for ``pass_`` of ``backend`` with the highest capability ``device`` has."""
    cap = capability(device)
    entries = _PASSES.get((backend, pass_), [])
    for min_cap, fn in reversed(entries):
        if cap >= min_cap:
            return fn
    raise LookupError(f"no {backend!r} kernel for pass {pass_!r} on {device} (capability {cap}); registered: "
                      f"{[e[0] for e in entries]}")


def registered() -> Dict[Tuple[str, str], List[Capability]]:
    """Every registered (backend, pass) and the capabilities of its entries (for tests and ``docs``)."""
    return {key: [cap for cap, _ in entries] for key, entries in _PASSES.items()}
