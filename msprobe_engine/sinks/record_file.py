"""An append-only file of records, each written whole or not at all.

A record is one ``os.write`` of its bytes (no buffer in this process); a write cut short (a
full disk) or failing is taken back by truncating to the end of the last whole record, and
counted by the writer as a failure (a lost record). A file whose last record was torn by an
earlier crash is cut back to its last whole record when opened again; what `whole_size`
accepts as whole is the format's business (a newline for line formats, a valid TFRecord
frame for event files).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("msprobe_engine")


class RecordFile:
    """`path` opened for appending whole records. `whole_size(fd, size)`: the size of the file
    up to the end of its last whole record (default: its last newline)."""

    def __init__(self, path: Path, whole_size: Callable[[int, int], int] | None = None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        size = os.fstat(self._fd).st_size
        self.size = (whole_size or whole_lines_size)(self._fd, size)
        if self.size < size:
            log.warning("msprobe: %s ended with a partial line (a torn record: an earlier crash or a full disk); removed %d bytes",
                        path, size - self.size)
            os.ftruncate(self._fd, self.size)

    def write(self, data: bytes) -> None:
        """Append `data` whole, or raise `OSError` leaving the file as it was."""
        try:
            written = os.write(self._fd, data)
        except OSError:
            self._take_back()
            raise
        if written < len(data):
            self._take_back()
            raise OSError(f"{self.path.name}: short write ({written} of {len(data)} bytes; disk full?)")
        self.size += written

    def _take_back(self) -> None:
        try:
            os.ftruncate(self._fd, self.size)
        except OSError:  # e.g. a device that cannot be truncated: nothing was kept anyway
            pass

    def close(self) -> None:
        os.close(self._fd)


def whole_lines_size(fd: int, size: int, block: int = 65536) -> int:
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
