"""One JSON object per step in `metrics.jsonl` (nan/inf as JSON's NaN/Infinity literals)."""
from __future__ import annotations

import json
import logging
import operator
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

    def __init__(self, config: "JsonlSink.Config", run_dir) -> None:
        super().__init__(config, run_dir)
        self._line = RecordLine()

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
        line = (self._line(record) + "\n").encode("utf-8")
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


#: what json.dumps writes for the non-finite floats (repr writes nan, inf, -inf)
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class RecordLine:
    """`record.as_json()`, the same text, cheaper for thousands of metrics: the encoded
    `"<tag>": ` of each tag is kept per layout (the tags of the last record, in order) and
    the values joined by C-level maps of repr (json.dumps writes a float as its repr, but
    nan/inf as NaN/Infinity). Values other than plain floats and ints: json.dumps itself."""

    def __init__(self) -> None:
        self._tags: list[str] = []
        self._heads: list[str] = []

    def __call__(self, record: StepRecord) -> str:
        metrics = record.metrics
        values = list(metrics.values())
        if not set(map(type, values)) <= {float, int}:
            return record.as_json()
        tags = list(metrics)
        if tags != self._tags:
            self._tags, self._heads = tags, [f"{json.dumps(tag)}: " for tag in tags]
        texts = list(map(repr, values))
        if "n" in "".join(texts):  # a nan or an inf somewhere (no finite float's repr has an n)
            texts = [_NON_FINITE.get(text, text) for text in texts]
        head = json.dumps({"step": record.step, "rank": record.rank, "micro_steps": record.micro_steps,
                           "time": record.wall_time})
        body = ", ".join(map(operator.add, self._heads, texts))
        alerts = json.dumps([a.as_dict() for a in record.alerts])
        return f'{head[:-1]}, "metrics": {{{body}}}, "alerts": {alerts}}}'
