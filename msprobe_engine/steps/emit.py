"""One `StepRecord` per monitored step: to the history, the alert log, every sink (on the
writer thread) and the step-end listeners."""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Callable, Sequence

from msprobe_engine.health import HealthMeter
from msprobe_engine.records import AlertEvent, StepRecord
from msprobe_engine.sinks import BackgroundWriter, Sink
from msprobe_engine.stats.metrics import MetricNamer
from msprobe_engine.stats.table import StatTable

log = logging.getLogger("msprobe_engine")

#: alert events kept in memory for summaries (they are also in every sink)
ALERT_LOG_SIZE = 1000


class RecordEmitter:
    """Builds and hands on the records of one rank (`sinks`: empty on a rank that does not write)."""

    def __init__(self, rank: int, sinks: Sequence[Sink], writer: BackgroundWriter, metrics: MetricNamer,
                 health: HealthMeter, ring_buffer: int) -> None:
        self.rank = rank
        self.sinks = list(sinks)
        self.writer = writer
        self.metrics = metrics
        self.health = health
        self.history: deque[StepRecord] = deque(maxlen=ring_buffer)
        self.alert_log: deque[AlertEvent] = deque(maxlen=ALERT_LOG_SIZE)
        self.records_written = 0
        self.listeners: list[Callable[[StepRecord], None]] = []
        #: when the step's transfer began (Health/monitor_ms: from there to the record)
        self.host_since = time.perf_counter()

    def emit(self, step: int, micro_steps: int, table: StatTable, events: list[AlertEvent]) -> StepRecord:
        metrics = self.metrics(table)
        # the monitor's own cost: its time on the training thread for the step (monitor/overhead_ms:
        # measuring and the transfer) and since the transfer (rules, tags, this record)
        own_ms = metrics.get("monitor/overhead_ms", 0.0) + (time.perf_counter() - self.host_since) * 1e3
        metrics = self.health(table, events, metrics, own_ms)
        health = self.writer.health()  # writer/<sink>/failed, writer/dropped: only once something was lost
        record = StepRecord(step=step, rank=self.rank, micro_steps=micro_steps,
                            metrics={**metrics, **health} if health else metrics, alerts=events, wall_time=time.time())
        for event in events:
            log.warning("msprobe alert %s", describe(event))
        self.history.append(record)
        self.alert_log.extend(events)
        for sink in self.sinks:
            self.writer.submit(lambda sink=sink: sink.write(sink.selected(record)), f"{sink.name} sink write")
        self.records_written += 1
        for listener in self.listeners:
            listener(record)
        return record

    def flush(self) -> None:
        """Wait until everything submitted so far is written."""
        for sink in self.sinks:
            self.writer.submit(sink.flush, f"{sink.name} sink flush")
        self.writer.flush()


def describe(event: AlertEvent) -> str:
    """`non_finite start at step 60: <tag> = nan`; `... end at step 61 after 1 step: <tag> was nan`."""
    if event.phase == "start":
        return f"{event.rule} start at step {event.step}: {event.tag} = {_fmt(event.value)}"
    steps = f"{event.steps} step{'' if event.steps == 1 else 's'}"
    return f"{event.rule} end at step {event.step} after {steps}: {event.tag} was {_fmt(event.value)} at its last firing"


def _fmt(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.6g}"
