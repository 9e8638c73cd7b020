"""What is hooked into a monitor: the framework it measures with, the hooks installed for it
(attachments) and the step closers (`contract.StepCloser`)."""
from __future__ import annotations

from typing import Any

from msprobe_engine.handles import Handles, Removable
from msprobe_engine.incident.recorder import IncidentRecorder
from msprobe_engine.registry import framework_names, framework_of, load_framework
from msprobe_engine.stats import numpy_backend
from msprobe_engine.steps.pipeline import StepPipeline
from msprobe_engine.steps.replay import ReplayDriver


class Wiring:
    """`attachments`: objects with `remove()`; `closers`: what runs around each `step_end`."""

    def __init__(self, pipeline: StepPipeline, incidents: IncidentRecorder | None, replay: ReplayDriver) -> None:
        self.pipeline = pipeline
        self.incidents = incidents
        self.replay = replay
        self.attachments = Handles()
        self.closers: list[Any] = []

    def attach(self, monitor: Any, model: Any, optimizer: Any) -> None:
        """`Monitor.attach`: the hooks of the framework `model`'s classes come from, for `monitor`."""
        name = framework_of(model)
        if name is None:
            raise TypeError(f"Monitor.attach: {type(model).__module__}.{type(model).__name__} is not a model of "
                            f"a registered framework ({', '.join(framework_names())})")
        framework = self.use_framework(self.pipeline.backend, name)
        self.add(*framework.attach(monitor, model, optimizer))
        if self.replay.host is None:
            self.replay.host = framework.replay_host()
        if self.replay.host is not None:
            self.replay.host.models.append(model)

    def use_framework(self, backend: Any, name: str | None) -> Any:
        """Measure with `backend` (by default framework `name`'s); incidents write dump.json in
        the dump format of the framework (`Framework.dump_format`). Returns the framework."""
        framework = load_framework(name) if name is not None else None
        self.pipeline.backend = backend or (framework.backend if framework is not None else None)
        if self.incidents is not None and framework is not None:
            self.incidents.context.framework = framework.dump_format
        return framework

    def find_backend(self, tensor: Any) -> None:
        """No backend was given: take the one of the framework `tensor` belongs to (numbers and
        numpy arrays: the host backend)."""
        name = framework_of(tensor)
        self.use_framework(numpy_backend if name is None else None, name)

    def add(self, *attachments: Removable) -> None:
        """Hooks installed for the monitor (objects with `remove()`), removed by `remove`."""
        self.attachments.handles += attachments

    def add_closer(self, closer: Any) -> None:
        """`closer.close_step(loss)` runs first in each `step_end`, `closer.step_closed()` last."""
        self.closers.append(closer)

    def remove(self) -> None:
        """Remove every hook installed for the monitor."""
        self.attachments.remove()
        self.closers.clear()
