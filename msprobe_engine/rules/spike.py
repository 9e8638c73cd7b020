"""`spike`: a metric above `factor` times its exponential running average."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msprobe_engine.fields import between
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.rules.tags import TagMatcher, one_episode
from msprobe_engine.stats.table import StatTable


@register_rule("spike")
class SpikeRule(Rule):
    """A metric matching `metrics` (TensorBoard tags or glob patterns) above `factor` x its
    running average, and above exp(`deviations` x d) x that average, where d is the series'
    own running mean absolute deviation of log|value| from log|average| (its noise, measured
    as ratios: a series that is noisy by nature, like a small bias's gradient near convergence
    or an attention projection's gradient in a MoE layer, whose values swing 10x from batch to
    batch, needs a larger jump than a steady one), once warmed up; a spike pulls neither up.
    Everything that spikes on one step is one episode, named after the innermost module of
    the first hit.

    Warm-up understands series that start at zero (optimizer moments, a gradient that is
    zero at first): a series starts at its first nonzero value, and it is warmed up after
    `warmup` observations in a row within sqrt(`factor`) of its average (a series still
    rising from zero restarts the count)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        metrics: list[str] = field(default_factory=lambda: ["train/loss", "grad/*/norm", "actv/*/output*/norm"])
        factor: float = field(default=5.0, metadata=between(1.0, 1e12))
        warmup: int = field(default=10, metadata=between(0, 1_000_000))
        smoothing: float = field(default=0.9, metadata=between(0.0, 0.999))
        deviations: float = field(default=8.0, metadata=between(0.0, 1e12))

    def __init__(self, config: "SpikeRule.Config") -> None:
        super().__init__(config)
        self._average: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._deviation: dict[str, float] = {}
        self.watched = TagMatcher(config.metrics)

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        hits = []
        spec = self.config
        settle = math.sqrt(spec.factor)
        for tag, value in self.watched.candidates(metrics):
            average = self._average.get(tag)
            if math.isnan(value) or (not average and math.isinf(value)):
                continue
            seen = self._seen.get(tag, 0)
            deviation = self._deviation.get(tag, 0.0)
            threshold = abs(average) * max(spec.factor, math.exp(min(spec.deviations * deviation, 700.0))) \
                if average else 0
            if average and seen >= spec.warmup and abs(value) > threshold:
                hits.append((tag, value, threshold))
                continue  # a spike (or an overflow to inf) does not pull the average up
            if not average:  # the series starts here (or is still zero: no scale yet)
                self._average[tag], self._seen[tag], self._deviation[tag] = value, int(value != 0), 0.0
                continue
            settled = seen >= spec.warmup or abs(value) <= settle * abs(average)
            keep = spec.smoothing
            self._average[tag] = keep * average + (1 - keep) * value
            if value and math.isfinite(value):  # a zero has no ratio to the average: no noise sample
                self._deviation[tag] = keep * deviation + (1 - keep) * abs(math.log(abs(value) / abs(average)))
            self._seen[tag] = seen + 1 if settled else 0
        return one_episode(self, hits)

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        return deviation > self.config.factor

    def state_dict(self) -> dict[str, Any]:
        return {"average": dict(self._average), "seen": dict(self._seen), "log_deviation": dict(self._deviation)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._average = {str(k): float(v) for k, v in state.get("average", {}).items()}
        self._seen = {str(k): int(v) for k, v in state.get("seen", {}).items()}
        # "log_deviation": a state saved before it (a linear deviation) starts the noise afresh
        self._deviation = {str(k): float(v) for k, v in state.get("log_deviation", {}).items()}
