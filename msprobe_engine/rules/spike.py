"""`spike`: a metric above `factor` times its exponential running average."""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msprobe_engine.config.fields import at_least, between
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.stats.table import StatTable


@register_rule("spike")
class SpikeRule(Rule):
    """A metric matching `metrics` (TensorBoard tags or glob patterns) above `factor` x its
    running average, after `warmup` observations; a spike does not pull the average up."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        metrics: list[str] = field(default_factory=lambda: ["train/loss", "grad/global/norm"])
        factor: float = field(default=3.0, metadata=between(1.0, 1e12))
        warmup: int = field(default=10, metadata=at_least(0))
        smoothing: float = field(default=0.9, metadata=between(0.0, 0.999))

    def __init__(self, config: "SpikeRule.Config") -> None:
        super().__init__(config)
        self._average: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._matches: dict[str, bool] = {}
        globbing = any(ch in p for p in config.metrics for ch in "*?[")
        self._exact: list[str] | None = None if globbing else list(config.metrics)

    def _watched(self, tag: str) -> bool:
        hit = self._matches.get(tag)
        if hit is None:
            hit = self._matches[tag] = any(fnmatch.fnmatchcase(tag, p) for p in self.config.metrics)
        return hit

    def _candidates(self, metrics: dict[str, float]):
        if self._exact is not None:  # plain tag names: direct look-ups, no scan
            return ((tag, metrics[tag]) for tag in self._exact if tag in metrics)
        return ((tag, value) for tag, value in metrics.items() if self._watched(tag))

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        out = []
        spec = self.config
        for tag, value in self._candidates(metrics):
            if math.isnan(value):
                continue
            average = self._average.get(tag)
            seen = self._seen.get(tag, 0)
            if average is not None and seen >= spec.warmup and abs(value) > spec.factor * abs(average) > 0:
                out.append(Firing(self.name, f"{self.name}:{tag}", tag, value, spec.factor * abs(average),
                                  self.action))
                continue  # a spike (or an overflow to inf) does not pull the average up
            self._average[tag] = value if average is None else spec.smoothing * average + (1 - spec.smoothing) * value
            self._seen[tag] = seen + 1
        return out

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        return deviation > self.config.factor

    def state_dict(self) -> dict[str, Any]:
        return {"average": dict(self._average), "seen": dict(self._seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._average = {str(k): float(v) for k, v in state.get("average", {}).items()}
        self._seen = {str(k): int(v) for k, v in state.get("seen", {}).items()}
