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

import functools
import logging
import os
from typing import Any, Callable

from msprobe_engine import exit_guard
from msprobe_engine.config import ConfigSource, MonitorConfig, load_config
from msprobe_engine.incident.environment import snapshot, write_snapshot
from msprobe_engine.contract import StepLifecycle
from msprobe_engine.control import Control, ControlFile
from msprobe_engine.health import HealthMeter
from msprobe_engine.hook_errors import HookErrors
from msprobe_engine.handles import Removable
from msprobe_engine.incident.actions import StepDecision
from msprobe_engine.incident.graph import HIDDEN_KINDS, CallGraph
from msprobe_engine.incident.recorder import IncidentContext, IncidentRecorder, StepFacts
from msprobe_engine.reducer import Reducer
from msprobe_engine.records import StepRecord
from msprobe_engine.registry import framework_of
from msprobe_engine.rules import build_rules
from msprobe_engine.stats import optional_columns
from msprobe_engine.stats.metrics import MetricNamer
from msprobe_engine.stats.table import MetricKey, StatTable
from msprobe_engine.steps.clock import StepClock
from msprobe_engine.steps.emit import RecordEmitter
from msprobe_engine.steps.measure import Measurer
from msprobe_engine.steps.outputs import open_outputs
from msprobe_engine.steps.pipeline import StepPipeline
from msprobe_engine.steps.replay import ReplayDriver, replayable
from msprobe_engine.steps.state import load_state, resume, save_state
from msprobe_engine.steps.wiring import Wiring


log = logging.getLogger("msprobe_engine")

#: the dump format of incidents before any framework is seen (numbers measured on the host)
DEFAULT_DUMP_FORMAT = "pytorch"


def _part(part: str, name: str, doc: str, settable: bool = True) -> property:
    """An attribute of the monitor that lives in one of its parts (`part`: a dotted path). The
    getter is a plain function, which Dynamo traces (compiled hooks read `active`); a read costs
    ~20 ns more than through an `operator.attrgetter`, which Dynamo cannot trace (0.13 vs 0.11 us)."""
    head, _, rest = part.partition(".")

    def owner(monitor: "Monitor") -> Any:
        found = getattr(monitor, head)
        return getattr(found, rest) if rest else found

    def get(monitor: "Monitor") -> Any:
        return getattr(getattr(getattr(monitor, head), rest), name) if rest else getattr(getattr(monitor, head), name)

    setter = (lambda monitor, value: setattr(owner(monitor), name, value)) if settable else None
    return property(get, setter, doc=doc)


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
        self.guard, self.hook_failed, self.warn = self.errors.guard, self.errors.failed, self.errors.warn
        self._rules = build_rules(config.alerts)
        metrics = MetricNamer(config.stats, "ratio" in config.watch.optimizer_state, HIDDEN_KINDS)
        #: the live control file (docs/control.md), polled at step boundaries
        self.control = ControlFile.of(config, [rule.name for rule in self._rules])
        outputs = open_outputs(config, self.rank, writes)
        #: <output_dir>/<run name>/ and this rank's directory in it (`run_dir`); the writer thread
        self.run, self.run_dir, self.writer = outputs.run, outputs.run.rank_dir, outputs.writer
        emitter = RecordEmitter(self.rank, outputs.sinks, self.writer, metrics,
                                HealthMeter([r.name for r in self._rules]), config.ring_buffer)
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
        self.wiring = Wiring(self.pipeline, self.incidents, self.replay)
        self.wiring.use_framework(backend, framework_of(backend) if backend is not None else None)
        #: hooks installed for this monitor (objects with `remove()`), removed by `detach`/`close`
        self.add_attachment, self.add_step_closer, self.detach = self.wiring.add, self.wiring.add_closer, \
            self.wiring.remove
        self._measure = Measurer(self.clock, self.pipeline, self.control,
                                 "zero_count" in optional_columns(config.stats),
                                 self.tensor_meta if self.incidents is not None else None, self.wiring.find_backend)
        #: `StepLifecycle.add_tensors`, the hot path: the measurer's own method, no call in between
        self.add_tensors = self._measure.add
        #: the rows of differences ``after[i] - before[i]`` (the optimizer's update), see `Measurer.add_differences`
        self.add_differences = self._measure.add_differences
        if self.pipeline.emitter.sinks:  # environment.json, for `config-check` (built and written on the writer thread)
            self.record_environment()
        resume(self.pipeline, self.run, start_step)
        self._closed = False
        exit_guard.guard(self, "_close_at_exit")  # a run that ends without close() keeps its records

    # ---- the parts' state, as attributes -------------------------------------------------
    step = _part("clock", "step", "The current optimizer step.")
    micro_steps = _part("clock", "micro_steps", "Micro-steps begun in the current optimizer step.")
    active = _part("clock", "active", "Whether the current step is monitored (hooks return at once when not).")
    backend = _part("pipeline", "backend", "The statistics backend (a framework's `backend` module).")
    reducer = _part("pipeline", "reducer", "Merges the rows over process groups before the transfer (None: one process).")
    read_late = _part("pipeline", "read_late", "Read statistics one step late (None: when they live on an accelerator).")
    screen = _part("pipeline", "screen", "What every step's table goes through before the rules see it (None: none).")
    replay_host = _part("replay", "host", "The framework side of a replay (None: no replays).", settable=False)
    replaying = _part("replay", "replaying", "True while a step is replayed: hooks leave the real step's state alone.",
                      settable=False)
    records_written = _part("pipeline.emitter", "records_written", "Records emitted so far.", settable=False)
    transfers = _part("rows", "transfers", "Device-to-host copies so far (one per monitored step).", settable=False)
    host_syncs = _part("rows", "host_syncs", "Blocking device-to-host reads so far (at most one per monitored step).",
                       settable=False)
    _warned = _part("errors", "warned", "The warnings given so far.", settable=False)

    # ---- wiring (`steps/wiring.py`) ------------------------------------------------
    def attach(self, model: Any, optimizer: Any = None) -> "Monitor":
        """Hook a model (and its optimizer) into this monitor, through the framework its
        classes come from (`registry.framework_of`: torch.nn.Module -> torch)."""
        self.wiring.attach(self, model, optimizer)
        return self

    @property
    def attachments(self) -> tuple[Removable, ...]:
        """What `attach` and the integration installed (`add_attachment`), in that order."""
        return tuple(self.wiring.attachments.handles)

    def record_environment(self, **sections: Any) -> None:
        """Add `sections` (e.g. ``hyperparameters={...}``, ``data={"batches": [...]}``,
        ``weights={...}``, see `frameworks.torch.fingerprint`) to this rank's environment.json;
        with none, write the start snapshot (`incident.environment.snapshot`). On the writer thread."""
        if not self.pipeline.emitter.sinks:
            return
        document = (lambda: sections) if sections else functools.partial(snapshot, self.config, self.rank, self.layout)
        self.writer.submit(lambda: write_snapshot(self.run_dir, document()), "environment")

    def forgo_replay(self, reason: str) -> None:
        """Replay no step (an integration whose steps cannot be replayed on one rank alone); warns once."""
        if self.replay.host is not None:
            self.replay.host = None
            self.warn(reason)

    # ---- lifecycle --------------------------------------------------------------
    def micro_step_begin(self) -> None:
        self.rows.settle()
        if self.replay.replaying:
            return
        if self.clock.optimizer_done:
            self.step_end()
        self.clock.micro_steps += 1

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
            self.add_tensors([MetricKey("train", name)], [self._measure.scalar(value)])

    def before_optimizer_step(self, screen: Callable[[StatTable], StatTable] | None = None) -> StepDecision:
        if self.replay.replaying:
            return StepDecision(replaying=True)
        if not (self.clock.active and (self.decide_early or self.replay.call is not None)):
            return StepDecision()
        decision, made = StepDecision(), []
        with exit_guard.critical():
            with self.guard("pre-step evaluation"):
                decision, made = self.pipeline.decide(screen)
            decision = self.pipeline.agree(decision)
            if decision.stop:
                self.pipeline.stop(decision, made)
        return decision

    def after_optimizer_step(self) -> None:
        if not self.replay.replaying:
            self.clock.optimizer_done = True

    def step_end(self, loss: Any = None) -> StepRecord | None:
        if self.replay.replaying:
            return None
        with exit_guard.critical():  # a signal raises after the step's record is queued, not inside
            for closer in self.wiring.closers:
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
            for closer in self.wiring.closers:
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
        """Emit the records held back, close the sinks, save the state, remove the hooks and wait
        until everything is written. A second call does nothing; the process's end calls it for a
        monitor not closed (`exit_guard`: a normal end, an exception, SIGTERM/SIGINT)."""
        self._close(drain=True)

    def _close_at_exit(self) -> None:
        """`close` at the process's end. With a reducer (other ranks) the records still held back
        are not emitted: that needs a collective, which a rank ending alone would wait for forever."""
        alone = self.pipeline.reducer is None
        if not self._closed and not alone and self.pipeline.holds_records():
            log.warning("msprobe: the process ended without Monitor.close(): the records held back for "
                        "a transfer with the other ranks are not written")
        self._close(drain=alone)

    def _close(self, drain: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if drain:
            self.drain()
        sinks = self.pipeline.emitter.sinks
        for sink in sinks:
            self.writer.submit(sink.close, f"{sink.name} sink close", wait=True)
        if sinks:
            state = self.state_dict()
            self.writer.submit(lambda: self.run.save_state(state), "monitor state", wait=True)
        with self.guard("close"):
            self.detach()
        self.writer.close()
        self.run.release()

    # ---- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return save_state(self.pipeline)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_state(self.pipeline, state)

    def drain(self) -> None:
        """Emit the records still held back (early-decision mode keeps a step's record until
        the next transfer); call it after `step_end`, e.g. when the run is about to stop."""
        if self.pipeline.holds_records():
            with exit_guard.critical(), self.guard("drain"):
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

    # ---- errors (`hook_errors.HookErrors`; documented in `contract.MonitorPort`) ----
    def warn_unmatched(self, key: str, names: list[str]) -> None:
        if names:
            self.warn(f"{key}: no module named {', '.join(names)}; nothing is watched for them")
