"""The files of one incident directory. Every method runs on the monitor's writer thread.

::

    <incidents dir>/step<N>-rank<R>-<rule>/
        metrics.jsonl                         the last records of the ring buffer, up to step N
        own_rows.jsonl                        this rank's own (unmerged) statistics of its last
                                              transfers, when the incident names this rank
        dump/step<N>/<rank dir>/dump.json     step N's statistics as an msprobe dump.json
        replay/step<N>/<rank dir>/...         the replay's tensor dump, when the step was replayed
        incident.json                         written last, atomically: its presence means complete

A write that fails for want of room or permission (`OSError`) is handed to `on_error` and
the run goes on; any other error is a bug and propagates to the writer (strict mode raises it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from msprobe_engine.dump.reader import DUMP_JSON
from msprobe_engine.dump.writer import dump_json_text, write_file
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.jsonl_sink import JSONL_NAME

INCIDENT_JSON = "incident.json"
DUMP_DIR = "dump"
REPLAY_DIR = "replay"
OWN_ROWS = "own_rows.jsonl"

ErrorHandler = Callable[[Path, str, OSError], None]


class IncidentFiles:
    """Writes one incident directory; `on_error(directory, what, error)` hears of failed writes."""

    def __init__(self, directory: Path, on_error: ErrorHandler) -> None:
        self.directory = directory
        self.on_error = on_error

    def write_evidence(self, records: list[StepRecord], dump_rank_dir: str, dump_meta: dict[str, Any],
                       dump_data: Callable[[], dict[str, Any]]) -> None:
        """metrics.jsonl and the statistics dump.json in `dump_rank_dir` (relative to the
        incident directory); `dump_data` builds the entries here."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_file(self.directory / JSONL_NAME, "".join(record.as_json() + "\n" for record in records))
            rank_dir = self.directory / dump_rank_dir
            rank_dir.mkdir(parents=True, exist_ok=True)
            write_file(rank_dir / DUMP_JSON, dump_json_text(dump_meta, dump_data()))
        except OSError as exc:
            self.on_error(self.directory, "evidence", exc)

    def write_own_rows(self, lines: list[dict[str, Any]]) -> None:
        """own_rows.jsonl: this rank's own statistics, one step a line."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_file(self.directory / OWN_ROWS, "".join(json.dumps(line) + "\n" for line in lines))
        except OSError as exc:
            self.on_error(self.directory, "own rows", exc)

    def write_report(self, report: dict[str, Any]) -> None:
        """incident.json, through a temporary file and a rename."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self.directory / f".{INCIDENT_JSON}.partial"
            write_file(partial, json.dumps(report, indent=1) + "\n")
            os.replace(partial, self.directory / INCIDENT_JSON)
        except OSError as exc:
            self.on_error(self.directory, INCIDENT_JSON, exc)
