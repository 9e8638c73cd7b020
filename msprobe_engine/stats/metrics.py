"""From a step's statistics table to the tagged scalars the sinks write."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msprobe_engine.stats import router
from msprobe_engine.stats.columns import P_SUMSQ
from msprobe_engine.stats.table import MetricKey, StatTable

#: kinds whose rows are one number each (the loss, the monitor's own cost): `<kind>/<path>` = mean
SCALAR_KINDS = ("train", "monitor")


@dataclass(frozen=True, slots=True)
class _Layout:
    """What a table's keys make, computed once per distinct key list: the tags in order, and
    for each the (row, column) of its value in the matrix of the configured statistics (the
    last column: the mean, for scalar kinds); the gradient rows; the update/param row pairs
    of the ratios; the MoE routers' rows."""
    tags: list[str]
    rows: np.ndarray
    columns: np.ndarray
    grads: np.ndarray
    ratios: list[tuple[str, int, int]]
    routers: list[router.RouterRows]


class MetricNamer:
    """Builds `tag -> value` for a table: the configured statistics of every visible row,
    `train/<name>` for training scalars, `grad/global/norm`, `optim/<param>/ratio` when
    asked, and the MoE routers' health (`stats.router`). The tags and where each value comes
    from are computed once per key list (a training run repeats the same few); a step
    then costs one gather and one dict build."""

    def __init__(self, stats: list[str], ratios: bool, hidden_kinds: frozenset[str] = frozenset()) -> None:
        self.stats = stats
        self.ratios = ratios
        self.hidden_kinds = hidden_kinds
        self._layouts: dict[tuple[MetricKey, ...], _Layout] = {}

    def __call__(self, table: StatTable) -> dict[str, float]:
        if table.metrics is not None:
            return table.metrics
        layout = self._layout(table.keys)
        stats = table.finalized()
        metrics: dict[str, float] = {}
        if layout.tags:
            matrix = np.stack([stats[stat] for stat in self.stats] + [stats["mean"]], axis=1)
            metrics = dict(zip(layout.tags, matrix[layout.rows, layout.columns].tolist()))
        if layout.grads.size:
            metrics["grad/global/norm"] = float(np.sqrt(table.partials[layout.grads, P_SUMSQ].sum()))
        if layout.ratios:
            norm = stats["norm"]
            with np.errstate(divide="ignore", invalid="ignore"):
                for tag, update, param in layout.ratios:
                    metrics[tag] = float(norm[update] / norm[param])
        if layout.routers:
            metrics.update(router.router_metrics(router.router_health(table, layout.routers)))
        table.metrics = metrics
        return metrics

    def _layout(self, keys: list[MetricKey]) -> _Layout:
        signature = tuple(keys)
        layout = self._layouts.get(signature)
        if layout is None:
            if len(self._layouts) > 64:  # a run whose layout keeps changing: keep the memory bounded
                self._layouts.clear()
            layout = self._layouts[signature] = self._build(keys)
        return layout

    def _build(self, keys: list[MetricKey]) -> _Layout:
        tags: list[str] = []
        rows: list[int] = []
        columns: list[int] = []
        mean = len(self.stats)
        for i, key in enumerate(keys):
            if key.kind in SCALAR_KINDS:
                tags.append(f"{key.kind}/{key.path}")
                rows.append(i)
                columns.append(mean)
            elif key.kind not in self.hidden_kinds and key.kind != router.KIND:
                tags += [key.tag(stat) for stat in self.stats]
                rows += [i] * len(self.stats)
                columns += range(len(self.stats))
        grads = np.array([i for i, key in enumerate(keys) if key.kind == "grad"], dtype=np.int64)
        ratios = []
        if self.ratios:  # `optim/<param>/ratio`: norm of the step's update over the norm of the parameter
            param = {key.path: i for i, key in enumerate(keys) if key.kind == "param"}
            ratios = [(f"optim/{key.path}/ratio", i, param[key.path]) for i, key in enumerate(keys)
                      if key.kind == "optim" and key.role == "update" and key.path in param]
        return _Layout(tags, np.array(rows, dtype=np.int64), np.array(columns, dtype=np.int64), grads, ratios,
                       router.router_rows(keys))
