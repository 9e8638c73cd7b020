"""One JSON object per step in `metrics.jsonl` (nan/inf as JSON's NaN/Infinity literals)."""
from __future__ import annotations

import json

import orjson

from msprobe_engine.json_text import metrics_json
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

    def open(self) -> None:
        self._file = RecordFile(self.run_dir / JSONL_NAME)

    def write(self, record: StepRecord) -> None:
        self._file.write(record_line(record) + b"\n")

    def flush(self) -> None:
        """Lines are written unbuffered: nothing waits in this process."""

    def close(self) -> None:
        self._file.close()


def record_line(record: StepRecord) -> bytes:
    """`record.as_json()` as UTF-8, cheaper for thousands of metrics: plain float and int metrics
    encoded by orjson (`json_text.metrics_json`: the same values, JSON's spelling of each number,
    no spaces); other values through `as_json` itself."""
    metrics = record.metrics
    if set(map(type, metrics.values())) <= {float, int}:
        try:
            body = metrics_json(metrics)
        except orjson.JSONEncodeError:  # an int beyond 64 bits
            pass
        else:
            head = orjson.dumps({"step": record.step, "rank": record.rank, "micro_steps": record.micro_steps,
                                 "time": record.wall_time})
            alerts = json.dumps([a.as_dict() for a in record.alerts]).encode()  # Python's json: a nan value as NaN
            return b'%s,"metrics":%s,"alerts":%s}' % (head[:-1], body, alerts)
    return record.as_json().encode("utf-8")
