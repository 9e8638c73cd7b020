"""From a step's statistics table to the tagged scalars the sinks write."""
from __future__ import annotations

import numpy as np

from msprobe_engine.stats.table import MetricKey, StatTable


class MetricNamer:
    """Builds `tag -> value` for a table: the configured statistics of every visible row,
    `train/<name>` for training scalars, `grad/global/norm`, and `optim/<param>/ratio` when
    asked. Tags are computed once per key; a table's metrics once per table."""

    def __init__(self, stats: list[str], ratios: bool, hidden_kinds: frozenset[str] = frozenset()) -> None:
        self.stats = stats
        self.ratios = ratios
        self.hidden_kinds = hidden_kinds
        self._tags: dict[MetricKey, list[str]] = {}

    def __call__(self, table: StatTable) -> dict[str, float]:
        if table.metrics is not None:
            return table.metrics
        stats = table.finalized()
        metrics: dict[str, float] = {}
        columns = [stats[stat].tolist() for stat in self.stats]
        means = stats["mean"].tolist()
        for i, key in enumerate(table.keys):
            if key.kind in ("train", "monitor"):  # one number each: the loss, the monitor's own cost
                metrics[f"{key.kind}/{key.path}"] = means[i]
                continue
            if key.kind in self.hidden_kinds:
                continue
            tags = self._tags.get(key)
            if tags is None:
                tags = self._tags[key] = [key.tag(stat) for stat in self.stats]
            for tag, values in zip(tags, columns):
                metrics[tag] = values[i]
        if table.select("grad").any():
            metrics["grad/global/norm"] = table.global_norm("grad")
        if self.ratios:
            _add_ratios(table, stats, metrics)
        table.metrics = metrics
        return metrics


def _add_ratios(table: StatTable, stats: dict[str, np.ndarray], metrics: dict[str, float]) -> None:
    """`optim/<param>/ratio`: norm of the step's update over the norm of the parameter."""
    param_norm = {k.path: stats["norm"][i] for i, k in enumerate(table.keys) if k.kind == "param"}
    for i, key in enumerate(table.keys):
        if key.kind == "optim" and key.role == "update" and key.path in param_norm:
            with np.errstate(divide="ignore", invalid="ignore"):
                metrics[f"optim/{key.path}/ratio"] = float(stats["norm"][i] / param_norm[key.path])
