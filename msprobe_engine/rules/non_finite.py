"""`non_finite`: nan or inf anywhere in the watched kinds of tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from msprobe_engine.fields import choices
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.stats.table import StatTable

#: rule target name -> MetricKey.kind
TARGET_KINDS = {"loss": "train", "actv": "actv", "actv_grad": "actv_grad", "grad": "grad",
                "param": "param", "optim": "optim"}


@register_rule("non_finite")
class NonFiniteRule(Rule):
    """nan or inf in `targets`; one episode for the whole rule, named after the first tensor
    (in execution order) that went non-finite."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        targets: list[str] = field(default_factory=lambda: list(TARGET_KINDS), metadata=choices(*TARGET_KINDS))

    def __init__(self, config: "NonFiniteRule.Config") -> None:
        super().__init__(config)
        self.kinds = {TARGET_KINDS[t] for t in config.targets}

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
        return [Firing(self.name, self.name, table.keys[first].tag(stat),
                       float(stats[stat][first]), 0.0, self.action, cooldown=self.config.cooldown)]

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        return table.non_finite()
