"""The replay driver: which step function is running through `Monitor.run_step`, whether a
replay is under way, and the framework's side of a replay (`ReplayHost`)."""
from __future__ import annotations

import functools
from typing import Any, Callable

from msprobe_engine.incident.replay import ReplayHost, StepCall


class ReplayDriver:
    """`call`: the step function running through `run_step` now (None outside one); `host`:
    the framework side of a replay (None: steps are not replayed); `replaying`: a step is
    replayed now (hooks leave the real step's state alone, the lifecycle calls do nothing)."""

    def __init__(self) -> None:
        self.host: ReplayHost | None = None
        self.call: StepCall | None = None
        self.replaying = False

    def run_step(self, wanted: bool, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)``; remembered with the RNG state from before it (for a replay)
        when `wanted`, a host can replay it and no step function is running already."""
        if not wanted or self.host is None or self.call is not None or self.replaying:
            return fn(*args, **kwargs)
        self.call = StepCall(fn, args, kwargs, self.host.capture_rng())
        try:
            return fn(*args, **kwargs)
        finally:
            self.call = None


def replayable(run_step: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with every call going through `run_step(fn, ...)`."""
    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        return run_step(fn, *args, **kwargs)
    return step
