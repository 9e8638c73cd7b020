"""One JSON object per step in `metrics.jsonl` (nan/inf as JSON's NaN/Infinity literals)."""
from __future__ import annotations

import json
from pathlib import Path

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import register_sink

JSONL_NAME = "metrics.jsonl"


@register_sink("jsonl")
class JsonlSink:
    def __init__(self, run_dir: Path) -> None:
        self._file = open(run_dir / JSONL_NAME, "a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        line = {"step": record.step, "rank": record.rank, "micro_steps": record.micro_steps,
                "time": record.wall_time, "metrics": record.metrics,
                "alerts": [a.as_dict() for a in record.alerts]}
        self._file.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
