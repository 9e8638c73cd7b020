"""The monitor's state across a restart (`Monitor.state_dict` / `load_state_dict`): the step,
every rule's running state, open alert episodes, the incident counters, the records written.
The dict's format and its checks: `msprobe_engine.state`."""
from __future__ import annotations

from typing import Any

from msprobe_engine.state import STATE_VERSION, check_state
from msprobe_engine.steps.pipeline import StepPipeline


def save_state(pipeline: StepPipeline) -> dict[str, Any]:
    """The run's state, in plain Python types (`torch.save`-able)."""
    incidents = pipeline.incidents
    return {
        "version": STATE_VERSION,
        "step": pipeline.clock.step,
        "rules": [{"rule": rule.name, "state": rule.state_dict()} for rule in pipeline.rules],
        "episodes": pipeline.tracker.state_dict(),
        "incidents": incidents.state_dict() if incidents is not None else None,
        "records_written": pipeline.emitter.records_written,
    }


def load_state(pipeline: StepPipeline, state: dict[str, Any]) -> None:
    """Restore what `save_state` returned: the run goes on from the saved step with the same
    rule state (running averages, open episodes) and incident counters."""
    check_state(state, [rule.name for rule in pipeline.rules])
    pipeline.clock.go_to(int(state["step"]))
    for rule, saved in zip(pipeline.rules, state["rules"]):
        rule.load_state_dict(saved["state"])
    pipeline.tracker.load_state_dict(state["episodes"])
    pipeline.emitter.health.restore([(first.rule, first.tag) for first in pipeline.tracker.open_episodes()])
    if pipeline.incidents is not None and state.get("incidents"):
        pipeline.incidents.load_state_dict(state["incidents"])
    pipeline.emitter.records_written = int(state.get("records_written", 0))
