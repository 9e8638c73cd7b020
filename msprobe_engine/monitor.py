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

import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from msprobe_engine.config import ConfigSource, MonitorConfig, load_config
from msprobe_engine.contract import StepCloser, StepLifecycle
from msprobe_engine.control import CONTROL_NAME, Control, ControlFile
from msprobe_engine.health import HealthMeter
from msprobe_engine.hook_errors import HookErrors
from msprobe_engine.incident.actions import StepDecision, TrainingStopped
from msprobe_engine.incident.graph import HIDDEN_KINDS, CallGraph
from msprobe_engine.incident.recorder import Incident, IncidentContext, IncidentRecorder, StepFacts
from msprobe_engine.incident.replay import ReplayHost
from msprobe_engine.reducer import Reducer
from msprobe_engine.records import StepRecord
from msprobe_engine.registry import framework_names, framework_of, load_framework
from msprobe_engine.rules import build_rules
from msprobe_engine.run_dir import open_run_dir
from msprobe_engine.sinks import BackgroundWriter, create_sinks
from msprobe_engine.stats import divide, numpy_backend, optional_columns
from msprobe_engine.stats.metrics import MetricNamer
from msprobe_engine.stats.table import MetricKey, StatTable
from msprobe_engine.steps.clock import StepClock
from msprobe_engine.steps.emit import RecordEmitter
from msprobe_engine.steps.pipeline import StepPipeline
from msprobe_engine.steps.replay import ReplayDriver, replayable
from msprobe_engine.steps.state import load_state, save_state


#: the dump format of incidents before any framework is seen (numbers measured on the host)
DEFAULT_DUMP_FORMAT = "pytorch"


class Monitor(StepLifecycle):
    """Per-step numerical-health monitor (see the module docstring for the lifecycle): the facade
    over its parts, the step clock (`steps/clock.py`), the pipeline from rows to decisions and
    records (`steps/pipeline.py`, `steps/emit.py`), the replay driver (`steps/replay.py`), the
    saved state (`steps/state.py`) and the hook error policy (`hook_errors.py`).

    `backend`: the statistics backend (a framework's `backend` module); by default the one of
    the framework of the model given to `attach`, or of the first tensors given to
    `add_tensors`."""

    def __init__(self, config: ConfigSource = None, *, rank: int | None = None, backend: Any = None,
                 writes: bool | None = None, reducer: Reducer | None = None, start_step: int = 0,
                 layout: dict[str, Any] | None = None) -> None:
        """`rank`: this process's rank (default: $RANK, else 0); `writes`: whether this rank writes
        the run (default: rank 0, or every rank with `per_rank`); `reducer`: merges the packed rows
        over the framework's process groups before the transfer (one collective per step);
        `start_step`: the framework's own step count (e.g. after a resume); `layout`: the parallel
        layout recorded in incidents (e.g. {"tp": 2, "pp": 1, "dp": 4})."""
        self.config: MonitorConfig = load_config(config)
        config = self.config
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.clock = StepClock(config.schedule, start_step)
        self.errors = HookErrors(config.strict, step=lambda: self.clock.step)
        #: errors in hook bodies so far, by place; the places switched off (hooks check it)
        self.hook_errors, self.disabled = self.errors.counts, self.errors.disabled
        self._rules = build_rules(config.alerts)
        metrics = MetricNamer(config.stats, "ratio" in config.watch.optimizer_state, HIDDEN_KINDS)
        #: the live control file (docs/control.md), polled at step boundaries
        self.control = ControlFile(Path(config.control.file or Path(config.output_dir) / CONTROL_NAME),
                                   config.control.interval_s, [rule.name for rule in self._rules], config.schedule,
                                   config.watch) if config.control.enabled else None
        self._count_zeros = "zero_count" in optional_columns(config.stats)
        self._attachments: list = []
        self._closers: list[StepCloser] = []
        if writes is None:  # an integration may choose, e.g. one writer per pipeline stage
            writes = self.rank == 0 or config.per_rank
        writes = writes and bool(config.sinks)
        #: <output_dir>/<run name>/ and this rank's directory in it (`run_dir`)
        self.run = open_run_dir(config.output_dir, config.run_name, config.resume, self.rank, writes,
                                config.incidents.dir)
        self.run_dir = self.run.rank_dir
        sinks = create_sinks(config.sinks, self.run_dir, self.run.incidents) if writes else []
        self.writer = BackgroundWriter(config.writer.queue_size, config.writer.when_full, strict=config.strict)
        for sink in sinks:
            self.writer.submit(sink.open, f"{sink.name} sink open")
        emitter = RecordEmitter(self.rank, sinks, self.writer, metrics, HealthMeter([r.name for r in self._rules]),
                                config.ring_buffer)
        self.history, self.alert_log, self.step_end_listeners = emitter.history, emitter.alert_log, emitter.listeners
        self.incidents = IncidentRecorder(IncidentContext(
            config, self.rank, DEFAULT_DUMP_FORMAT, self.writer, self._rules, self.history, metrics, self.warn,
        )) if config.incidents.enabled else None
        if self.incidents is not None:
            self.incidents.root = self.run.incidents
        #: filled by the module hooks when incidents are on (what each call read)
        self.graph = CallGraph() if self.incidents is not None else None
        #: (dtype, shape, requires_grad) of the last tensor measured under each key (incidents)
        self.tensor_meta: dict[MetricKey, tuple] = {}
        #: an integration's parallel layout (e.g. {"tp": 2, "pp": 1, "dp": 4}), recorded in incidents
        self.layout: dict[str, Any] = dict(layout or {})
        self.replay = ReplayDriver()
        self.pipeline = StepPipeline(self.clock, self._rules, metrics, emitter, self.incidents, self.replay,
                                     lambda micro: StepFacts(micro, self.graph, self.tensor_meta, self.layout))
        self.pipeline.reducer = reducer
        #: the measured rows waiting for the step's one host transfer (`collect/step_rows.py`)
        self.rows = self.pipeline.rows
        self.decide_early = self.pipeline.decide_early
        self._use_framework(backend, framework_of(backend) if backend is not None else None)
        saved = self.run.saved_state()
        if saved is not None:
            self.load_state_dict(saved)

    # ---- the parts' state, as attributes -------------------------------------------------
    step = property(lambda self: self.clock.step, lambda self, v: setattr(self.clock, "step", v),
                    doc="The current optimizer step.")
    micro_steps = property(lambda self: self.clock.micro_steps, lambda self, v: setattr(self.clock, "micro_steps", v),
                           doc="Micro-steps begun in the current optimizer step.")
    active = property(lambda self: self.clock.active, lambda self, v: setattr(self.clock, "active", v),
                      doc="Whether the current step is monitored (hooks return at once when not).")
    backend = property(lambda self: self.pipeline.backend, lambda self, v: setattr(self.pipeline, "backend", v),
                       doc="The statistics backend (a framework's `backend` module).")
    reducer = property(lambda self: self.pipeline.reducer, lambda self, v: setattr(self.pipeline, "reducer", v),
                       doc="Merges the packed rows over process groups just before the transfer (None: one process).")
    read_late = property(lambda self: self.pipeline.read_late, lambda self, v: setattr(self.pipeline, "read_late", v),
                         doc="Read a step's statistics one step late (None: when they live on an accelerator).")
    replay_host = property(lambda self: self.replay.host, doc="The framework side of a replay (None: no replays).")
    replaying = property(lambda self: self.replay.replaying,
                         doc="True while a step is replayed: hooks must leave the real step's state alone.")
    records_written = property(lambda self: self.pipeline.emitter.records_written, doc="Records emitted so far.")
    transfers = property(lambda self: self.rows.transfers, doc="Device-to-host copies so far (one per monitored step).")
    host_syncs = property(lambda self: self.rows.host_syncs,
                          doc="Blocking device-to-host reads so far (at most one per monitored step).")
    _warned = property(lambda self: self.errors.warned)

    # ---- wiring -----------------------------------------------------------------
    def attach(self, model: Any, optimizer: Any = None) -> "Monitor":
        """Hook a model (and its optimizer) into this monitor, through the framework its
        classes come from (`registry.framework_of`: torch.nn.Module -> torch)."""
        name = framework_of(model)
        if name is None:
            raise TypeError(f"Monitor.attach: {type(model).__module__}.{type(model).__name__} is not a model of "
                            f"a registered framework ({', '.join(framework_names())})")
        framework = self._use_framework(self.backend, name)
        self.add_attachment(*framework.attach(self, model, optimizer))
        if self.replay.host is None:
            self.replay.host = framework.replay_host()
        if self.replay.host is not None:
            self.replay.host.models.append(model)
        return self

    def _use_framework(self, backend: Any, name: str | None) -> Any:
        """Measure with `backend` (by default framework `name`'s); incidents write dump.json in
        the dump format of the framework (`Framework.dump_format`). Returns the framework."""
        framework = load_framework(name) if name is not None else None
        self.pipeline.backend = backend or (framework.backend if framework is not None else None)
        if self.incidents is not None and framework is not None:
            self.incidents.context.framework = framework.dump_format
        return framework

    def add_attachment(self, *attachments: Any) -> None:
        """Hooks an integration installed for this monitor (objects with `remove()`), removed
        by `detach`/`close`."""
        self._attachments += attachments

    @property
    def attachments(self) -> tuple[Any, ...]:
        """What `attach` and the integration installed (`add_attachment`), in that order."""
        return tuple(self._attachments)

    def add_step_closer(self, closer: StepCloser) -> None:
        """`closer.close_step(loss)` runs first in each `step_end`, `closer.step_closed()` last
        (a framework measuring a step's tensors together at its end)."""
        self._closers.append(closer)

    def detach(self) -> None:
        for attachment in self._attachments:
            attachment.remove()
        self._attachments.clear()
        self._closers.clear()

    def forgo_replay(self, reason: str) -> None:
        """Replay no step (an integration whose steps cannot be replayed on one rank alone); warns once."""
        if self.replay.host is not None:
            self.replay.host = None
            self.warn(reason)

    # ---- lifecycle --------------------------------------------------------------
    def micro_step_begin(self) -> None:
        """A new micro-batch starts; closes the previous step if `step_end` was not called."""
        if self.replay.replaying:
            return
        if self.clock.optimizer_done:
            self.step_end()
        self.clock.micro_steps += 1

    def add_tensors(self, keys: Sequence[MetricKey], tensors: Sequence[Any], divisor: float = 1.0, *,
                    same: Sequence[MetricKey | None] = ()) -> None:
        """Measure `tensors` (named by `keys`) on their device; no host transfer. `divisor` (> 0,
        e.g. an fp16 loss scale still in the gradients) divides every value, exactly. `same`,
        when given, has one entry per tensor: None, or the key of an earlier row of that very
        tensor, unchanged since, added in this step (or this call) by a call that gave `same`
        too, with the same divisor; that row is repeated instead of measuring the tensor again
        (the backend's `pick`)."""
        if not (self.clock.active and tensors):
            return
        if self.control is not None and self.control.current.muted:
            keys, tensors, same = self.control.unmuted(keys, tensors, same, self.rows.last)
            if not tensors:
                return
        if self.backend is None:
            self._find_backend(tensors[0])
        backend, started = self.backend, time.perf_counter()
        measured = [t for t, prior in zip(tensors, same) if prior is None] if same else tensors
        if not measured:
            rows = None
        elif divisor == 1.0:  # packed into rows with the step's others, at the transfer
            rows = backend.partial_stats(measured, count_zeros=self._count_zeros, deferred=True)
        else:
            rows = divide(backend.partial_stats(measured, count_zeros=self._count_zeros), divisor)
        if len(measured) < len(tensors):
            own = dict(zip([key for key, prior in zip(keys, same) if prior is None],
                           zip(itertools.repeat(rows), itertools.count())))
            rows = backend.pick([own[key] if prior is None else own.get(prior) or self.rows.last[prior]
                                 for key, prior in zip(keys, same)])
        if self.incidents is not None:
            self.tensor_meta.update((key, (t.dtype, t.shape, getattr(t, "requires_grad", False)))
                                    for key, t in zip(keys, tensors))
        self.rows.add(self.clock.step, keys, rows, remember=bool(same), seconds=time.perf_counter() - started,
                      measured=len(measured))

    def discard(self, kind: str) -> None:
        """Drop this step's not yet transferred statistics of `kind`, e.g. the gradients of a
        step the framework skipped (fp16 overflow): they were thrown away, not applied."""
        self.rows.discard(self.clock.step, kind, self.backend)

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
        if not self.clock.active or value is None:
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
        self._use_framework(numpy_backend if name is None else None, name)

    def before_optimizer_step(self, screen: Callable[[StatTable], StatTable] | None = None) -> StepDecision:
        """At the accumulation boundary, once the gradients are final. When a rule's action needs
        a decision before the weights change (skip/stop), or the step runs through `run_step`,
        the step's statistics are transferred and evaluated here. The integration skips the
        optimizer step when the returned decision says `skip` (always during a replay). A firing
        `stop` rule makes this flush every writer and raise `TrainingStopped`. `screen`, when
        given, gets the step's (reduced) table before the rules and returns the table the rules
        and the record see (e.g. without the gradients of an fp16 overflow step, which the
        framework skips by itself)."""
        if self.replay.replaying:
            return StepDecision(replaying=True)
        if not (self.clock.active and (self.decide_early or self.replay.call is not None)):
            return StepDecision()
        decision, made = StepDecision(), []
        with self.guard("pre-step evaluation"):
            decision, made = self.pipeline.decide(screen)
        decision = self.pipeline.agree(decision)
        if decision.stop:
            self._stop(decision, made)
        return decision

    def _stop(self, decision: StepDecision, made: list[Incident]) -> None:
        """Flush every writer, then raise `TrainingStopped`."""
        self.flush()
        rules = sorted({f.rule for f in decision if f.action == "stop"})
        raise TrainingStopped(self.clock.step, rules, [incident.directory for incident in made])

    def after_optimizer_step(self) -> None:
        """The framework's optimizer step has run (or was skipped as decided)."""
        if not self.replay.replaying:
            self.clock.optimizer_done = True

    def step_end(self, loss: Any = None) -> StepRecord | None:
        """Close the optimizer step: one transfer, rules, one record to the writer."""
        if self.replay.replaying:
            return None
        for closer in self._closers:
            loss = closer.close_step(loss)
        self.report_loss(loss)
        record = None
        if self.clock.active:
            with self.guard("step end"):
                record = self.pipeline.finish()
        self.clock.go_to(self.clock.step + 1)
        if self.control is not None:
            with self.guard("control file"):
                self._apply(self.control.poll(self.writer, self.clock.step))
        for closer in self._closers:
            closer.step_closed()
        return record

    def _apply(self, control: Control | None) -> None:
        """What the control file says, from this step on: the schedule, the rules switched off."""
        if control is not None:
            self.config.schedule = control.schedule
            self.clock.reschedule(control.schedule)
            for rule in self._rules:
                rule.enabled = rule.name not in control.rules_off

    def close(self) -> None:
        """Emit what is still pending, flush every writer and close the sinks."""
        self.drain()
        sinks = self.pipeline.emitter.sinks
        for sink in sinks:
            self.writer.submit(sink.close, f"{sink.name} sink close")
        if sinks:
            state = self.state_dict()
            self.writer.submit(lambda: self.run.save_state(state), "monitor state")
        with self.guard("close"):
            self.detach()
        self.writer.close()

    # ---- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state to save with a checkpoint (plain Python types; `torch.save`-able):
        the step, every rule's running state, open alert episodes and incident counters.
        Emit pending records first (`drain`) so nothing measured is lost."""
        return save_state(self.pipeline)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the run goes on from the saved step with the same
        rule state (running averages, open episodes) and incident counters."""
        load_state(self.pipeline, state)

    def drain(self) -> None:
        """Emit the records still held back (early-decision mode keeps a step's record until
        the next transfer); call it after `step_end`, e.g. when the run is about to stop."""
        if self.pipeline.holds_records():
            with self.guard("drain"):
                self.pipeline.drain()

    def flush(self) -> None:
        """Wait until everything submitted so far is written."""
        self.pipeline.emitter.flush()

    # ---- replay -----------------------------------------------------------------
    def run_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one training step, ``fn(*args, **kwargs)`` (forward, backward, optimizer step),
        and return its result. An alert that starts before that step's optimizer step then
        comes with a replay of the step (`incidents.replay`; see docs/incidents.md)."""
        wanted = self.clock.active and self.incidents is not None and self.config.incidents.replay.enabled
        return self.replay.run_step(wanted, fn, args, kwargs)

    def replayable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: every call of the step function `fn` goes through `run_step`."""
        return replayable(self.run_step, fn)

    def replay_statistics(self) -> Any:
        """Context manager for a replay: see `StepPipeline.replay_statistics`."""
        return self.pipeline.replay_statistics()

    def metrics_of(self, table: StatTable) -> dict[str, float]:
        """Tag -> value of a table of statistics, as the sinks get them."""
        return self.pipeline.metrics(table)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- errors (`hook_errors.HookErrors`) ---------------------------------------
    def guard(self, where: str) -> Any:
        """Context manager around a hook body: an error goes to `hook_failed(where, error)`."""
        return self.errors.guard(where)

    def hook_failed(self, where: str, exc: Exception) -> None:
        """A hook body at `where` raised `exc`: it is logged once, and `where` joins
        `monitor.disabled`, which hooks check to switch themselves off (strict mode re-raises).
        Call it from the `except` clause (what `guard` does, for hot hooks that avoid its cost)."""
        self.errors.failed(where, exc)

    def warn(self, message: str) -> None:
        """Log `message` once."""
        self.errors.warn(message)

    def warn_unmatched(self, key: str, names: list[str]) -> None:
        if names:
            self.warn(f"{key}: no module named {', '.join(names)}; nothing is watched for them")
