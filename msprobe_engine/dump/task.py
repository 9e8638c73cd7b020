"""Dump tasks as registered components: one class per task, its section's keys a typed `Config`.

A task is what the predecessor's ``"task"`` key names (statistics, tensor, overflow_check, ...).
Its class says which levels it takes and whether it saves tensor files; its nested ``Config``
dataclass is the section named after it (``{"task": "overflow_check", "overflow_check":
{...}}``), validated by the main config loader like a rule's or a sink's, so every key has one
type, default and check. The selection keys a section may hold (scope, list, data_mode,
summary_mode; also accepted at the top level) come from the `Selection` bases it extends.
What a task records on a framework is that framework's recorder, registered per (framework,
task) in `msprobe_engine.dump.recorders`. A user's task::

    from msprobe_engine.dump.task import DumpTask, FullSelection, register_task

    @register_task("big_values")
    class BigValues(DumpTask):
        @dataclass(kw_only=True, slots=True)
        class Config(FullSelection):
            threshold: float = 1e3
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Optional

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import checks
from msprobe_engine.dump.checks import checked
from msprobe_engine.registry import Registry

LEVELS = ("L0", "L1", "mix")
SUMMARY_MODES = ("statistics", "md5", "xor")
#: the selection keys, in the order the predecessor's sections list them
SELECTION_KEYS = ("scope", "list", "data_mode", "summary_mode")


@dataclass(kw_only=True, slots=True)
class ScopeList:
    """Which calls are recorded: a range of full names, and/or names (or name parts) to keep."""
    scope: Optional[tuple[str, str]] = field(default=None, metadata=checked(checks.scope))
    list: tuple[str, ...] = field(default=(), metadata=checked(checks.strings))


@dataclass(kw_only=True, slots=True)
class ScopeListMode(ScopeList):
    """`ScopeList` and which tensors of a call: all, forward/backward, input/output."""
    data_mode: frozenset[str] = field(default=frozenset({"all"}), metadata=checked(checks.data_mode))


@dataclass(kw_only=True, slots=True)
class FullSelection(ScopeListMode):
    """`ScopeListMode` and what each tensor's entry holds: statistics, or also a checksum."""
    summary_mode: str = field(default="statistics", metadata=checked(checks.one_of(SUMMARY_MODES)))


class DumpTask:
    """A dump task; subclasses are registered with `register_task`."""

    #: set by `register_task`
    name: ClassVar[str] = ""
    #: the levels this task takes (None: it does not use the key)
    levels: ClassVar[Optional[tuple[str, ...]]] = LEVELS
    #: dump.json names a dump_data_dir: the task saves tensor files
    saves_tensors: ClassVar[bool] = False

    @dataclass(kw_only=True, slots=True)
    class Config:
        """The keys of the task's section (none by default)."""

    @classmethod
    def selection_keys(cls) -> tuple[str, ...]:
        """The selection keys its section accepts."""
        own = {f.name for f in fields(cls.Config)}
        return tuple(k for k in SELECTION_KEYS if k in own)

    @classmethod
    def check(cls, options: Any, given: set[str]) -> None:
        """Checks across the section's keys (`given`: the keys the section set); raise `ConfigError`
        naming the key (relative to the section)."""


DUMP_TASKS: Registry[type[DumpTask]] = Registry("dump task", "msprobe_engine.dump.tasks")


def register_task(name: str) -> Callable[[type[DumpTask]], type[DumpTask]]:
    """Class decorator: make a `DumpTask` selectable as ``"task": name``."""
    return DUMP_TASKS.register(name)


def require_support(task: str, framework: str, supported: tuple[str, ...]) -> None:
    """A framework session's check, before training, that it implements `task`."""
    if task not in supported:
        raise ConfigError(f"task: {task!r} is not supported on {framework} yet; "
                          f"{framework} supports {', '.join(supported)}")
