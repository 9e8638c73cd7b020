"""Incidents: one directory per alert episode that starts (per rule and step), with the evidence.

The monitor calls `observe` with every table of statistics it evaluates. For each rule
whose episode starts there (at most `incidents.max_incidents` per run), the recorder finds
the first culprit and the modules that deviate most from their running averages (host-side
numpy on the rows already transferred), and hands the evidence to the writer thread. Then
`conclude` replays the step when it can (training thread) and hands over incident.json.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from msprobe_engine.dump.entry import FORMATS
from msprobe_engine.dump.reader import DUMP_JSON
from msprobe_engine.dump.writer import rank_dir_name
from msprobe_engine.incident.culprit import Culprit, first_culprit, non_finite_rows
from msprobe_engine.incident.deviation import RunningNorms, top_deviations
from msprobe_engine.incident.dumpjson import call_entry_name, stats_dump
from msprobe_engine.incident.environment import config_hash, versions, world
from msprobe_engine.incident.replay import Fired, ReplayResult, StepCall, not_run, replay_step
from msprobe_engine.incident.writer import DUMP_DIR, REPLAY_DIR, IncidentFiles
from msprobe_engine.records import AlertEvent, StepRecord
from msprobe_engine.rules import Firing
from msprobe_engine.sinks.jsonl_sink import JSONL_NAME
from msprobe_engine.stats.table import StatTable

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

log = logging.getLogger("msprobe_engine")


@dataclass
class Incident:
    """One incident: its directory, the alerts that started it and incident.json's content
    (less the replay, added by `IncidentRecorder.conclude`)."""
    directory: Path
    step: int
    rule: str
    events: list[AlertEvent]
    culprit: Culprit | None
    report: dict[str, Any]
    files: IncidentFiles


class IncidentRecorder:
    """Starts and concludes incidents for one monitor (see the module docstring)."""

    def __init__(self, monitor: "Monitor") -> None:
        self.monitor = monitor
        self.config = monitor.config.incidents
        self.root = Path(self.config.dir) if self.config.dir else Path(monitor.config.output_dir) / "incidents"
        self.norms = RunningNorms()
        self.incidents: list[Incident] = []
        self.failures: list[str] = []
        self.over_limit = 0
        self._started: set[tuple[int, str]] = set()
        self._spike_factor = min((r.factor for r in monitor.config.alerts if r.rule == "spike"), default=3.0)
        self._about_run: dict[str, Any] | None = None

    def observe(self, step: int, table: StatTable, fresh: StatTable, events: list[AlertEvent],
                firing: list[Firing]) -> list[Incident]:
        """Start the incidents of the episodes starting in `events` (found in `table`, step
        `step`), then fold the rows of `fresh` (those not seen before) into the running norms."""
        starts = [e for e in events if e.phase == "start"]
        made = self._start(step, table, starts, firing) if starts else []
        self.norms.update(fresh)
        return made

    def conclude(self, made: list[Incident], call: StepCall | None, why_not: str) -> None:
        """Replay the step when `call` allows it (else record why not), then write incident.json."""
        if not self.config.replay.enabled:
            why_not = "incidents.replay.enabled is false"
        elif self.monitor.replay_host is None:
            why_not = "this integration cannot replay a step"
        result = self._replay(made, call) if call is not None else not_run(why_not)
        for incident in made:
            replay = result.as_dict()
            if result.dump is not None:  # relative: the directory may be moved or sent on
                replay["dump"] = os.path.relpath(result.dump, incident.directory)
            report = {**incident.report, "replay": replay}
            self._submit(incident, partial(incident.files.write_report, report))

    # ---- starting -----------------------------------------------------------------------
    def _start(self, step: int, table: StatTable, starts: list[AlertEvent], firing: list[Firing]) -> list[Incident]:
        monitor = self.monitor
        fold = self.norms.deviation(table)
        graph = monitor.graph.copy() if monitor.graph is not None else None
        by_rule: dict[str, list[AlertEvent]] = {}
        for event in starts:
            by_rule.setdefault(event.rule, []).append(event)
        made = []
        for rule, events in by_rule.items():
            if (step, rule) in self._started:
                continue  # the rule's episode after the optimizer step belongs to the same incident
            self._started.add((step, rule))
            if len(self.incidents) >= self.config.max_incidents:
                self.over_limit += 1
                monitor.warn(f"incident limit reached ({self.config.max_incidents}): later alerts are "
                             "logged but leave no incident directory")
                continue
            bad = non_finite_rows(table) if rule == "non_finite" else fold > self._spike_factor
            incident = self._incident(step, table, events, firing, first_culprit(table, bad, graph), fold)
            dump = partial(stats_dump, table, graph, dict(monitor.tensor_meta), self._framework())
            self._submit(incident, partial(incident.files.write_evidence, self._records(step, table, events),
                                           self._dump_path(step), self._dump_meta(), dump))
            self.incidents.append(incident)
            made.append(incident)
        return made

    def _incident(self, step: int, table: StatTable, events: list[AlertEvent], firing: list[Firing],
                  culprit: Culprit | None, fold: np.ndarray) -> Incident:
        monitor = self.monitor
        rule = events[0].rule
        directory = self._directory(step, rule)
        actions = {(f.rule, f.tag): f.action for f in firing}
        first = events[0]
        report = {
            "step": step, "micro_steps": monitor.micro_steps, "rank": monitor.rank,
            "world": world(monitor.rank, monitor.layout),
            "rule": rule, "action": actions.get((rule, first.tag), "continue"),
            "tensor": first.tag, "value": first.value, "threshold": first.threshold,
            "alerts": [e.as_dict() for e in events],
            "culprit": self._culprit_dict(culprit),
            "top_deviations": top_deviations(table, fold, self.config.top_k),
            "files": {"metrics": JSONL_NAME, "dump": f"{self._dump_path(step)}/{DUMP_JSON}"},
            **self._run_info(), "time": time.time(),
        }
        return Incident(directory, step, rule, events, culprit, report, IncidentFiles(directory, self._failed))

    def _culprit_dict(self, culprit: Culprit | None) -> dict[str, Any] | None:
        if culprit is None:
            return None
        found = culprit.as_dict()
        if culprit.call is not None:
            found["dump_entry"] = call_entry_name(self._prefix(), culprit.call, culprit.module_class, culprit.phase)
        return found

    def _records(self, step: int, table: StatTable, events: list[AlertEvent]) -> list[StepRecord]:
        """The ring buffer's records up to `step`; the step's own record is made here when the
        monitor has not emitted it yet (alerts decided before the optimizer step)."""
        monitor = self.monitor
        records = list(monitor.history)
        if not records or records[-1].step != step:
            records.append(StepRecord(step=step, rank=monitor.rank, micro_steps=monitor.micro_steps,
                                      metrics=monitor.metrics_of(table), alerts=list(events), wall_time=time.time()))
        return records[-monitor.config.ring_buffer:]

    def _directory(self, step: int, rule: str) -> Path:
        return self.root / f"step{step}-rank{self.monitor.rank}-{rule}"

    # ---- the run ------------------------------------------------------------------------
    def _run_info(self) -> dict[str, Any]:
        if self._about_run is None:
            self._about_run = {"config_hash": config_hash(self.monitor.config), "versions": versions()}
        return self._about_run

    def _framework(self) -> str:
        return "mindspore" if "mindspore" in getattr(self.monitor.backend, "__name__", "") else "pytorch"

    def _prefix(self) -> str:
        return FORMATS[self._framework()].module_prefix

    def _dump_meta(self) -> dict[str, Any]:
        return {"task": "statistics", "level": "L0", "framework": self._framework(), "dump_data_dir": None}

    def _dump_path(self, step: int) -> str:
        """``dump/step<N>/rank<R>`` (``rank`` in a single process, as dumps are laid out)."""
        distributed = world(self.monitor.rank, {})["world_size"] > 1
        return f"{DUMP_DIR}/step{step}/{rank_dir_name(self.monitor.rank if distributed else None)}"

    # ---- replay and writing ---------------------------------------------------------------
    def _replay(self, made: list[Incident], call: StepCall) -> ReplayResult:
        """One replay for the incidents of a step; the tensor dump goes into the first one."""
        monitor = self.monitor
        first = made[0]
        fired = [Fired(e.tag, e.value, e.threshold or 0.0) for incident in made for e in incident.events]
        result = replay_step(call, monitor.replay_host, monitor.replay_statistics, fired,
                             first.directory / REPLAY_DIR, first.step, self.config.replay.level)
        log.warning("msprobe: replay of step %d: %s (%s)", first.step, result.status, result.detail)
        return result

    def _submit(self, incident: Incident, job: Callable[[], None]) -> None:
        if not self.monitor.writer.submit(job, "incident"):
            self._failed(incident.directory, "queue", OSError("the writer queue is full; the job was dropped"))

    def _failed(self, directory: Path, what: str, error: OSError) -> None:
        """A write of an incident failed (disk full, no permission): reported, the run goes on."""
        self.failures.append(f"{directory}: {what}: {error}")
        log.error("msprobe: incident %s: could not write %s: %s: %s; the training goes on",
                  directory, what, type(error).__name__, error)

