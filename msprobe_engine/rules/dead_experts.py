"""`dead_experts`: experts of a mixture-of-experts layer that received no token for `steps` steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msprobe_engine.fields import between
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.stats import router
from msprobe_engine.stats.table import StatTable


@register_rule("dead_experts")
class DeadExpertsRule(Rule):
    """Experts whose load (`router/<layer>/load/<e>`) was 0 on `steps` monitored steps in a row.
    All dead experts are one episode, named after the first (in execution order of the routers,
    then expert number); the others are listed with it. The episode lasts while an expert
    stays dead; an expert that receives a token again starts counting afresh."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        steps: int = field(default=100, metadata=between(1, 10**9))

    def __init__(self, config: "DeadExpertsRule.Config") -> None:
        super().__init__(config)
        self._idle: dict[str, int] = {}  # load tag -> monitored steps in a row without a token

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        dead = []
        for health in router.router_health(table):
            for expert, load in enumerate(health.loads):
                tag = router.load_tag(health.path, expert)
                idle = self._idle[tag] = self._idle.get(tag, 0) + 1 if load == 0 else 0
                if idle >= self.config.steps:
                    dead.append(tag)
        if not dead:
            return []
        return [Firing(self.name, self.name, dead[0], 0.0, float(self.config.steps), self.action,
                       also=tuple(dead[1:]), cooldown=self.config.cooldown,
                       parts=tuple((tag, 0.0, float(self.config.steps)) for tag in dead))]

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        """The load rows of the dead experts."""
        dead = {tag for tag, idle in self._idle.items() if idle >= self.config.steps}
        return np.array([(e := router.expert_of(k)) is not None and router.load_tag(k.path, e) in dead
                         for k in table.keys], dtype=bool)

    def state_dict(self) -> dict[str, Any]:
        return {"idle": dict(self._idle)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._idle = {str(k): int(v) for k, v in state.get("idle", {}).items()}
