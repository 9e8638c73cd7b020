"""Long-format CSV (`step,tag,value`) in `metrics.csv`: one file, whatever the tags.

A step's rows (its alerts included) are one write, whole or not at all (`record_file`): a
full disk loses the step (counted by the writer), never half of it; a torn last row left by
a crash is cut when the file is opened again."""
from __future__ import annotations

import csv
import io
import operator
from collections.abc import Iterable

from msprobe_engine.json_text import number_texts
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.record_file import RecordFile

CSV_NAME = "metrics.csv"
#: value types written with `number_texts` (csv.writer would write their repr)
_PLAIN = {float, int}


@register_sink("csv")
class CsvSink(Sink):
    """Every metric of every step as a `step,tag,value` row; alerts as `alert/<rule>` 1/0."""

    _file: RecordFile

    def open(self) -> None:
        self._file = RecordFile(self.run_dir / CSV_NAME)
        self._tags: list[str] = []  # the tags of the last record (its layout)
        self._heads: list[bytes] = []  # each one's "<tag field>," in that layout (UTF-8)
        if self._file.size == 0:
            self._file.write(b"step,tag,value\r\n")

    def write(self, record: StepRecord) -> None:
        """The rows as csv.writer writes them but for the spelling of the numbers, in one write: for
        plain floats and ints the tags' fields are cached per layout and the values' texts are
        orjson's (`json_text.number_texts`; nan and infinities as repr writes them); any other
        value type goes through csv.writer itself."""
        metrics = record.metrics
        values = list(metrics.values())
        text = b""
        if set(map(type, values)) <= _PLAIN:
            tags = list(metrics)
            if tags != self._tags:  # a new layout: each tag's field and separator, once
                self._tags, self._heads = tags, [f"{_field(tag)},".encode("utf-8") for tag in tags]
            if values:
                step = b"%d," % record.step
                rows = map(operator.add, self._heads, number_texts(values))
                text = step + (b"\r\n" + step).join(rows) + b"\r\n"
        else:
            text = _rows((record.step, tag, value) for tag, value in metrics.items()).encode("utf-8")
        if record.alerts:
            text += _rows((record.step, f"alert/{a.rule}", 1.0 if a.phase == "start" else 0.0)
                          for a in record.alerts).encode("utf-8")
        if text:
            self._file.write(text)

    def flush(self) -> None:
        """Rows are written unbuffered: nothing waits in this process."""

    def close(self) -> None:
        self._file.close()


def _rows(rows: Iterable[tuple]) -> str:
    """`rows` as csv.writer writes them."""
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


def _field(text: str) -> str:
    """`text` as one field of a row written by csv.writer (quoted when it needs to be)."""
    out = io.StringIO()
    csv.writer(out).writerow([text])
    return out.getvalue()[:-2]
