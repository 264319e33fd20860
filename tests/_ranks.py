"""Test-local helper: run a function in several processes (the ranks of a gloo process group) and wait for them."""
from __future__ import annotations

import time

import torch.multiprocessing as mp


def spawn_and_wait(fn, args: tuple, world: int, timeout_s: float, what: str) -> None:
    """``fn(rank, *args)`` in ``world`` processes (``torch.multiprocessing.spawn``); raises if one fails or they run
    past ``timeout_s``, and never leaves one running."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} (world {world}) did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
