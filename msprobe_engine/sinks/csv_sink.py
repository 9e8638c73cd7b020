"""Long-format CSV (`step,tag,value`) in `metrics.csv`: one file, whatever the tags."""
from __future__ import annotations

import csv
from typing import IO, Any

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink

CSV_NAME = "metrics.csv"


@register_sink("csv")
class CsvSink(Sink):
    """Every metric of every step as a `step,tag,value` row; alerts as `alert/<rule>` 1/0."""

    _file: IO[str]
    _csv: Any

    def open(self) -> None:
        path = self.run_dir / CSV_NAME
        new = not path.exists() or path.stat().st_size == 0
        self._file = open(path, "a", encoding="utf-8", newline="")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(["step", "tag", "value"])

    def write(self, record: StepRecord) -> None:
        self._csv.writerows((record.step, tag, value) for tag, value in record.metrics.items())
        self._csv.writerows((record.step, f"alert/{a.rule}", 1.0 if a.phase == "start" else 0.0)
                            for a in record.alerts)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
