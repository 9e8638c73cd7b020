"""Replay of an anomalous step, before its optimizer step, with a tensor dump.

A step run through `Monitor.run_step(fn, *args)` is remembered with the RNG state from
before it ran. When an alert starts before its optimizer step, `replay_step` runs
``fn(*args)`` again, on the training thread, from inside that optimizer step: with the RNG
state restored, the gradients set aside (so the replay's backward starts from none) and
module buffers saved, the monitor measuring into a separate buffer and a tensor dump
recording every module. The replay's own optimizer step is skipped. Afterwards gradients,
buffers and RNG state are put back: the training goes on exactly as without the replay.

The replay *reproduces* the alert when each tensor that fired crosses the same threshold
again (``|value| > threshold``, the condition of every rule), else the anomaly was
*transient* (e.g. a flaky device, a race), as Megatron's rerun state machine distinguishes.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

from msprobe_engine.incident.graph import CallGraph
from msprobe_engine.stats import STATISTICS
from msprobe_engine.stats.table import StatTable

log = logging.getLogger("msprobe_engine")


@dataclass
class StepCall:
    """A step function run through the monitor, and the RNG state from before it ran."""
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    rng: Any


class ReplayHost(Protocol):
    """The framework side of a replay (`msprobe_engine.frameworks.torch.replay` for torch)."""

    def capture_rng(self) -> Any:
        """Every RNG state the step may draw from."""

    def restore_rng(self, state: Any) -> None: ...

    def isolated(self) -> ContextManager[None]:
        """Gradients set aside (reset to none) and buffers saved; both restored on exit."""

    def tensor_dump(self, path: Path, step: int, level: str) -> ContextManager[None]:
        """A tensor dump (msprobe layout, `level` L0 or mix) of what runs inside, under `path`."""


@dataclass(frozen=True, slots=True)
class Fired:
    """One tensor that fired: its tag, value and the rule's threshold."""
    tag: str
    value: float
    threshold: float


@dataclass
class Measured:
    """What the monitor measured in a replay: every statistic by tag (`values`), the replay's
    table and the call graph its (eager) hooks noted."""
    values: dict[str, float] = field(default_factory=dict)
    table: StatTable | None = None
    graph: CallGraph | None = None


@dataclass
class ReplayResult:
    """`status`: reproducible | transient | partial (some tensors fired again) | failed | not_run;
    `measured`: what the replay measured (not part of the report)."""
    status: str
    detail: str = ""
    checks: list[dict] = field(default_factory=list)
    dump: str | None = None
    seconds: float = 0.0
    measured: Measured | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(replace(self, measured=None)).items() if k != "measured"}


def every_statistic(table: StatTable) -> dict[str, float]:
    """Tag -> value of every statistic of every row (where a tensor that fired is looked up)."""
    stats = table.finalized()
    return {key.tag(stat): float(stats[stat][i]) for stat in STATISTICS.names() for i, key in enumerate(table.keys)}


def not_run(why: str) -> ReplayResult:
    return ReplayResult("not_run", why)


def replay_step(call: StepCall, host: ReplayHost, measure: Callable[[], ContextManager[Measured]],
                fired: list[Fired], dump_path: Path, step: int, level: str) -> ReplayResult:
    """Run `call` again as described in the module docstring; never raises for an error of the
    step function (the result says `failed`)."""
    start = time.perf_counter()
    resume = host.capture_rng()
    try:
        with host.isolated(), measure() as measured, host.tensor_dump(dump_path, step, level):
            host.restore_rng(call.rng)
            call.fn(*call.args, **call.kwargs)
    except Exception as exc:  # the user's step failed when run again: reported, training goes on
        log.error("msprobe: the replay of step %d failed: %s: %s", step, type(exc).__name__, exc, exc_info=True)
        return ReplayResult("failed", f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - start)
    finally:
        host.restore_rng(resume)
    checks = [_check(f, measured.values.get(f.tag)) for f in fired]
    again = sum(c["reproduced"] for c in checks)
    status = "reproducible" if again == len(checks) else "transient" if again == 0 else "partial"
    dump = str(dump_path) if dump_path.exists() else None
    return ReplayResult(status, f"{again} of {len(checks)} fired tensors fired again", checks, dump,
                        time.perf_counter() - start, measured)


def _check(fired: Fired, value: float | None) -> dict:
    reproduced = value is not None and not math.isnan(value) and abs(value) > fired.threshold
    same = value is not None and (value == fired.value or (math.isnan(value) and math.isnan(fired.value)))
    return {"tag": fired.tag, "value": fired.value, "replay_value": value, "reproduced": reproduced,
            "identical": same}

