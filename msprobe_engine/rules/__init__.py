"""Anomaly rules evaluated on a step's host-side statistics (no extra transfer).

A rule returns what is firing now; `AlertTracker` turns that into episodes,
so an alert is reported when it starts and when it ends, never every step.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from msprobe_engine.config.schema import Rule
from msprobe_engine.records import AlertEvent
from msprobe_engine.stats.table import StatTable

#: rule target name -> MetricKey.kind
TARGET_KINDS = {"loss": "train", "actv": "actv", "actv_grad": "actv_grad", "grad": "grad",
                "param": "param", "optim": "optim"}


@dataclass(slots=True)
class Firing:
    """A rule condition that holds on this step."""
    rule: str
    episode: str  # what identifies the episode (one alert per episode)
    tag: str      # the first metric that fired, in execution order
    value: float
    threshold: float | None
    action: str


class AlertRule(Protocol):
    def evaluate(self, table: StatTable, stats: dict[str, np.ndarray],
                 metrics: dict[str, float]) -> list[Firing]: ...


class NonFiniteRule:
    """nan or inf anywhere in the watched kinds; one episode for the whole rule."""

    def __init__(self, spec: Rule) -> None:
        self.spec = spec
        self.kinds = {TARGET_KINDS[t] for t in spec.targets}

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        if not table.keys:
            return []
        bad = (stats["nan_count"] + stats["inf_count"]) > 0
        watched = np.array([k.kind in self.kinds for k in table.keys], dtype=bool)
        hits = np.flatnonzero(bad & watched)
        if hits.size == 0:
            return []
        first = int(hits[0])
        stat = "nan_count" if stats["nan_count"][first] > 0 else "inf_count"
        return [Firing("non_finite", "non_finite", table.keys[first].tag(stat),
                       float(stats[stat][first]), 0.0, self.spec.action)]


class SpikeRule:
    """A metric above `factor` x its exponential running average (after warm-up)."""

    def __init__(self, spec: Rule) -> None:
        self.spec = spec
        self._average: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._matches: dict[str, bool] = {}
        globbing = any(ch in p for p in spec.metrics for ch in "*?[")
        self._exact: list[str] | None = None if globbing else list(spec.metrics)

    def _watched(self, tag: str) -> bool:
        hit = self._matches.get(tag)
        if hit is None:
            hit = self._matches[tag] = any(fnmatch.fnmatchcase(tag, p) for p in self.spec.metrics)
        return hit

    def _candidates(self, metrics: dict[str, float]):
        if self._exact is not None:  # plain tag names: direct look-ups, no scan
            return ((tag, metrics[tag]) for tag in self._exact if tag in metrics)
        return ((tag, value) for tag, value in metrics.items() if self._watched(tag))

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        out = []
        spec = self.spec
        for tag, value in self._candidates(metrics):
            if math.isnan(value):
                continue
            average = self._average.get(tag)
            seen = self._seen.get(tag, 0)
            if average is not None and seen >= spec.warmup and abs(value) > spec.factor * abs(average) > 0:
                out.append(Firing("spike", f"spike:{tag}", tag, value, spec.factor * abs(average), spec.action))
                continue  # a spike (or an overflow to inf) does not pull the average up
            self._average[tag] = value if average is None else spec.smoothing * average + (1 - spec.smoothing) * value
            self._seen[tag] = seen + 1
        return out


RULES = {"non_finite": NonFiniteRule, "spike": SpikeRule}


def build_rules(specs: list[Rule]) -> list[AlertRule]:
    return [RULES[spec.rule](spec) for spec in specs]


class AlertTracker:
    """Turns per-step firings into start/end events, one pair per episode.

    `scope` separates evaluations of different parts of a step (e.g. what is
    known before the optimizer step and what only after it): an episode ends
    only when the scope that started it evaluates clean.
    """

    def __init__(self) -> None:
        self.active: dict[str, tuple[int, Firing]] = {}

    def update(self, step: int, firing: list[Firing], scope: str = "") -> list[AlertEvent]:
        events: list[AlertEvent] = []
        for f in firing:
            f.episode = f"{scope}{f.episode}"
        now = {f.episode: f for f in firing}
        for episode, (start, first) in list(self.active.items()):
            if episode.startswith(scope) and episode not in now:
                del self.active[episode]
                events.append(AlertEvent(first.rule, first.tag, "end", step, first.value,
                                         first.threshold, steps=step - start))
        for episode, f in now.items():
            if episode not in self.active:
                self.active[episode] = (step, f)
                events.append(AlertEvent(f.rule, f.tag, "start", step, f.value, f.threshold))
        return events
