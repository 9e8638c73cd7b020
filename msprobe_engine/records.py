"""The data that flows from the training thread to the writer: one record per step."""
from __future__ import annotations

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

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}


@dataclass(slots=True)
class StepRecord:
    """Everything measured on one monitored optimizer step of one rank."""
    step: int
    rank: int
    micro_steps: int
    metrics: dict[str, float]
    alerts: list[AlertEvent] = field(default_factory=list)
    wall_time: float = 0.0
