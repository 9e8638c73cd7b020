"""TensorBoard event files: the tensorboard package's protos, framed by `tb_records` (no torch needed).

Per monitored step: every `Health/*` and `train/*` scalar, the global gradient norm, and
the per-layer tags of the kinds in `layer_kinds` with the statistics in `layer_stats`
(they compare across layers in the custom-scalars layout, written with the first step and
again when new tags appear). Every `heatmap_every` steps and at each incident: heatmaps of the activation and
gradient norms (`Heatmap/<kind>_norm/steps_<first>-<last>`, layers x steps); at the incident's step: the incident
as markdown (`Health/incident`); on request, histograms of the per-layer norms.
Everything runs on the writer thread (docs/tensorboard.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.text import metadata as text_metadata

from msprobe_engine.fields import at_least
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.heatmap import NormHistory, log_bins
from msprobe_engine.sinks.layer_filter import LayerChoice, LayerFilter
from msprobe_engine.sinks.tb_incident import incident_directory, incident_markdown, read_incident
from msprobe_engine.sinks.tb_heatmap import heatmap_value
from msprobe_engine.sinks.tb_layout import DT_STRING, build_layout, layout_value, parse_tag
from msprobe_engine.sinks.tb_records import EventFile, ScalarBlock

#: heatmaps and histograms: the kind of the norms they show -> the role of those rows
PICTURED = {"actv": "output", "grad": ""}
INCIDENT_TAG = "Health/incident"
#: writes after which an incident whose incident.json never appeared is given up
INCIDENT_PATIENCE = 50


@register_sink("tensorboard")
class TensorBoardSink(Sink):
    """Scalars, a custom-scalars layout, heatmaps, incidents and optional histograms."""

    @dataclass(kw_only=True, slots=True)
    class Config(LayerChoice):
        """`layer_kinds`, `layer_stats`: the per-layer rows and statistics written as scalars
        (every statistic of every row stays in metrics.jsonl; `layer_filter.py`); `layout`: the custom-scalars layout;
        `heatmap_every`: steps between heatmaps (0: only at incidents), `heatmap_steps`:
        how many of the last monitored steps they show; `histograms`: per-layer norm
        histograms each step; `incidents`: the incident text at its step."""
        layout: bool = True
        heatmap_every: int = field(default=50, metadata=at_least(0))
        heatmap_steps: int = field(default=100, metadata=at_least(2))
        histograms: bool = False
        incidents: bool = True

    _writer: EventFile

    def __init__(self, config: "TensorBoardSink.Config", run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._keeps = LayerFilter(config)  # tag -> written as a scalar
        self._seen: set[str] = set()  # every tag of the records so far (the layout is of those kept)
        self._pictured: dict[str, tuple[str, str]] = {}  # tag -> (kind, row) in the heatmaps
        self._history = {kind: NormHistory(config.heatmap_steps) for kind in PICTURED}
        self._waiting: list[tuple[int, int, str, int]] = []  # (step, rank, rule, writes waited)
        self._monitored = 0
        self._pictures_at = 0  # self._monitored when the last heatmaps were written
        self._last_step = 0
        self._scalars_of: list[str] | None = None  # the tags of the last record (its layout)
        self._kept_at = np.zeros(0, dtype=np.int64)  # their positions kept as scalars
        self._block = ScalarBlock([])

    def open(self) -> None:
        self._writer = EventFile(self.run_dir)

    def write(self, record: StepRecord) -> None:
        metrics = record.metrics
        values: list[Summary.Value] = []
        tags = list(metrics)
        if tags != self._scalars_of:  # a new layout of tags: which are kept, and their template
            self._scalars_of = tags
            self._kept_at = np.array([i for i, tag in enumerate(tags) if self._keeps(tag)], dtype=np.int64)
            self._block = ScalarBlock([tags[i] for i in self._kept_at])
        scalars = self._block.encode(np.fromiter(metrics.values(), dtype=np.float64, count=len(tags))[self._kept_at])
        if not metrics.keys() <= self._seen:  # new tags: where they go
            self._seen.update(metrics)
            self._pictured.update((tag, row) for tag in metrics if tag not in self._pictured
                                  and (row := _picture_row(tag)) is not None)
            if self.config.layout:
                kept = [tag for tag in self._seen if self._keeps(tag)]
                values.append(layout_value(build_layout(kept, [tag for tag in kept if tag.startswith("Health/")])))
        norms = self._norms(metrics)
        for kind, by_tag in norms.items():
            self._history[kind].add(record.step, by_tag)
        self._monitored += 1
        self._last_step = record.step
        starts = [event for event in record.alerts if event.phase == "start"]
        every = self.config.heatmap_every
        if starts or (every and self._monitored % every == 0):
            values += self._heatmaps()
            self._pictures_at = self._monitored
        if self.config.histograms:
            values += self._histograms(norms)
        self._add(record.step, record.wall_time, values, scalars)
        if self.config.incidents and self.incidents_dir is not None:
            self._waiting += [(record.step, record.rank, rule, 0) for rule in dict.fromkeys(e.rule for e in starts)]
            self._write_incidents(record.wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._waiting:
            self._write_incidents(None)
        if self.config.heatmap_every and self._pictures_at < self._monitored:  # the run's last steps
            self._add(self._last_step, None, self._heatmaps())
        self._writer.close()

    # ---- pictures -------------------------------------------------------------------------
    def _norms(self, metrics: dict[str, float]) -> dict[str, dict[str, float]]:
        """The norms of the rows shown in heatmaps: {kind: {row name: norm}}."""
        found: dict[str, dict[str, float]] = {kind: {} for kind in PICTURED}
        for tag, (kind, row) in self._pictured.items():
            value = metrics.get(tag)
            if value is not None:
                found[kind][row] = value
        return found

    def _heatmaps(self) -> list[Summary.Value]:
        values = []
        for kind, history in self._history.items():
            if not history.rows:
                continue
            first, last = history.steps()
            values.append(heatmap_value(heatmap_tag(kind, first, last),
                                        f"{kind} norms, layers x steps {first}..{last}", history, history.matrix()))
        return values

    def _histograms(self, norms: dict[str, dict[str, float]]) -> list[Summary.Value]:
        values = []
        for kind, by_path in norms.items():
            binned = log_bins(np.fromiter(by_path.values(), dtype=np.float64, count=len(by_path)))
            if binned is None:
                continue
            counts, limits, logs = binned
            histogram = HistogramProto(min=float(logs.min()), max=float(logs.max()), num=float(logs.size),
                                       sum=float(logs.sum()), sum_squares=float((logs ** 2).sum()),
                                       bucket_limit=limits.tolist(), bucket=counts.astype(float).tolist())
            values.append(Summary.Value(tag=f"hist/{kind}_log10_norm", histo=histogram))
        return values

    # ---- incidents ------------------------------------------------------------------------
    def _write_incidents(self, wall_time: float | None) -> None:
        """Write the incidents whose incident.json is there; keep waiting for the others."""
        waiting = []
        for step, rank, rule, waited in self._waiting:
            directory = incident_directory(self.incidents_dir, step, rank, rule)
            report = read_incident(directory)
            if report is not None:
                self._add(step, wall_time, [_text(INCIDENT_TAG, incident_markdown(report, directory))])
            elif waited < INCIDENT_PATIENCE and wall_time is not None:
                waiting.append((step, rank, rule, waited + 1))
        self._waiting = waiting

    def _add(self, step: int, wall_time: float | None, values: list[Summary.Value], scalars: bytes = b"") -> None:
        """One event of `scalars` (a `ScalarBlock`'s bytes) and `values`."""
        if values or scalars:
            summary = scalars + Summary(value=values).SerializeToString()
            self._writer.add_event(Event(step=step, wall_time=time.time() if wall_time is None else wall_time),
                                   summary)


def heatmap_tag(kind: str, first: int, last: int) -> str:
    """A heatmap's tag: one per kind and window of steps, so that each image keeps its own legend
    (TensorBoard shows a tag's first description for all its images), in a group of their own
    after `Health` (whose cards, loss first, fill the first screen). Before, one tag per kind:
    ``Health/heatmap/<kind>_norm``."""
    return f"Heatmap/{kind}_norm/steps_{first}-{last}"


def _picture_row(tag: str) -> tuple[str, str] | None:
    """(kind, row name) of a norm shown in a heatmap: ``actv/<module>/output/norm`` ->
    ("actv", "<module>"), ``actv/<module>/output.1/norm`` -> ("actv", "<module>/output.1")."""
    parts = parse_tag(tag)
    if parts is None or parts.stat != "norm" or parts.kind not in PICTURED:
        return None
    role = PICTURED[parts.kind]
    if parts.role.split(".")[0] != role:
        return None
    return parts.kind, parts.path if parts.role == role else f"{parts.path}/{parts.role}"


def _text(tag: str, markdown: str) -> Summary.Value:
    tensor = TensorProto(dtype=DT_STRING, string_val=[markdown.encode()], tensor_shape=TensorShapeProto())
    return Summary.Value(tag=tag, metadata=text_metadata.create_summary_metadata(tag, ""), tensor=tensor)
