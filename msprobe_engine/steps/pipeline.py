"""A monitored step's rows, from the device to a decision and a record:
transfer -> evaluate -> decide -> emit.

The rows measured in a step wait on the device (`collect/step_rows.py`) for the step's one
host transfer. That transfer happens before the optimizer step when a rule's action needs a
decision before the weights change (`decide_early`), or the step runs through `run_step`
(early decision); then what is measured after the optimizer step travels with the next
step's transfer, and the step's record waits for it. Otherwise it happens at the step's end,
and on an accelerator the copy may be left running and read by the next transfer (one step
late). The steps whose record waits are the one piece of decision state (`HeldSteps`).
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from msprobe_engine.collect.step_rows import StepRows
from msprobe_engine.incident.actions import StepDecision, TrainingStopped
from msprobe_engine.incident.recorder import Incident, IncidentRecorder, StepFacts
from msprobe_engine.incident.replay import Measured, every_statistic
from msprobe_engine.records import AlertEvent, StepRecord
from msprobe_engine.rules import AlertTracker, Firing, Rule
from msprobe_engine.steps.clock import StepClock
from msprobe_engine.steps.emit import RecordEmitter
from msprobe_engine.steps.replay import ReplayDriver
from msprobe_engine.stats import empty_rows
from msprobe_engine.stats.metrics import MetricNamer
from msprobe_engine.stats.table import StatTable

if TYPE_CHECKING:
    from msprobe_engine.reducer import Reducer


class HeldSteps:
    """Steps whose record waits for a later transfer: `tables` holds a step decided before its
    optimizer step (its pre-step table and the alert events found there), `micro_steps` its
    micro-step count, and that of a step whose copy is read one step late."""

    def __init__(self) -> None:
        self.tables: dict[int, tuple[StatTable, list[AlertEvent]]] = {}
        self.micro_steps: dict[int, int] = {}


class StepPipeline:
    """The rows of the steps (`rows`), the rules that judge them and the records they become.
    `facts(micro_steps)`: what an incident records of the step besides its rows."""

    def __init__(self, clock: StepClock, rules: Sequence[Rule], metrics: MetricNamer, emitter: RecordEmitter,
                 incidents: IncidentRecorder | None, replay: ReplayDriver,
                 facts: Callable[[int], StepFacts]) -> None:
        self.clock = clock
        self.rules = list(rules)
        self.metrics = metrics
        self.emitter = emitter
        self.incidents = incidents
        self.replay = replay
        self.facts = facts
        self.rows = StepRows()
        self.tracker = AlertTracker()
        self.held = HeldSteps()
        #: a rule's action needs the decision before the optimizer step (skip/stop)
        self.decide_early = any(rule.action != "continue" for rule in self.rules)
        self.backend: Any = None
        self.reducer: Reducer | None = None
        #: read a step's statistics one step late, from a host copy started at its end without
        #: waiting (only when every rule's action is `continue` and no step runs through
        #: `run_step`); None: when they live on an accelerator
        self.read_late: bool | None = None
        #: what every transferred table goes through before the rules see it (e.g. an integration's
        #: `steps.overflow.screen_scaler_overflow`); None: as measured
        self.screen: Callable[[StatTable], StatTable] | None = None

    # ---- transfer ---------------------------------------------------------------------------
    def transfer(self, reduce: bool = True, at_step_end: bool = False, merge: bool | None = None
                 ) -> dict[int, StatTable]:
        """The one device-to-host copy (`StepRows.transfer`): every pending row, grouped by step
        (`reduce`: through the reducer; a replay's transfer is not, unless `merge`: every rank
        replays together). At a step's end (`at_step_end`) in one-step-late mode the copy is
        started without waiting and the result has no table of this step: it comes with the next
        transfer. Each transfer adds the self-metering rows of the current step; every table goes
        through `screen`."""
        self.emitter.host_since = time.perf_counter()
        clock = self.clock
        tables = self.rows.transfer(clock.step, self.backend, self.reducer, reduce=reduce,
                                    merge=reduce if merge is None else merge,
                                    late=self._reads_late if at_step_end and reduce else None)
        if at_step_end and reduce and self.rows.reading_late:  # this step's copy left running
            self.held.micro_steps[clock.step] = clock.micro_steps
        if self.screen is not None:
            tables = {step: self.screen(table) for step, table in tables.items()}
        return tables

    def _reads_late(self, rows: Any) -> bool:
        """Whether this step's statistics may be read one step late (see `transfer`)."""
        if self.decide_early or self.replay.call is not None or not hasattr(self.backend, "start_copy"):
            return False
        return self.backend.on_accelerator(rows) if self.read_late is None else self.read_late

    # ---- evaluate ---------------------------------------------------------------------------
    def evaluate(self, table: StatTable, *, before_step: bool = False, whole: StatTable | None = None
                 ) -> list[Firing]:
        """What the enabled rules fire on `table`. A `whole_step` rule (e.g. misreported_grad_norm,
        whose inputs come from both sides of the optimizer step) is left out `before_step` and
        sees `whole` (the step's pre- and post-step rows together) when that is given."""
        fired: list[Firing] = []
        for rule in self.rules:
            if not rule.enabled or (before_step and rule.whole_step):
                continue
            seen = whole if whole is not None and rule.whole_step else table
            fired += rule.evaluate(seen, seen.finalized(), self.metrics(seen))
        return fired

    # ---- decide -----------------------------------------------------------------------------
    def decide(self, screen: Callable[[StatTable], StatTable] | None) -> tuple[StepDecision, list[Incident]]:
        """Before the optimizer step: transfer, evaluate, hold the step's table for its record;
        the decision and the incidents started (a replay of the step, when it ran through
        `run_step`)."""
        step = self.clock.step
        tables = self.transfer()
        table = tables.pop(step)
        if screen is not None:
            ranks, table = table.ranks, screen(table)
            table.ranks = table.ranks or ranks
        firing = self.evaluate(table, before_step=True)
        events = self.tracker.update(step, firing, scope="pre:")
        # what an earlier step showed after its optimizer step can only stop the run now
        firing += [f for f in self.emit_late(tables) if f.action == "stop"]
        self.held.tables[step] = (table, events)
        self.held.micro_steps[step] = self.clock.micro_steps
        made = self._start_incidents(step, table, table, events, firing)
        if made:
            self.incidents.conclude(made, self.replay.call, "the step was not run through Monitor.run_step",
                                    self.replay.host, self.replay_statistics)
        return StepDecision(tuple(firing)), made

    def agree(self, decision: StepDecision) -> StepDecision:
        """Ranks deciding on rank-local rows (`per_rank`) take one decision: the reducer's
        `agree`, on every rank (one collective, also after an error) when a rule can skip or stop."""
        if self.reducer is not None and self.decide_early:
            return self.reducer.agree(decision)
        return decision

    def stop(self, decision: StepDecision, made: list[Incident]) -> None:
        """A `stop` rule fired: flush every writer, then raise `TrainingStopped`."""
        self.emitter.flush()
        rules = sorted({f.rule for f in decision if f.action == "stop"})
        raise TrainingStopped(self.clock.step, rules, [incident.directory for incident in made])

    # ---- emit -------------------------------------------------------------------------------
    def finish(self) -> StepRecord | None:
        """At the step's end: its record, unless it waits (decided early, or read one step late)."""
        step = self.clock.step
        if self.decide_early or step in self.held.tables:
            return None  # emitted with the next transfer, joined with what follows the step
        tables = self.transfer(at_step_end=True)
        table = tables.pop(step, None)
        self.emit_late(tables)  # an earlier step decided early (run through run_step), or read late
        if table is None:
            return None  # read one step late: emitted with the next transfer
        firing = self.evaluate(table)
        events = self.tracker.update(step, firing)
        record = self._emit(step, table, events)
        self._conclude_late(self._start_incidents(step, table, table, events, firing))
        return record

    def emit_late(self, tables: dict[int, StatTable]) -> list[Firing]:
        """Join each earlier step's post-step rows with its held pre-step table, and emit its
        record. Returns what fires in those post-step rows."""
        empty = StatTable([], empty_rows())
        fired: list[Firing] = []
        for step in sorted(set(self.held.tables) | set(tables)):
            late = tables.get(step, empty)
            if step not in self.held.tables and not late.keys:
                continue
            early_table, events = self.held.tables.pop(step, (empty, []))
            merged = StatTable.from_rows(early_table.keys + late.keys,
                                         np.concatenate([early_table.partials, late.partials]))
            merged.ranks = late.ranks or early_table.ranks
            firing = self.evaluate(late, whole=merged)
            late_events = self.tracker.update(step, firing, scope="post:")
            self._emit(step, merged, events + late_events)
            self._conclude_late(self._start_incidents(step, merged, late, late_events, firing))
            fired += firing
        return fired

    def holds_records(self) -> bool:
        """Records wait for a transfer (`drain` emits them)."""
        return bool(self.held.tables) or (self.decide_early and bool(self.rows.pending)) or self.rows.reading_late

    def drain(self) -> None:
        """Emit the records still held back."""
        self.emit_late(self.transfer() if self.rows.waiting else {})

    def _emit(self, step: int, table: StatTable, events: list[AlertEvent]) -> StepRecord:
        micro_steps = self.held.micro_steps.pop(step, self.clock.micro_steps)
        return self.emitter.emit(step, micro_steps, table, events)

    def _start_incidents(self, step: int, table: StatTable, fresh: StatTable, events: list[AlertEvent],
                         firing: list[Firing]) -> list[Incident]:
        if self.incidents is None:
            return []
        facts = self.facts(self.held.micro_steps.get(step, self.clock.micro_steps))
        made = self.incidents.observe(step, table, fresh, events, firing, facts)
        if made and self.incidents.names_this_rank(table, events):  # its own rows, asked for now
            self.incidents.write_own_rows(made, self.rows.own_tables(self.backend))
        return made

    def _conclude_late(self, made: list[Incident]) -> None:
        if made:
            self.incidents.conclude(made, None, "found after the optimizer step: the weights have changed")

    # ---- replay -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def replay_statistics(self) -> Iterator[Measured]:
        """While a step is replayed: hooks measure into a buffer of their own, the lifecycle
        calls do nothing and the optimizer step is skipped. On a normal exit it holds the
        replay's values (every statistic of every row, by tag, and the step's metrics), its
        table and the call graph noted (`incident.replay.Measured`)."""
        self.rows.settle()
        saved, self.rows.pending, self.replay.replaying = self.rows.pending, [], True
        measured = Measured()
        try:
            yield measured
            # every rank replays a step whose merged rows fired: a data-parallel reducer that
            # says so (`replays_together`) merges the replay's rows as it did the step's
            together = self.reducer is not None and self.reducer.replays_together
            table = self.transfer(reduce=False, merge=together)[self.clock.step]
            measured.values.update(every_statistic(table))
            measured.values.update(self.metrics(table))
            graph = self.facts(self.clock.micro_steps).graph
            measured.table, measured.graph = table, graph.copy() if graph is not None else None
        finally:
            self.rows.pending, self.replay.replaying = saved, False
