"""`router_heatmap`: per MoE router, an image of its experts' load over the last steps, in TensorBoard.

From the records' `router/<path>/load/<e>` tags (`stats.router`): one image per router,
experts top to bottom (0 first) and monitored steps left to right, coloured by the load over
the mean load of that step (1: an even share; log scale as `heatmap`'s, an expert that got no
token at the bottom), tagged `Heatmap/router_load/<path>/steps_<first>-<last>`. Written every
`every` monitored steps and when the run closes, into its own event file in the run's
directory, next to the `tensorboard` sink's (TensorBoard shows both in one run):

    sinks: [tensorboard, {name: router_heatmap, every: 50, steps: 100}]
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from msprobe_engine.fields import at_least
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.heatmap import NormHistory
from msprobe_engine.sinks.tb_heatmap import heatmap_value
from msprobe_engine.sinks.tb_records import EventFile
from msprobe_engine.stats import router

PREFIX, LOAD = f"{router.KIND}/", f"/{router.LOAD}/"


@register_sink("router_heatmap")
class RouterHeatmapSink(Sink):
    """Expert-load heatmaps of every router (see the module docstring)."""

    requires = ("tensorboard",)

    @dataclass(kw_only=True, slots=True)
    class Config(Sink.Config):
        """`every`: monitored steps between images; `steps`: the steps an image shows."""
        every: int = field(default=50, metadata=at_least(1))
        steps: int = field(default=100, metadata=at_least(2))

    def __init__(self, config: "RouterHeatmapSink.Config", run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._history: dict[str, NormHistory] = {}  # router path -> its experts' relative loads
        self._experts: dict[str, tuple[str, str] | None] = {}  # tag -> (router path, expert) or None
        self._monitored = self._shown_at = self._last_step = 0

    def open(self) -> None:
        self._writer = EventFile(self.run_dir, ".router_heatmap")

    def write(self, record: StepRecord) -> None:
        loads: dict[str, dict[str, float]] = {}
        for tag, value in record.metrics.items():
            found = self._experts.get(tag, False)
            if found is False:
                found = self._experts[tag] = _router_expert(tag)
            if found is not None:
                loads.setdefault(found[0], {})[found[1]] = value
        for path, by_expert in loads.items():
            mean = sum(by_expert.values()) / len(by_expert)
            relative = {e: (v / mean if mean > 0 else 0.0) for e, v in by_expert.items()}
            self._history.setdefault(path, NormHistory(self.config.steps)).add(record.step, relative)
        self._monitored += 1
        self._last_step = record.step
        if self._monitored % self.config.every == 0:
            self._show(record.step, record.wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._shown_at < self._monitored:
            self._show(self._last_step, None)
        self._writer.close()

    def _show(self, step: int, wall_time: float | None) -> None:
        values = []
        for path, history in self._history.items():
            first, last = history.steps()
            values.append(heatmap_value(heatmap_tag(path, first, last),
                                        f"{path}: load / mean load, experts x steps {first}..{last}",
                                        history, history.matrix()))
        self._shown_at = self._monitored
        if values:
            self._writer.add_event(Event(step=step, wall_time=time.time() if wall_time is None else wall_time,
                                         summary=Summary(value=values)))


def heatmap_tag(path: str, first: int, last: int) -> str:
    return f"Heatmap/router_load/{path}/steps_{first}-{last}"


def _router_expert(tag: str) -> tuple[str, str] | None:
    """``router/<path>/load/<e>`` -> (path, "expert <e>"); other tags None."""
    if not tag.startswith(PREFIX) or LOAD not in tag:
        return None
    path, _, expert = tag[len(PREFIX):].rpartition(LOAD)
    return (path, f"expert {expert}") if expert.isdigit() else None
