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
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from msprobe_engine.config import ConfigSource, MonitorConfig, load_config
from msprobe_engine.records import AlertEvent, StepRecord
from msprobe_engine.rules import AlertTracker, Firing, build_rules
from msprobe_engine.sinks import BackgroundWriter, create_sinks
from msprobe_engine.stats.table import MetricKey, StatTable

log = logging.getLogger("msprobe_engine")

#: alert events kept in memory for summaries (they are also in every sink)
ALERT_LOG_SIZE = 1000

Reducer = Callable[[list[MetricKey], Any], Any]


class Monitor:
    """Per-step numerical-health monitor. See the module docstring for the lifecycle."""

    def __init__(self, config: ConfigSource = None, *, rank: int | None = None,
                 backend: Any = None, writes: bool | None = None) -> None:
        self.config: MonitorConfig = load_config(config)
        self.rank = _default_rank() if rank is None else rank
        self.backend = backend
        self.step = 0
        self.micro_steps = 0
        self.active = self.config.schedule.is_monitored(0)
        self.transfers = 0
        self.history: deque[StepRecord] = deque(maxlen=self.config.ring_buffer)
        self.alert_log: deque[AlertEvent] = deque(maxlen=ALERT_LOG_SIZE)
        self.records_written = 0
        self.hook_errors: dict[str, int] = {}
        self.reducer: Reducer | None = None
        self.step_end_listeners: list[Callable[[StepRecord], None]] = []
        self._rules = build_rules(self.config.alerts)
        self._tags: dict[MetricKey, list[str]] = {}
        self._tracker = AlertTracker()
        self._count_zeros = "zero_frac" in self.config.stats
        self.decide_early = any(r.action != "continue" for r in self.config.alerts)
        self._pending: list[tuple[int, list[MetricKey], Any]] = []
        self._early: dict[int, tuple[StatTable, list[AlertEvent]]] = {}
        self._optimizer_done = False
        self._attachments: list = []
        self._warned: set[str] = set()
        self.run_dir = Path(self.config.output_dir) / f"rank{self.rank}"
        if writes is None:  # an integration may choose, e.g. one writer per pipeline stage
            writes = self.rank == 0 or self.config.per_rank
        self._sinks = create_sinks(self.config.sinks, self.run_dir) if writes else []
        self.writer = BackgroundWriter(self.config.writer.queue_size, self.config.writer.when_full,
                                       strict=self.config.strict)

    # ---- wiring -----------------------------------------------------------------
    def attach(self, model: Any, optimizer: Any = None) -> "Monitor":
        """Hook a torch model (and torch.optim optimizer) into this monitor."""
        from msprobe_engine.backends import torch_backend
        from msprobe_engine.collect.torch_modules import ModuleHooks
        from msprobe_engine.collect.torch_optim import OptimizerHooks

        self.backend = self.backend or torch_backend
        self._attachments += [ModuleHooks(self, model), OptimizerHooks(self, model, optimizer)]
        return self

    def detach(self) -> None:
        for attachment in self._attachments:
            attachment.remove()
        self._attachments.clear()

    # ---- lifecycle --------------------------------------------------------------
    def micro_step_begin(self) -> None:
        """A new micro-batch starts; closes the previous step if `step_end` was not called."""
        if self._optimizer_done:
            self.step_end()
        self.micro_steps += 1

    def add_tensors(self, keys: Sequence[MetricKey], tensors: Sequence[Any]) -> None:
        """Measure `tensors` (named by `keys`) on their device; no host transfer."""
        if self.active and tensors:
            rows = self.backend.partial_stats(tensors, count_zeros=self._count_zeros)
            self._pending.append((self.step, list(keys), rows))

    def report_loss(self, loss: Any) -> None:
        """Tell the monitor this step's loss (a tensor or a number), before or after the step."""
        if not self.active or loss is None:
            return
        if not hasattr(loss, "shape"):
            loss = self.backend.scalar(float(loss))
        self.add_tensors([MetricKey("train", "loss")], [loss])

    def before_optimizer_step(self) -> list[Firing]:
        """At the accumulation boundary. Returns what fires now when a rule's action needs a
        decision before the weights change (otherwise nothing is evaluated yet)."""
        if not (self.active and self.decide_early):
            return []
        with self.guard("pre-step evaluation"):
            tables = self._transfer()
            table = tables.pop(self.step)
            firing = self._evaluate(table)
            events = self._tracker.update(self.step, firing, scope="pre:")
            self._emit_late(tables)
            self._early[self.step] = (table, events)
            return firing
        return []

    def after_optimizer_step(self) -> None:
        self._optimizer_done = True

    def step_end(self, loss: Any = None) -> StepRecord | None:
        """Close the optimizer step: one transfer, rules, one record to the writer."""
        self.report_loss(loss)
        record = None
        if self.active:
            with self.guard("step end"):
                record = self._finish_step()
        self.step += 1
        self.micro_steps = 0
        self._optimizer_done = False
        self.active = self.config.schedule.is_monitored(self.step)
        return record

    def close(self) -> None:
        """Emit what is still pending, flush every writer and close the sinks."""
        self.drain()
        for sink in self._sinks:
            self.writer.submit(sink.close, "sink close")
        self.detach()
        self.writer.close()

    def drain(self) -> None:
        """Emit the records still held back (early-decision mode keeps a step's record until
        the next transfer); call it after `step_end`, e.g. when the run is about to stop."""
        if self.decide_early and (self._pending or self._early):
            with self.guard("drain"):
                self._emit_late(self._transfer() if self._pending else {})

    def flush(self) -> None:
        """Wait until everything submitted so far is written."""
        for sink in self._sinks:
            self.writer.submit(sink.flush, "sink flush")
        self.writer.flush()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- errors -----------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a hook body: an error is logged once with `where` (strict mode re-raises)."""
        try:
            yield
        except Exception as exc:
            if self.config.strict:
                raise
            count = self.hook_errors.get(where, 0)
            self.hook_errors[where] = count + 1
            if count == 0:
                log.error("msprobe: error in %s (step %d): %s: %s; it is reported once and skipped",
                          where, self.step, type(exc).__name__, exc)

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("msprobe: %s", message)

    def warn_unmatched(self, key: str, names: list[str]) -> None:
        if names:
            self.warn(f"{key}: no module named {', '.join(names)}; nothing is watched for them")

    # ---- internals --------------------------------------------------------------
    def _transfer(self) -> dict[int, StatTable]:
        """The one device-to-host copy: every pending row, grouped by step."""
        pending, self._pending = self._pending, []
        if not pending:
            return {self.step: StatTable([], np.empty((0, 8)))}
        keys = [k for _, ks, _ in pending for k in ks]
        rows = self.backend.concat([r for _, _, r in pending])
        if self.reducer is not None:
            rows = self.reducer(keys, rows)
        host = self.backend.to_host(rows)
        self.transfers += 1
        steps = np.repeat([s for s, ks, _ in pending], [len(ks) for _, ks, _ in pending])
        tables = {}
        for step in dict.fromkeys(steps.tolist()):
            mask = steps == step
            tables[step] = StatTable.from_rows([k for k, m in zip(keys, mask) if m], host[mask])
        tables.setdefault(self.step, StatTable([], np.empty((0, 8))))
        return tables

    def _finish_step(self) -> StepRecord | None:
        if self.decide_early:
            return None  # emitted with the next transfer, joined with what follows the step
        table = self._transfer()[self.step]
        events = self._tracker.update(self.step, self._evaluate(table))
        return self._emit(self.step, table, events)

    def _emit_late(self, tables: dict[int, StatTable]) -> None:
        """Early-decision mode: join each earlier step's post-step rows with its pre-step table."""
        empty = StatTable([], np.empty((0, 8)))
        for step in sorted(set(self._early) | set(tables)):
            late = tables.get(step, empty)
            if step not in self._early and not late.keys:
                continue
            early_table, events = self._early.pop(step, (empty, []))
            events = events + self._tracker.update(step, self._evaluate(late), scope="post:")
            merged = StatTable.from_rows(early_table.keys + late.keys,
                                         np.concatenate([early_table.partials, late.partials]))
            self._emit(step, merged, events)

    def _evaluate(self, table: StatTable) -> list[Firing]:
        stats = table.finalized()
        metrics = self._metrics(table)
        return [f for rule in self._rules for f in rule.evaluate(table, stats, metrics)]

    def _metrics(self, table: StatTable) -> dict[str, float]:
        """Tag -> value for the sinks (computed once per table)."""
        if table.metrics is not None:
            return table.metrics
        stats = table.finalized()
        metrics: dict[str, float] = {}
        columns = [(stat, stats[stat].tolist()) for stat in self.config.stats]
        means = stats["mean"].tolist()
        for i, key in enumerate(table.keys):
            if key.kind == "train":
                metrics[f"train/{key.path}"] = means[i]
                continue
            tags = self._tags.get(key)
            if tags is None:
                tags = self._tags[key] = [key.tag(stat) for stat in self.config.stats]
            for tag, (_, values) in zip(tags, columns):
                metrics[tag] = values[i]
        if table.select("grad").any():
            metrics["grad/global/norm"] = table.global_norm("grad")
        self._add_ratios(table, stats, metrics)
        table.metrics = metrics
        return metrics

    def _add_ratios(self, table: StatTable, stats: dict[str, np.ndarray], metrics: dict[str, float]) -> None:
        if "ratio" not in self.config.watch.optimizer_state:
            return
        param_norm = {k.path: stats["norm"][i] for i, k in enumerate(table.keys) if k.kind == "param"}
        for i, key in enumerate(table.keys):
            if key.kind == "optim" and key.role == "update" and key.path in param_norm:
                with np.errstate(divide="ignore", invalid="ignore"):
                    metrics[f"optim/{key.path}/ratio"] = float(stats["norm"][i] / param_norm[key.path])

    def _emit(self, step: int, table: StatTable, events: list[AlertEvent]) -> StepRecord:
        record = StepRecord(step=step, rank=self.rank, micro_steps=self.micro_steps,
                            metrics=self._metrics(table), alerts=events, wall_time=time.time())
        for event in events:
            log.warning("msprobe alert %s %s at step %d: %s = %s%s", event.rule, event.phase, event.step,
                        event.tag, _fmt(event.value),
                        f" (lasted {event.steps} steps)" if event.phase == "end" else "")
        self.history.append(record)
        self.alert_log.extend(events)
        for sink in self._sinks:
            self.writer.submit(lambda sink=sink: sink.write(record), f"{type(sink).__name__} write")
        self.records_written += 1
        for listener in self.step_end_listeners:
            listener(record)
        return record


def _fmt(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.6g}"


def _default_rank() -> int:
    import os
    return int(os.environ.get("RANK", "0"))
