"""Long-format CSV (`step,tag,value`) in `metrics.csv`: one file, whatever the tags."""
from __future__ import annotations

import csv
import io
import operator
from typing import IO, Any

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink

CSV_NAME = "metrics.csv"
#: value types whose repr is what csv.writer writes (repr for floats, str = repr for ints)
_PLAIN = {float, int}


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
        self._tags: list[str] = []  # the tags of the last record (its layout)
        self._heads: list[str] = []  # each one's "<tag field>," in that layout
        if new:
            self._csv.writerow(["step", "tag", "value"])

    def write(self, record: StepRecord) -> None:
        """The rows as csv.writer writes them, in one write: for plain floats and ints (their
        repr) the tags' fields are cached per layout and the rows joined by C-level maps; any
        other value type goes through csv.writer itself."""
        metrics = record.metrics
        values = list(metrics.values())
        if set(map(type, values)) <= _PLAIN:
            tags = list(metrics)
            if tags != self._tags:  # a new layout: each tag's field and separator, once
                self._tags, self._heads = tags, [f"{_field(tag)}," for tag in tags]
            if values:
                step = f"{record.step},"
                rows = map(operator.add, self._heads, map(repr, values))
                self._file.write(step + f"\r\n{step}".join(rows) + "\r\n")
        else:
            self._csv.writerows((record.step, tag, value) for tag, value in metrics.items())
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
