"""The training monitor: per-step statistics, alerts and sinks.

`Monitor` is framework-neutral. Integrations (and `attach` for plain
PyTorch) call its lifecycle methods, in this order on every optimizer step::

    micro_step_begin()        once per micro-batch (forward of the root module)
    add_tensors(keys, ts)     any number of times (hooks), device-side only
    before_optimizer_step()   at the gradient-accumulation boundary
    after_optimizer_step()
    step_end(loss)            finalizes the step's record

Statistics stay on the device until one packed transfer per monitored step:
at `step_end`, or, when a rule's action needs a decision before the weights
change (skip/stop), at `before_optimizer_step`, in which case what is
measured after the optimizer step travels with the next step's transfer.
A step run through `run_step` is decided early too, so that an alert found
before its optimizer step can be replayed. `before_optimizer_step` returns a
`StepDecision` (skip the optimizer step or not) and raises `TrainingStopped`
for a `stop` rule; alerts that start leave incidents (`incident` package).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import time
from pathlib import Path
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from msprobe_engine.collect.step_rows import StepRows
from msprobe_engine.config import ConfigSource, MonitorConfig, load_config
from msprobe_engine.incident.actions import StepDecision, TrainingStopped
from msprobe_engine.incident.graph import HIDDEN_KINDS, CallGraph
from msprobe_engine.incident.recorder import Incident, IncidentContext, IncidentRecorder, StepFacts
from msprobe_engine.incident.replay import ReplayHost, StepCall, every_statistic
from msprobe_engine.records import AlertEvent, StepRecord
from msprobe_engine.health import HealthMeter
from msprobe_engine.registry import framework_names, framework_of, load_framework
from msprobe_engine.contract import StepLifecycle
from msprobe_engine.control import CONTROL_NAME, ControlFile
from msprobe_engine.rules import AlertTracker, Firing, build_rules
from msprobe_engine.run_dir import open_run_dir
from msprobe_engine.sinks import BackgroundWriter, create_sinks
from msprobe_engine.state import STATE_VERSION, check_state
from msprobe_engine.stats import divide, empty_rows, numpy_backend, optional_columns
from msprobe_engine.stats.metrics import MetricNamer
from msprobe_engine.stats.table import MetricKey, StatTable

log = logging.getLogger("msprobe_engine")

#: alert events kept in memory for summaries (they are also in every sink)
ALERT_LOG_SIZE = 1000

Reducer = Callable[[list[MetricKey], Any], Any]


class Monitor(StepLifecycle):
    """Per-step numerical-health monitor. See the module docstring for the lifecycle.

    `backend`: the statistics backend (a framework's `backend` module); by default the one of
    the framework of the model given to `attach`, or of the first tensors given to
    `add_tensors`."""

    def __init__(self, config: ConfigSource = None, *, rank: int | None = None, backend: Any = None,
                 writes: bool | None = None, reducer: "Reducer | None" = None, start_step: int = 0,
                 layout: dict[str, Any] | None = None) -> None:
        """`rank`: this process's rank (default: $RANK, else 0); `writes`: whether this rank writes
        the run (default: rank 0, or every rank with `per_rank`); `reducer`: merges the packed rows
        over the framework's process groups before the transfer (one collective per step);
        `start_step`: the framework's own step count (e.g. after a resume); `layout`: the parallel
        layout recorded in incidents (e.g. {"tp": 2, "pp": 1, "dp": 4})."""
        self.config: MonitorConfig = load_config(config)
        self.rank = _default_rank() if rank is None else rank
        self.backend = backend
        self.step = start_step
        self.micro_steps = 0
        self.active = self.config.schedule.is_monitored(start_step)
        self.history: deque[StepRecord] = deque(maxlen=self.config.ring_buffer)
        self.alert_log: deque[AlertEvent] = deque(maxlen=ALERT_LOG_SIZE)
        self.records_written = 0
        self.hook_errors: dict[str, int] = {}
        self.disabled: set[str] = set()
        #: merges the packed rows over process groups just before the transfer (None: one process)
        self.reducer: Reducer | None = reducer
        self.step_end_listeners: list[Callable[[StepRecord], None]] = []
        self._rules = build_rules(self.config.alerts)
        self._metrics = MetricNamer(self.config.stats, "ratio" in self.config.watch.optimizer_state,
                                    HIDDEN_KINDS)
        self._tracker = AlertTracker()
        control = self.config.control
        #: the live control file (docs/control.md), polled at step boundaries
        self.control = ControlFile(Path(control.file or Path(self.config.output_dir) / CONTROL_NAME),
                                   control.interval_s, self._rules, self.config.schedule,
                                   self.config.watch) if control.enabled else None
        self._count_zeros = "zero_count" in optional_columns(self.config.stats)
        self.decide_early = any(rule.action != "continue" for rule in self._rules)
        #: the measured rows waiting for the step's one host transfer (`collect/step_rows.py`)
        self.rows = StepRows()
        self._early: dict[int, tuple[StatTable, list[AlertEvent]]] = {}
        self._early_micro_steps: dict[int, int] = {}  # an early-decided step's micro-steps, for its record
        self._optimizer_done = False
        self._attachments: list = []
        self._warned: set[str] = set()
        if writes is None:  # an integration may choose, e.g. one writer per pipeline stage
            writes = self.rank == 0 or self.config.per_rank
        writes = writes and bool(self.config.sinks)
        #: <output_dir>/<run name>/ and this rank's directory in it (`run_dir`)
        self.run = open_run_dir(self.config.output_dir, self.config.run_name, self.config.resume, self.rank, writes,
                                self.config.incidents.dir)
        self.run_dir = self.run.rank_dir
        self._sinks = create_sinks(self.config.sinks, self.run_dir, self.run.incidents, self.config) if writes else []
        self._health = HealthMeter([rule.name for rule in self._rules])
        self.writer = BackgroundWriter(self.config.writer.queue_size, self.config.writer.when_full,
                                       strict=self.config.strict)
        for sink in self._sinks:
            self.writer.submit(sink.open, f"{sink.name} sink open")
        self.incidents = IncidentRecorder(IncidentContext(
            self.config, self.rank, "pytorch", self.writer, self._rules, self.history, self._metrics, self.warn,
        )) if self.config.incidents.enabled else None
        if backend is not None:
            self._set_framework(framework_of(backend) or "torch")
        if self.incidents is not None:
            self.incidents.root = self.run.incidents
        #: filled by the module hooks when incidents are on (what each call read)
        self.graph = CallGraph() if self.incidents is not None else None
        #: (dtype, shape, requires_grad) of the last tensor measured under each key (incidents)
        self.tensor_meta: dict[MetricKey, tuple] = {}
        #: an integration's parallel layout (e.g. {"tp": 2, "pp": 1, "dp": 4}), recorded in incidents
        self.layout: dict[str, Any] = dict(layout or {})
        #: the framework side of a replay (`attach` sets the torch one)
        self.replay_host: ReplayHost | None = None
        self._step_call: StepCall | None = None
        self._replaying = False
        # one-step-late reads (see `_transfer` and `collect/step_rows.py`)
        #: read a step's statistics one step late, from a host copy started at its end without
        #: waiting (only when every rule's action is `continue` and no step runs through
        #: `run_step`); None: when they live on an accelerator
        self.read_late: bool | None = None
        self._host_since = time.perf_counter()
        saved = self.run.saved_state()
        if saved is not None:
            self.load_state_dict(saved)

    # ---- wiring -----------------------------------------------------------------
    def attach(self, model: Any, optimizer: Any = None) -> "Monitor":
        """Hook a model (and its optimizer) into this monitor, through the framework its
        classes come from (`registry.framework_of`: torch.nn.Module -> torch)."""
        name = framework_of(model)
        if name is None:
            raise TypeError(f"Monitor.attach: {type(model).__module__}.{type(model).__name__} is not a model of "
                            f"a registered framework ({', '.join(framework_names())})")
        framework = load_framework(name)
        self.backend = self.backend or framework.backend
        self._set_framework(name)
        self.add_attachment(*framework.attach(self, model, optimizer))
        if self.replay_host is None:
            self.replay_host = framework.replay_host()
        if self.replay_host is not None:
            self.replay_host.models.append(model)
        return self

    def add_attachment(self, *attachments: Any) -> None:
        """Hooks an integration installed for this monitor (objects with `remove()`), removed
        by `detach`/`close`."""
        self._attachments += attachments

    def detach(self) -> None:
        for attachment in self._attachments:
            attachment.remove()
        self._attachments.clear()

    # ---- lifecycle --------------------------------------------------------------
    def micro_step_begin(self) -> None:
        """A new micro-batch starts; closes the previous step if `step_end` was not called."""
        if self._replaying:
            return
        if self._optimizer_done:
            self.step_end()
        self.micro_steps += 1

    def _set_framework(self, name: str) -> None:
        """Incidents write dump.json in the format of the framework being monitored."""
        if self.incidents is not None:
            self.incidents.context.framework = "mindspore" if name == "mindspore" else "pytorch"

    def add_tensors(self, keys: Sequence[MetricKey], tensors: Sequence[Any], divisor: float = 1.0, *,
                    same: Sequence[MetricKey | None] = ()) -> None:
        """Measure `tensors` (named by `keys`) on their device; no host transfer. `divisor` (> 0,
        e.g. an fp16 loss scale still in the gradients) divides every value, exactly. `same`,
        when given, has one entry per tensor: None, or the key of an earlier row of that very
        tensor, unchanged since, added in this step (or this call) by a call that gave `same`
        too, with the same divisor; that row is repeated instead of measuring the tensor again
        (the backend's `pick`)."""
        if not (self.active and tensors):
            return
        if self.control is not None and self.control.current.muted:
            keys, tensors, same = self.control.unmuted(keys, tensors, same, self.rows.last)
            if not tensors:
                return
        if self.backend is None:
            self._find_backend(tensors[0])
        started = time.perf_counter()
        measured = [t for t, prior in zip(tensors, same) if prior is None] if same else tensors
        if not measured:
            rows = None
        elif divisor == 1.0:  # packed into rows with the step's others, at the transfer
            rows = self.backend.partial_stats(measured, count_zeros=self._count_zeros, deferred=True)
        else:
            rows = divide(self.backend.partial_stats(measured, count_zeros=self._count_zeros), divisor)
        if len(measured) < len(tensors):
            own = dict(zip([key for key, prior in zip(keys, same) if prior is None],
                           zip(itertools.repeat(rows), itertools.count())))
            rows = self.backend.pick([own[key] if prior is None else own.get(prior) or self.rows.last[prior]
                                      for key, prior in zip(keys, same)])
        if self.incidents is not None:
            self.tensor_meta.update(zip(keys, map(_tensor_meta, tensors)))
        self.rows.add(self.step, keys, rows, remember=bool(same), seconds=time.perf_counter() - started,
                      measured=len(measured))

    def discard(self, kind: str) -> None:
        """Drop this step's not yet transferred statistics of `kind`, e.g. the gradients of a
        step the framework skipped (fp16 overflow): they were thrown away, not applied."""
        self.rows.discard(self.step, kind, self.backend)

    def report_loss(self, loss: Any) -> None:
        """Tell the monitor this step's loss (a tensor or a number), before or after the step."""
        self._report_train("loss", loss)

    def report_grad_norm(self, value: Any, max_norm: float | None = None) -> None:
        """Tell the monitor the global gradient norm the training computed (`clip_grad_norm_`'s
        return, DeepSpeed's or Megatron's), before the optimizer step; `max_norm`: the clipping
        threshold, when the gradients were clipped to it. The `misreported_grad_norm` rule
        compares it with the monitor's own merged `grad/global/norm`."""
        self._report_train("reported_grad_norm", value)
        if max_norm is not None:
            self._report_train("grad_clip_max_norm", max_norm)

    def _report_train(self, name: str, value: Any) -> None:
        """A training scalar (a tensor or a number) as the `train/<name>` row of this step."""
        if not self.active or value is None:
            return
        with self.guard(f"report_{name}"):
            if not hasattr(value, "shape"):
                value = float(value)
                if self.backend is None:  # no framework seen yet: the number is measured on the host
                    self._find_backend(value)
                value = self.backend.scalar(value)
            self.add_tensors([MetricKey("train", name)], [value])

    def _find_backend(self, tensor: Any) -> None:
        """No backend was given: take the one of the framework `tensor` belongs to (numbers and
        numpy arrays: the host backend)."""
        name = framework_of(tensor)
        if name is None:
            self.backend = numpy_backend
            return
        self.backend = load_framework(name).backend
        self._set_framework(name)

    def before_optimizer_step(self, screen: Callable[[StatTable], StatTable] | None = None) -> StepDecision:
        """At the accumulation boundary, once the gradients are final. When a rule's action needs
        a decision before the weights change (skip/stop), or the step runs through `run_step`,
        the step's statistics are transferred and evaluated here. The integration skips the
        optimizer step when the returned decision says `skip` (always during a replay). A firing
        `stop` rule makes this flush every writer and raise `TrainingStopped`. `screen`, when
        given, gets the step's (reduced) table before the rules and returns the table the rules
        and the record see (e.g. without the gradients of an fp16 overflow step, which the
        framework skips by itself)."""
        if self._replaying:
            return StepDecision(replaying=True)
        if not (self.active and (self.decide_early or self._step_call is not None)):
            return StepDecision()
        decision, made = StepDecision(), []
        with self.guard("pre-step evaluation"):
            tables = self._transfer()
            table = tables.pop(self.step)
            if screen is not None:
                table = screen(table)
            firing = self._evaluate(table, before_step=True)
            events = self._tracker.update(self.step, firing, scope="pre:")
            # what an earlier step showed after its optimizer step can only stop the run now
            firing += [f for f in self._emit_late(tables) if f.action == "stop"]
            self._early[self.step] = (table, events)
            self._early_micro_steps[self.step] = self.micro_steps
            decision = StepDecision(tuple(firing))
            made = self._start_incidents(self.step, table, table, events, firing)
            if made:
                self.incidents.conclude(made, self._step_call, "the step was not run through Monitor.run_step",
                                        self.replay_host, self.replay_statistics)
        agree = getattr(self.reducer, "agree", None)  # ranks deciding on rank-local rows (per_rank)
        if agree is not None and self.decide_early:  # every rank: one collective, also after an error
            decision = agree(decision)
        if decision.stop:
            self._stop(decision, made)
        return decision

    def after_optimizer_step(self) -> None:
        """The framework's optimizer step has run (or was skipped as decided)."""
        if not self._replaying:
            self._optimizer_done = True

    def step_end(self, loss: Any = None) -> StepRecord | None:
        """Close the optimizer step: one transfer, rules, one record to the writer."""
        if self._replaying:
            return None
        self.report_loss(loss)
        record = None
        if self.active:
            with self.guard("step end"):
                record = self._finish_step()
        self._advance()
        if self.control is not None:
            with self.guard("control file"):
                self.control.poll(self)
        return record

    def _advance(self) -> None:
        """The next optimizer step begins."""
        self.step += 1
        self.micro_steps = 0
        self._optimizer_done = False
        self.active = self.config.schedule.is_monitored(self.step)

    def close(self) -> None:
        """Emit what is still pending, flush every writer and close the sinks."""
        self.drain()
        for sink in self._sinks:
            self.writer.submit(sink.close, f"{sink.name} sink close")
        if self._sinks:
            self.writer.submit(functools.partial(self.run.save_state, self.state_dict()), "monitor state")
        with self.guard("close"):
            self.detach()
        self.writer.close()

    # ---- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state to save with a checkpoint (plain Python types; `torch.save`-able):
        the step, every rule's running state, open alert episodes and incident counters.
        Emit pending records first (`drain`) so nothing measured is lost."""
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "rules": [{"rule": rule.name, "state": rule.state_dict()} for rule in self._rules],
            "episodes": self._tracker.state_dict(),
            "incidents": self.incidents.state_dict() if self.incidents is not None else None,
            "records_written": self.records_written,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the run goes on from the saved step with the same
        rule state (running averages, open episodes) and incident counters."""
        check_state(state, [rule.name for rule in self._rules])
        self.step = int(state["step"])
        self.micro_steps = 0
        self._optimizer_done = False
        self.active = self.config.schedule.is_monitored(self.step)
        for rule, saved in zip(self._rules, state["rules"]):
            rule.load_state_dict(saved["state"])
        self._tracker.load_state_dict(state["episodes"])
        self._health.restore([(first.rule, first.tag) for first in self._tracker.open_episodes()])
        if self.incidents is not None and state.get("incidents"):
            self.incidents.load_state_dict(state["incidents"])
        self.records_written = int(state.get("records_written", 0))

    def drain(self) -> None:
        """Emit the records still held back (early-decision mode keeps a step's record until
        the next transfer); call it after `step_end`, e.g. when the run is about to stop."""
        if self._early or (self.decide_early and self.rows.pending) or self.rows.reading_late:
            with self.guard("drain"):
                self._emit_late(self._transfer() if self.rows.waiting else {})

    def flush(self) -> None:
        """Wait until everything submitted so far is written."""
        for sink in self._sinks:
            self.writer.submit(sink.flush, f"{sink.name} sink flush")
        self.writer.flush()

    # ---- replay -----------------------------------------------------------------
    def run_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one training step, ``fn(*args, **kwargs)`` (forward, backward, optimizer step),
        and return its result. An alert that starts before that step's optimizer step then
        comes with a replay of the step (`incidents.replay`; see docs/incidents.md)."""
        replay = self.active and self.incidents is not None and self.config.incidents.replay.enabled
        if not replay or self.replay_host is None or self._step_call is not None or self._replaying:
            return fn(*args, **kwargs)
        self._step_call = StepCall(fn, args, kwargs, self.replay_host.capture_rng())
        try:
            return fn(*args, **kwargs)
        finally:
            self._step_call = None

    def replayable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: every call of the step function `fn` goes through `run_step`."""
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            return self.run_step(fn, *args, **kwargs)
        return step

    @property
    def replaying(self) -> bool:
        """True while a step is replayed: hooks must leave the real step's state alone."""
        return self._replaying

    @contextlib.contextmanager
    def replay_statistics(self) -> Iterator[dict[str, float]]:
        """While a step is replayed: hooks measure into a buffer of their own, the lifecycle
        calls do nothing and the optimizer step is skipped. On a normal exit the dict holds the
        replay's values (every statistic of every row, by tag, and the step's metrics)."""
        saved, self.rows.pending, self._replaying = self.rows.pending, [], True
        values: dict[str, float] = {}
        try:
            yield values
            # every rank replays a step whose merged rows fired: a data-parallel reducer that
            # says so (`replays_together`) merges the replay's rows as it did the step's
            table = self._transfer(reduce=False, merge=getattr(self.reducer, "replays_together", False))[self.step]
            values.update(every_statistic(table))
            values.update(self._metrics(table))
        finally:
            self.rows.pending, self._replaying = saved, False

    def metrics_of(self, table: StatTable) -> dict[str, float]:
        """Tag -> value of a table of statistics, as the sinks get them."""
        return self._metrics(table)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- errors -----------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a hook body: an error goes to `hook_failed(where, error)`."""
        try:
            yield
        except Exception as exc:
            self.hook_failed(where, exc)

    def hook_failed(self, where: str, exc: Exception) -> None:
        """A hook body at `where` raised `exc`: it is logged once, and `where` joins
        `monitor.disabled`, which hooks check to switch themselves off (strict mode re-raises).
        Call it from the `except` clause (what `guard` does, for hot hooks that avoid its cost)."""
        if self.config.strict:
            raise exc
        count = self.hook_errors.get(where, 0)
        self.hook_errors[where] = count + 1
        self.disabled.add(where)
        if count == 0:
            log.error("msprobe: error in %s (step %d): %s: %s; it is reported once and disabled",
                      where, self.step, type(exc).__name__, exc)

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("msprobe: %s", message)

    def warn_unmatched(self, key: str, names: list[str]) -> None:
        if names:
            self.warn(f"{key}: no module named {', '.join(names)}; nothing is watched for them")

    # ---- internals --------------------------------------------------------------
    def _transfer(self, reduce: bool = True, at_step_end: bool = False, merge: bool | None = None
                  ) -> dict[int, StatTable]:
        """The one device-to-host copy (`StepRows.transfer`): every pending row, grouped by step
        (`reduce`: through `self.reducer`; a replay's transfer is not, unless `merge`: every rank
        replays together). At a step's end (`at_step_end`) in one-step-late mode (`read_late`;
        only when no rule needs a decision before the optimizer step and the step is not run
        through `run_step`) the copy is started without waiting and the result has no table of
        this step: it comes with the next transfer. Each transfer adds the self-metering rows of
        the current step: `monitor/overhead_ms`, `monitor/host_syncs`, `monitor/tensors`."""
        self._host_since = time.perf_counter()  # Health/monitor_ms: from here to the record
        tables = self.rows.transfer(self.step, self.backend, self.reducer, reduce=reduce,
                                    merge=reduce if merge is None else merge,
                                    late=self._reads_late if at_step_end and reduce else None)
        if at_step_end and reduce and self.rows.reading_late:  # this step's copy left running
            self._early_micro_steps[self.step] = self.micro_steps
        return tables

    @property
    def transfers(self) -> int:
        """Device-to-host copies so far (one per monitored step)."""
        return self.rows.transfers

    @property
    def host_syncs(self) -> int:
        """Blocking device-to-host reads so far (at most one per monitored step)."""
        return self.rows.host_syncs

    def _reads_late(self, rows: Any) -> bool:
        """Whether this step's statistics may be read one step late (see `_transfer`)."""
        if self.decide_early or self._step_call is not None or not hasattr(self.backend, "start_copy"):
            return False
        return self.backend.on_accelerator(rows) if self.read_late is None else self.read_late

    def _finish_step(self) -> StepRecord | None:
        if self.decide_early or self.step in self._early:
            return None  # emitted with the next transfer, joined with what follows the step
        tables = self._transfer(at_step_end=True)
        table = tables.pop(self.step, None)
        self._emit_late(tables)  # an earlier step decided early (run through run_step), or read late
        if table is None:
            return None  # read one step late: emitted with the next transfer
        firing = self._evaluate(table)
        events = self._tracker.update(self.step, firing)
        record = self._emit(self.step, table, events)
        self._conclude_late(self._start_incidents(self.step, table, table, events, firing))
        return record

    def _emit_late(self, tables: dict[int, StatTable]) -> list[Firing]:
        """Early-decision mode: join each earlier step's post-step rows with its pre-step table.
        Returns what fires in those post-step rows."""
        empty = StatTable([], empty_rows())
        fired: list[Firing] = []
        for step in sorted(set(self._early) | set(tables)):
            late = tables.get(step, empty)
            if step not in self._early and not late.keys:
                continue
            early_table, events = self._early.pop(step, (empty, []))
            merged = StatTable.from_rows(early_table.keys + late.keys,
                                         np.concatenate([early_table.partials, late.partials]))
            firing = self._evaluate(late, whole=merged)
            late_events = self._tracker.update(step, firing, scope="post:")
            self._emit(step, merged, events + late_events)
            self._conclude_late(self._start_incidents(step, merged, late, late_events, firing))
            fired += firing
        return fired

    def _start_incidents(self, step: int, table: StatTable, fresh: StatTable, events: list[AlertEvent],
                         firing: list[Firing]) -> list[Incident]:
        if self.incidents is None:
            return []
        facts = StepFacts(self._early_micro_steps.get(step, self.micro_steps), self.graph, self.tensor_meta,
                          self.layout)
        return self.incidents.observe(step, table, fresh, events, firing, facts)

    def _conclude_late(self, made: list[Incident]) -> None:
        if made:
            self.incidents.conclude(made, None, "found after the optimizer step: the weights have changed")

    def _stop(self, decision: StepDecision, made: list[Incident]) -> None:
        """Flush every writer, then raise `TrainingStopped`."""
        self.flush()
        rules = sorted({f.rule for f in decision if f.action == "stop"})
        raise TrainingStopped(self.step, rules, [incident.directory for incident in made])

    def _evaluate(self, table: StatTable, *, before_step: bool = False, whole: StatTable | None = None
                  ) -> list[Firing]:
        """What the enabled rules fire on `table`. A `whole_step` rule (e.g. misreported_grad_norm,
        whose inputs come from both sides of the optimizer step) is left out `before_step` and
        sees `whole` (the step's pre- and post-step rows together) when that is given."""
        fired: list[Firing] = []
        for rule in self._rules:
            if not rule.enabled or (before_step and rule.whole_step):
                continue
            seen = whole if whole is not None and rule.whole_step else table
            fired += rule.evaluate(seen, seen.finalized(), self._metrics(seen))
        return fired

    def _emit(self, step: int, table: StatTable, events: list[AlertEvent]) -> StepRecord:
        micro_steps = self._early_micro_steps.pop(step, self.micro_steps)
        metrics = self._metrics(table)
        # the monitor's own cost: its time on the training thread for the step (monitor/overhead_ms:
        # measuring and the transfer) and since the transfer (rules, tags, this record)
        own_ms = metrics.get("monitor/overhead_ms", 0.0) + (time.perf_counter() - self._host_since) * 1e3
        metrics = self._health(table, events, metrics, own_ms)
        health = self.writer.health()  # writer/<sink>/failed, writer/dropped: only once something was lost
        record = StepRecord(step=step, rank=self.rank, micro_steps=micro_steps,
                            metrics={**metrics, **health} if health else metrics, alerts=events, wall_time=time.time())
        for event in events:
            log.warning("msprobe alert %s", _describe(event))
        self.history.append(record)
        self.alert_log.extend(events)
        for sink in self._sinks:
            self.writer.submit(lambda sink=sink: sink.write(sink.selected(record)), f"{sink.name} sink write")
        self.records_written += 1
        for listener in self.step_end_listeners:
            listener(record)
        return record


def _tensor_meta(tensor: Any) -> tuple:
    return tensor.dtype, tensor.shape, getattr(tensor, "requires_grad", False)


def _describe(event: AlertEvent) -> str:
    """`non_finite start at step 60: <tag> = nan`; `... end at step 61 after 1 step: <tag> was nan`."""
    if event.phase == "start":
        return f"{event.rule} start at step {event.step}: {event.tag} = {_fmt(event.value)}"
    steps = f"{event.steps} step{'' if event.steps == 1 else 's'}"
    return f"{event.rule} end at step {event.step} after {steps}: {event.tag} was {_fmt(event.value)} at its last firing"


def _fmt(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.6g}"


def _default_rank() -> int:
    return int(os.environ.get("RANK", "0"))

