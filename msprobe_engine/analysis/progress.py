"""A one-line progress indicator on stderr (no dependency)."""
from __future__ import annotations

import sys
import time


class Progress:
    """``label: done/total`` rewritten in place at most ten times a second.

    ``enabled=None`` shows it only when stderr is a terminal."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total = 0
        self._last = 0.0

    def start(self, total: int) -> None:
        self.total = total
        self._last = 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or done == self.total):
            self._last = now
            sys.stderr.write(f"\r{self.label}: {done}/{self.total} entries")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
