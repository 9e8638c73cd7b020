"""What a firing rule makes the training do: continue, skip the optimizer step, or stop.

`Monitor.before_optimizer_step()` returns a `StepDecision`; an integration skips the
framework's optimizer step when `decision.skip` is true (plain PyTorch: `OptimizerHooks`
makes `optimizer.step()` a no-op). On `stop`, the monitor itself flushes every writer and
raises `TrainingStopped` out of `before_optimizer_step()`, before any weight changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

from msprobe_engine.rules import Firing

#: the rule named in a decision another rank made (`StepDecision.joined`)
OTHER_RANK = "(a rule on another data-parallel rank)"


class TrainingStopped(RuntimeError):
    """A rule with ``action: stop`` fired. Raised before the optimizer step, after every file
    the monitor had to write (records, incidents) is on disk. `step` is the optimizer step,
    `rules` the rules that asked to stop, `incidents` the incident directories of this step."""

    def __init__(self, step: int, rules: list[str], incidents: list[Path]) -> None:
        where = f"; incident: {incidents[0]}" if incidents else ""
        super().__init__(f"msprobe stopped the training at step {step}: {', '.join(rules)} fired{where}")
        self.step = step
        self.rules = rules
        self.incidents = incidents


@dataclass(frozen=True, slots=True)
class StepDecision:
    """The rules firing before an optimizer step, and what they ask for. Iterating it (or
    testing its truth) goes over the firing rules. `replaying`: the step is a replay, whose
    optimizer step is never applied."""
    firing: tuple[Firing, ...] = ()
    replaying: bool = False

    @property
    def skip(self) -> bool:
        """True when the optimizer step must not change the weights or the optimizer state."""
        return self.replaying or any(f.action in ("skip", "stop") for f in self.firing)

    @property
    def stop(self) -> bool:
        return any(f.action == "stop" for f in self.firing)

    def __bool__(self) -> bool:
        return bool(self.firing)

    def joined(self, skip: bool, stop: bool) -> "StepDecision":
        """This decision after the ranks agreed on `skip`/`stop` (any rank's applies to all): a
        skip or stop this rank did not decide itself gets a stand-in firing naming OTHER_RANK."""
        if (stop and not self.stop) or (skip and not self.skip):
            other = Firing(OTHER_RANK, OTHER_RANK, "", math.nan, None, "stop" if stop else "skip")
            return replace(self, firing=self.firing + (other,))
        return self

    def __iter__(self) -> Iterator[Firing]:
        return iter(self.firing)

    def __len__(self) -> int:
        return len(self.firing)
