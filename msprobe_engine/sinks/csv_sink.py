"""Long-format CSV (`step,tag,value`) in `metrics.csv`: one file, whatever the tags."""
from __future__ import annotations

import csv
from pathlib import Path

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import register_sink

CSV_NAME = "metrics.csv"


@register_sink("csv")
class CsvSink:
    def __init__(self, run_dir: Path) -> None:
        path = run_dir / CSV_NAME
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
