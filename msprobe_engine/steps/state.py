"""The monitor's state across a restart (`Monitor.state_dict` / `load_state_dict`): the step,
every rule's running state, open alert episodes, the incident counters, the records written.
The dict's format and its checks: `msprobe_engine.state`."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from msprobe_engine.state import STATE_VERSION, check_state, restore
from msprobe_engine.steps.pipeline import StepPipeline

if TYPE_CHECKING:
    from msprobe_engine.run_dir import RunDir


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
        "alerts_started": alerts_started(pipeline),
    }


def alerts_started(pipeline: StepPipeline) -> int:
    """Alert episodes started so far (Health/alerts): those in the records emitted, and those of
    the steps decided whose records are still held (they are emitted by this run, not the resumed one)."""
    held = sum(event.phase == "start" for _, events in pipeline.held.tables.values() for event in events)
    return pipeline.emitter.health.started + held


def load_state(pipeline: StepPipeline, state: dict[str, Any]) -> None:
    """Restore what `save_state` returned: the run goes on from the saved step with the same
    rule state (running averages, open episodes) and incident counters."""
    check_state(state, [rule.name for rule in pipeline.rules])
    tracker, incidents = pipeline.tracker, pipeline.incidents
    restore([(f"rules[{i}] ({rule.name}).state", functools.partial(rule.load_state_dict, saved.get("state", {})))
             for i, (rule, saved) in enumerate(zip(pipeline.rules, state["rules"]))]
            + [("episodes", functools.partial(tracker.load_state_dict, state["episodes"])),
               ("episodes", lambda: pipeline.emitter.health.restore([(f.rule, f.tag) for f in tracker.open_episodes()],
                                                                   state.get("alerts_started", 0)))]
            + ([("incidents", functools.partial(incidents.load_state_dict, state["incidents"]))]
               if incidents is not None and state.get("incidents") else []))
    pipeline.clock.go_to(state["step"])
    pipeline.emitter.records_written = state.get("records_written", 0)


def resume(pipeline: StepPipeline, run: "RunDir", start_step: int) -> None:
    """Continue a resumed run: from its saved state, else after its last recorded step. A refusal
    gives the run directory's lock back before it raises."""
    try:
        saved = run.saved_state()
        if saved is not None:
            load_state(pipeline, saved)
        elif run.resumed:
            pipeline.clock.go_to(max(start_step, run.next_step_from_records()))
    except BaseException:
        run.release()
        raise
