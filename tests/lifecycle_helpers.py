"""Record the lifecycle calls an integration makes, and the scenario every integration runs.

`record(monitor)` wraps the monitor's lifecycle methods (`contract.LIFECYCLE`) on the
instance, so every call an integration's hooks make is logged, in order. `letters(calls)`
writes the log as one letter per call (consecutive tensor batches folded into one `T`):

    M micro_step_begin   T add_tensors   B before_optimizer_step
    A after_optimizer_step   E step_end   C close

The scenario: 3 optimizer steps of 2 micro-batches each; a nan in the model at step 1, where
a `non_finite` rule with `action: skip` fires; then a second run whose `stop` rule fires at
step 1. Each runner returns (letters of the skip run, letters of the stop run, whether the
skipped step left the weights unchanged).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from msprobe_engine.contract import LIFECYCLE

LETTERS = {"micro_step_begin": "M", "add_tensors": "T", "before_optimizer_step": "B",
           "after_optimizer_step": "A", "step_end": "E", "close": "C"}
STEPS, MICRO, BAD_STEP = 3, 2, 1

#: one optimizer step: micro-batches (each a begin and its tensors), the decision, the step, its
#: end (calls are logged as they start: what step_end measures itself, the loss, follows its E)
STEP = r"(?:MT*){2}T*BT*AT*ET*"
SKIP_RUN = re.compile(rf"^(?:{STEP}){{{STEPS}}}C$")
STOP_RUN = re.compile(rf"^(?:{STEP}){{{BAD_STEP}}}(?:MT*){{2}}T*BC$")


def record(monitor: Any) -> list[str]:
    """Log every lifecycle call made on `monitor` from now on (the returned list fills up)."""
    calls: list[str] = []
    for name in LIFECYCLE:
        original = getattr(monitor, name)

        def logged(*args: Any, _name: str = name, _original: Callable = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(monitor, name, logged)
    return calls


def letters(calls: list[str]) -> str:
    return re.sub("T+", "T", "".join(LETTERS[c] for c in calls))


def config(out: Path, action: str) -> dict:
    return {"output_dir": str(out), "strict": True, "sinks": [], "incidents": {"enabled": False},
            "watch": {"params": True}, "alerts": [{"rule": "non_finite", "action": action}]}
