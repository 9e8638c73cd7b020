"""Where the run is: the optimizer step, its micro-steps, and whether it is monitored."""
from __future__ import annotations

from dataclasses import dataclass

from msprobe_engine.config.schema import Schedule


@dataclass
class StepClock:
    """The current optimizer step (`step`), the micro-steps begun in it, whether the schedule
    monitors it (`active`) and whether its optimizer step has run (`optimizer_done`)."""

    schedule: Schedule
    step: int = 0
    micro_steps: int = 0
    active: bool = False
    optimizer_done: bool = False

    def __post_init__(self) -> None:
        self.active = self.schedule.is_monitored(self.step)

    def go_to(self, step: int) -> None:
        """Step `step` begins (no micro-step yet, its optimizer step not run)."""
        self.step = step
        self.micro_steps = 0
        self.optimizer_done = False
        self.active = self.schedule.is_monitored(step)

    def reschedule(self, schedule: Schedule) -> None:
        """Monitor by `schedule` from now on (the live control file), this step included."""
        self.schedule = schedule
        self.active = schedule.is_monitored(self.step)
