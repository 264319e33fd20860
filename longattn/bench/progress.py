"""A dependency-free progress indicator on stderr: one updating line on a terminal, one line per suite otherwise."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``begin(suite, total)``, then ``step(label)`` before each job and ``end()`` after the suite; ``note(text)``
    for a line of its own."""

    def __init__(self, stream: Optional[TextIO] = None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.suite, self.total, self.done, self.t0 = "", 0, 0, 0.0

    def begin(self, suite: str, total: int) -> None:
        self.suite, self.total, self.done, self.t0 = suite, total, 0, time.perf_counter()
        if self.enabled and not self.tty:
            self.stream.write(f"[{suite}] {total} jobs\n")
            self.stream.flush()

    def step(self, label: str) -> None:
        self.done += 1
        if self.tty:
            width = 24
            filled = int(width * (self.done - 1) / max(self.total, 1))
            line = f"\r[{self.suite}] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
            self.stream.write(line[:110].ljust(110))
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (what is compiling), under the bar on a terminal."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + " " * 110 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            self.stream.write("\r" + " " * 110 + "\r")
        self.stream.write(f"[{self.suite}] done: {self.total} jobs in {elapsed:.1f} s\n")
        self.stream.flush()
