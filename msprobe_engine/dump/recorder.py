"""What every dump recorder is to its session, framework-neutral; recorders registered per framework.

A recorder is the training-thread side of one task on one framework (PyTorch's `Recorder`,
MindSpore's `CellRecorder`, the grad_probe and free_benchmark handlers, a user's own). The
session builds it from a `RecorderContext`, switches `active` at start/stop, hands it the model
(`watch`, for the recorders that hook it themselves), closes each step with `finish_step`, shows
`results` as `task_results` and calls `remove` at close. `skipped` is the error policy every hook
body uses, the engine's one (`hook_errors.HookErrors`): strict mode re-raises, otherwise the error
is counted in `hook_errors` and logged once.

Recorders are registered by (framework, task), as a class or as ``"module:Class"`` (imported on
first use, so registering never imports a framework)::

    register_recorder("pytorch", "big_values", BigValuesRecorder)
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.config import DumpConfig
from msprobe_engine.dump.writer import StepData
from msprobe_engine.hook_errors import HookErrors


@dataclass
class RecorderContext:
    """What a session gives its recorder: the config, the rank, the writer thread, the way to hand
    over tensor copies, and the framework's pieces (statistics backend, API catalog, operator names)."""
    config: DumpConfig
    rank: int | None
    writer: Any
    emit_tensors: Callable[[list], None]
    backend: Any = None
    catalog: Any = None
    operators: Any = None


class DumpRecorder:
    """Base of the dump recorders (see the module docstring)."""

    #: True: the session hands the model (or optimizer) to `watch` and installs no module hooks
    watches_model: ClassVar[bool] = False
    #: True: it records module/API calls (the session checks scope/list names and captures APIs)
    records_calls: ClassVar[bool] = True
    #: host transfers of statistics so far (a recorder counts its own)
    transfers: int = 0

    #: recording now: switched by the session's start/stop
    active: bool = False

    def __init__(self, ctx: RecorderContext) -> None:
        self.config = ctx.config
        self.options = ctx.config.options
        self.errors = HookErrors(ctx.config.strict, label="msprobe dump", then="skipped")
        #: errors in hook bodies so far, by key
        self.hook_errors: dict[str, int] = self.errors.counts

    @property
    def results(self) -> list:
        """What the session's `task_results` shows (overflows, divergences, failing outputs)."""
        return []

    def watch(self, model: Any) -> None:
        """Hook `model` (for `watches_model` recorders)."""

    def finish_step(self) -> StepData:
        """Close the step: what it leaves for the writer."""
        raise NotImplementedError

    def remove(self) -> None:
        """Take the recorder's own hooks off."""

    def skipped(self, key: str, exc: Exception, what: str, note: str | None = None) -> bool:
        """A hook body failed with `exc`: False in strict mode (the caller re-raises); otherwise it is
        counted under `key` and logged the first time (``<what>: <error><note>``, the note by default
        ``; it is reported once and skipped``), and True."""
        return self.errors.swallowed(key, exc, what, note)


#: (framework, task) -> recorder class, or "module:Class" imported on first use
_RECORDERS: dict[tuple[str, str], Any] = {}


def register_recorder(framework: str, task: str, recorder: Any) -> None:
    """Make `recorder` (a `DumpRecorder` class or ``"module:Class"``) record `task` on `framework`
    (a session's ``framework``: ``pytorch``, ``mindspore``)."""
    _RECORDERS[(framework, task)] = recorder


def supported_tasks(framework: str) -> tuple[str, ...]:
    """The tasks `framework` has a recorder for, in registration order."""
    return tuple(task for fw, task in _RECORDERS if fw == framework)


def recorder_class(framework: str, task: str) -> type[DumpRecorder]:
    """The recorder class of `task` on `framework` (imported now when registered by name)."""
    found = _RECORDERS.get((framework, task))
    if found is None:
        raise ConfigError(f"task: {task!r} has no recorder on {framework}")
    if isinstance(found, str):
        module, _, attr = found.partition(":")
        found = _RECORDERS[(framework, task)] = getattr(importlib.import_module(module), attr)
    return found
