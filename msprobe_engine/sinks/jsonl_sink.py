"""One JSON object per step in `metrics.jsonl` (nan/inf as JSON's NaN/Infinity literals)."""
from __future__ import annotations

import logging
import os

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink

JSONL_NAME = "metrics.jsonl"

log = logging.getLogger("msprobe_engine")


@register_sink("jsonl")
class JsonlSink(Sink):
    """`step, rank, micro_steps, time, metrics, alerts` per line. Each line is written whole
    or not at all: one unbuffered write, and a write cut short (a full disk) is taken back.
    A partial last line left by an earlier crash is removed when the file is opened."""

    _fd: int
    _size: int

    def open(self) -> None:
        path = self.run_dir / JSONL_NAME
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        kept = _whole_lines_size(self._fd, self._size)
        if kept < self._size:
            log.warning("msprobe: %s ended with a partial line (an earlier crash); removed %d bytes",
                        path, self._size - kept)
            os.ftruncate(self._fd, kept)
            self._size = kept

    def write(self, record: StepRecord) -> None:
        line = (record.as_json() + "\n").encode("utf-8")
        try:
            written = os.write(self._fd, line)
        except OSError:
            self._take_back()
            raise
        if written < len(line):
            self._take_back()
            raise OSError(f"{JSONL_NAME}: short write ({written} of {len(line)} bytes; disk full?)")
        self._size += written

    def _take_back(self) -> None:
        """Cut the file back to its last whole line."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:  # e.g. a device that cannot be truncated: nothing was kept anyway
            pass

    def flush(self) -> None:
        """Lines are written unbuffered: nothing waits in this process."""

    def close(self) -> None:
        os.close(self._fd)


def _whole_lines_size(fd: int, size: int, block: int = 65536) -> int:
    """The size of the file up to and including its last newline."""
    end = size
    while end > 0:
        start = max(0, end - block)
        chunk = os.pread(fd, end - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0
