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
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from msprobe_engine.dump.entry import FORMATS
from msprobe_engine.dump.reader import DUMP_JSON
from msprobe_engine.dump.writer import rank_dir_name
from msprobe_engine.incident.culprit import Culprit, first_culprit
from msprobe_engine.incident.deviation import RunningNorms, top_deviations
from msprobe_engine.incident.dumpjson import call_entry_name, stats_dump
from msprobe_engine.incident.environment import config_hash, versions, world
from msprobe_engine.incident.graph import CallGraph
from msprobe_engine.incident.ranks import named_ranks, rank_report
from msprobe_engine.incident.replay import Fired, ReplayHost, ReplayResult, StepCall, not_run, replay_step
from msprobe_engine.incident.writer import DUMP_DIR, REPLAY_DIR, IncidentFiles
from msprobe_engine.records import AlertEvent, StepRecord
from msprobe_engine.rules import Firing, Rule
from msprobe_engine.sinks.jsonl_sink import JSONL_NAME
from msprobe_engine.sinks.writer import BackgroundWriter
from msprobe_engine.stats.table import MetricKey, StatTable

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


@dataclass
class IncidentContext:
    """What the recorder needs from the run it serves (the monitor builds it once): its
    configuration, rank and framework, the writer thread, the rules (each says which rows
    its incidents blame), the ring buffer of records and how a table becomes metrics."""
    config: Any  # MonitorConfig: incidents, output_dir, ring_buffer
    rank: int
    framework: str  # dump.json's framework: "pytorch" | "mindspore"
    writer: BackgroundWriter
    rules: Sequence[Rule]
    history: Sequence[StepRecord]
    metrics_of: Callable[[StatTable], dict[str, float]]
    warn: Callable[[str], None]


@dataclass
class StepFacts:
    """What the run knows about the step being observed, beyond its statistics."""
    micro_steps: int
    graph: CallGraph | None
    tensor_meta: dict[MetricKey, tuple]
    layout: dict[str, Any]


class IncidentRecorder:
    """Starts and concludes incidents for one run (see the module docstring)."""

    def __init__(self, context: IncidentContext) -> None:
        self.context = context
        self.config = context.config.incidents
        self.root = Path(self.config.dir) if self.config.dir else Path(context.config.output_dir) / "incidents"
        self.norms = RunningNorms()
        self.incidents: list[Incident] = []
        self.failures: list[str] = []
        self.over_limit = 0
        #: incidents started in earlier runs of this training (restored by `load_state_dict`)
        self.earlier = 0
        self._started: set[tuple[int, str]] = set()
        self._rules = {rule.name: rule for rule in context.rules}
        self._about_run: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Counters and directory names, so a resumed run neither exceeds the limit nor reuses
        a directory."""
        return {"count": self.earlier + len(self.incidents), "over_limit": self.over_limit,
                "started": sorted([step, rule] for step, rule in self._started)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.earlier = int(state.get("count", 0))
        self.over_limit = int(state.get("over_limit", 0))
        self._started = {(int(step), str(rule)) for step, rule in state.get("started", [])}

    def observe(self, step: int, table: StatTable, fresh: StatTable, events: list[AlertEvent],
                firing: list[Firing], facts: StepFacts) -> list[Incident]:
        """Start the incidents of the episodes starting in `events` (found in `table`, step
        `step`), then fold the rows of `fresh` (those not seen before) into the running norms."""
        starts = [e for e in events if e.phase == "start"]
        made = self._start(step, table, starts, firing, facts) if starts else []
        self.norms.update(fresh)
        return made

    def names_this_rank(self, table: StatTable, events: list[AlertEvent]) -> bool:
        """Whether the odd rank the merge found (`StatTable.ranks`) named in `events`' incident is this one."""
        return table.ranks is not None and self.context.rank in named_ranks(table.ranks, events)

    def write_own_rows(self, made: list[Incident], tables: dict[int, StatTable]) -> None:
        """Into each of `made`: this rank's own statistics of its last transfers (`tables`, by step),
        asked for when the incident names this rank (`own_rows.jsonl`)."""
        lines = [{"step": step, "rank": self.context.rank, "metrics": self.context.metrics_of(table)}
                 for step, table in sorted(tables.items())]
        for incident in made:
            self._submit(incident, partial(incident.files.write_own_rows, lines))

    def conclude(self, made: list[Incident], call: StepCall | None, why_not: str,
                 host: ReplayHost | None = None,
                 measure: Callable[[], ContextManager[dict[str, float]]] | None = None) -> None:
        """Replay the step when `call` allows it, through `host` and measuring with `measure`
        (else record why not), then write incident.json."""
        if not self.config.replay.enabled:
            result = not_run("incidents.replay.enabled is false")
        elif host is None or measure is None:
            result = not_run("this integration cannot replay a step")
        elif call is None:
            result = not_run(why_not)
        else:
            result = self._replay(made, call, host, measure)
        for incident in made:
            replay = result.as_dict()
            if result.dump is not None:  # relative: the directory may be moved or sent on
                replay["dump"] = os.path.relpath(result.dump, incident.directory)
            report = {**incident.report, "replay": replay, **self._replayed_culprit(incident, result)}
            self._submit(incident, partial(incident.files.write_report, report))

    # ---- starting -----------------------------------------------------------------------
    def _start(self, step: int, table: StatTable, starts: list[AlertEvent], firing: list[Firing],
               facts: StepFacts) -> list[Incident]:
        fold = self.norms.deviation(table)
        graph = facts.graph.copy() if facts.graph is not None else None
        by_rule: dict[str, list[AlertEvent]] = {}
        for event in starts:
            by_rule.setdefault(event.rule, []).append(event)
        made = []
        for rule, events in by_rule.items():
            if (step, rule) in self._started:
                continue  # the rule's episode after the optimizer step belongs to the same incident
            self._started.add((step, rule))
            if self.earlier + len(self.incidents) >= self.config.max_incidents:
                self.over_limit += 1
                self.context.warn(f"incident limit reached ({self.config.max_incidents}): later alerts are "
                             "logged but leave no incident directory")
                continue
            incident = self._incident(step, table, events, firing, first_culprit(table, self._bad(rule, table, fold),
                                                                                graph), fold, facts)
            dump = partial(stats_dump, table, graph, dict(facts.tensor_meta), self.context.framework)
            self._submit(incident, partial(incident.files.write_evidence, self._records(step, table, events, facts),
                                           self._dump_path(step), self._dump_meta(), dump))
            self.incidents.append(incident)
            made.append(incident)
        return made

    def _bad(self, rule: str, table: StatTable, fold: np.ndarray) -> np.ndarray:
        """The rows of `table` that show `rule`'s anomaly (`fold`: their deviations)."""
        return self._rules[rule].blame(table, fold) if rule in self._rules else fold > 3.0

    def _incident(self, step: int, table: StatTable, events: list[AlertEvent], firing: list[Firing],
                  culprit: Culprit | None, fold: np.ndarray, facts: StepFacts) -> Incident:
        rank = self.context.rank
        rule = events[0].rule
        directory = self._directory(step, rule)
        actions = {(f.rule, f.tag): f.action for f in firing}
        first = events[0]
        report = {
            "step": step, "micro_steps": facts.micro_steps, "rank": rank,
            "world": world(rank, facts.layout),
            "rule": rule, "action": actions.get((rule, first.tag), "continue"),
            "tensor": first.tag, "value": first.value, "threshold": first.threshold,
            "alerts": [e.as_dict() for e in events],
            "culprit": self._culprit_dict(culprit),
            "top_deviations": top_deviations(table, fold, self.config.top_k),
            "files": {"metrics": JSONL_NAME, "dump": f"{self._dump_path(step)}/{DUMP_JSON}"},
            **self._run_info(), "time": time.time(),
        }
        if table.ranks is not None:  # the odd rank, named (the merge's spread; no gather)
            report["ranks"] = rank_report(table.ranks, events)
        return Incident(directory, step, rule, events, culprit, report, IncidentFiles(directory, self._failed))

    def _culprit_dict(self, culprit: Culprit | None) -> dict[str, Any] | None:
        if culprit is None:
            return None
        found = culprit.as_dict()
        if culprit.call is not None:
            found["dump_entry"] = call_entry_name(self._prefix(), culprit.call, culprit.module_class, culprit.phase)
        return found

    def _records(self, step: int, table: StatTable, events: list[AlertEvent], facts: StepFacts) -> list[StepRecord]:
        """The ring buffer's records up to `step`; the step's own record is made here when the
        monitor has not emitted it yet (alerts decided before the optimizer step)."""
        context = self.context
        records = list(context.history)
        if not records or records[-1].step != step:
            records.append(StepRecord(step=step, rank=context.rank, micro_steps=facts.micro_steps,
                                      metrics=context.metrics_of(table), alerts=list(events), wall_time=time.time()))
        return records[-context.config.ring_buffer:]

    def _directory(self, step: int, rule: str) -> Path:
        return self.root / f"step{step}-rank{self.context.rank}-{rule}"

    # ---- the run ------------------------------------------------------------------------
    def _run_info(self) -> dict[str, Any]:
        if self._about_run is None:
            self._about_run = {"config_hash": config_hash(self.context.config), "versions": versions()}
        return self._about_run

    def _prefix(self) -> str:
        return FORMATS[self.context.framework].module_prefix

    def _dump_meta(self) -> dict[str, Any]:
        return {"task": "statistics", "level": "L0", "framework": self.context.framework, "dump_data_dir": None}

    def _dump_path(self, step: int) -> str:
        """``dump/step<N>/rank<R>`` (``rank`` in a single process, as dumps are laid out)."""
        distributed = world(self.context.rank, {})["world_size"] > 1
        return f"{DUMP_DIR}/step{step}/{rank_dir_name(self.context.rank if distributed else None)}"

    # ---- replay and writing ---------------------------------------------------------------
    def _replay(self, made: list[Incident], call: StepCall, host: ReplayHost,
                measure: Callable[[], ContextManager[dict[str, float]]]) -> ReplayResult:
        """One replay for the incidents of a step; the tensor dump goes into the first one."""
        first = made[0]
        fired = [Fired(e.tag, e.value, e.threshold or 0.0) for incident in made for e in incident.events]
        result = replay_step(call, host, measure, fired,
                             first.directory / REPLAY_DIR, first.step, self.config.replay.level)
        log.warning("msprobe: replay of step %d: %s (%s)", first.step, result.status, result.detail)
        return result

    def _replayed_culprit(self, incident: Incident, result: ReplayResult) -> dict[str, Any]:
        """`{"culprit": ...}` searched in the replay's rows when the step's own rows named no call
        and the replay's do (a compiled step: its hooks note no call graph; the replay runs
        eagerly and does); else nothing. The culprit says `"from": "replay"`."""
        measured = result.measured
        if (incident.culprit is not None and incident.culprit.call is not None) or measured is None \
                or measured.table is None:
            return {}
        table = measured.table
        found = first_culprit(table, self._bad(incident.rule, table, self.norms.deviation(table)), measured.graph)
        if found is None or found.call is None:
            return {}
        return {"culprit": {**self._culprit_dict(found), "from": "replay"}}

    def _submit(self, incident: Incident, job: Callable[[], None]) -> None:
        if not self.context.writer.submit(job, "incident"):
            self._failed(incident.directory, "queue", OSError("the writer queue is full; the job was dropped"))

    def _failed(self, directory: Path, what: str, error: OSError) -> None:
        """A write of an incident failed (disk full, no permission): reported, the run goes on."""
        self.failures.append(f"{directory}: {what}: {error}")
        log.error("msprobe: incident %s: could not write %s: %s: %s; the training goes on",
                  directory, what, type(error).__name__, error)

