"""Long-format CSV (`step,tag,value`) in `metrics.csv`: one file, whatever the tags."""
from __future__ import annotations

import csv
import io
from typing import IO, Any

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink

CSV_NAME = "metrics.csv"


@register_sink("csv")
class CsvSink(Sink):
    """Every metric of every step as a `step,tag,value` row; alerts as `alert/<rule>` 1/0."""

    _file: IO[str]
    _csv: Any
    #: tag -> the tag as a CSV field (quoted where csv.writer quotes it), computed once
    _fields: dict[str, str]

    def open(self) -> None:
        path = self.run_dir / CSV_NAME
        new = not path.exists() or path.stat().st_size == 0
        self._file = open(path, "a", encoding="utf-8", newline="")
        self._csv = csv.writer(self._file)
        self._fields = {}
        if new:
            self._csv.writerow(["step", "tag", "value"])

    def write(self, record: StepRecord) -> None:
        """The rows as csv.writer writes them (a float as its repr), joined in one write: a
        step's thousands of rows cost one string join instead of a writer call per field."""
        fields = self._fields
        prefix = f"{record.step},"
        for tag in record.metrics.keys() - fields.keys():
            fields[tag] = _field(tag)
        self._file.write("".join([f"{prefix}{fields[tag]},{value!r}\r\n" if type(value) is float
                                  else f"{prefix}{fields[tag]},{value}\r\n"
                                  for tag, value in record.metrics.items()]))
        self._csv.writerows((record.step, f"alert/{a.rule}", 1.0 if a.phase == "start" else 0.0)
                            for a in record.alerts)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _field(text: str) -> str:
    """`text` as one field of a row written by csv.writer (quoted when it needs to be)."""
    out = io.StringIO()
    csv.writer(out).writerow([text])
    return out.getvalue()[:-2]
