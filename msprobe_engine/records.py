"""The data that flows from the training thread to the writer: one record per step."""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class AlertEvent:
    """An alert episode starting or ending (reported once each, never every step)."""
    rule: str
    tag: str
    phase: str  # "start" | "end"
    step: int
    value: float
    threshold: float | None = None
    steps: int | None = None  # length of the episode, on "end"
    also: tuple[str, ...] = ()  # other tags that fired with it in the same episode

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k in self.__slots__
                if (v := getattr(self, k)) is not None and v != ()}


@dataclass(slots=True)
class StepRecord:
    """Everything measured on one monitored optimizer step of one rank."""
    step: int
    rank: int
    micro_steps: int
    metrics: dict[str, float]
    alerts: list[AlertEvent] = field(default_factory=list)
    wall_time: float = 0.0

    def as_json(self) -> str:
        """One line of metrics.jsonl: `step, rank, micro_steps, time, metrics, alerts` (nan/inf as
        JSON's NaN/Infinity literals), without the newline."""
        return json.dumps({"step": self.step, "rank": self.rank, "micro_steps": self.micro_steps,
                           "time": self.wall_time, "metrics": self.metrics,
                           "alerts": [a.as_dict() for a in self.alerts]})
