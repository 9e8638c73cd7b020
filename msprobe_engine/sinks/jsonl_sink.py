"""One JSON object per step in `metrics.jsonl` (nan/inf as JSON's NaN/Infinity literals)."""
from __future__ import annotations

import json
import operator

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.record_file import RecordFile

JSONL_NAME = "metrics.jsonl"


@register_sink("jsonl")
class JsonlSink(Sink):
    """`step, rank, micro_steps, time, metrics, alerts` per line. Each line is written whole
    or not at all (`record_file.RecordFile`: one unbuffered write, a write cut short is taken
    back, a partial last line left by an earlier crash is removed when the file is opened)."""

    _file: RecordFile

    def __init__(self, config: "JsonlSink.Config", run_dir) -> None:
        super().__init__(config, run_dir)
        self._line = RecordLine()

    def open(self) -> None:
        self._file = RecordFile(self.run_dir / JSONL_NAME)

    def write(self, record: StepRecord) -> None:
        self._file.write((self._line(record) + "\n").encode("utf-8"))

    def flush(self) -> None:
        """Lines are written unbuffered: nothing waits in this process."""

    def close(self) -> None:
        self._file.close()


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
