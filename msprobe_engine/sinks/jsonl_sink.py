"""One JSON object per step in `metrics.jsonl` (nan/inf as JSON's NaN/Infinity literals)."""
from __future__ import annotations

from typing import IO

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink

JSONL_NAME = "metrics.jsonl"


@register_sink("jsonl")
class JsonlSink(Sink):
    """`step, rank, micro_steps, time, metrics, alerts` per line; each line written whole."""

    _file: IO[str]

    def open(self) -> None:
        self._file = open(self.run_dir / JSONL_NAME, "a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        self._file.write(record.as_json() + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
