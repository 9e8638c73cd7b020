"""The dump configuration: the predecessor's ``config.json`` keys, validated before training.

Accepted layout (the predecessor's)::

    {"task": "statistics", "dump_path": "./dump", "rank": [], "step": [0, "4-6"], "level": "L1",
     "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}

The section named after the task (``statistics`` or ``tensor``) holds scope/list/data_mode/
summary_mode; those keys may also be given at the top level. The debugger tasks
(overflow_check, grad_probe, free_benchmark, diff_check) have their own keys in their section,
see `msprobe_engine.dump.tasks`. Sections of the predecessor's other tasks are ignored.
``risk_level`` (the predecessor's key: CORE, FOCUS (its default) or ALL) picks the APIs recorded
at L1/mix. Our own keys: ``predecessor_format`` (``"26.2"``, the default: ``proc<pid>/``
directories and names as mindstudio-probe 26.2 writes them; ``"1.x"``: its 1.x spellings,
``rank/`` and ``parameters_grad`` without a counter), ``stack`` (write stack.json, on by default
as in the predecessor), ``queue_size`` and
``when_full`` (the writer queue), ``strict`` (errors inside hooks raise). Every problem raises
`ConfigError` naming the key and the value.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from msprobe_engine.config.errors import ConfigError
from msprobe_engine.config.loader import read_file
from msprobe_engine.dump.schema import FRAMEWORKS, parse_entry_name
from msprobe_engine.dump import legacy_keys
from msprobe_engine.dump.tasks import TASK_LEVELS, TaskOptions, parse_task_options, section_keys

TASKS = ("statistics", "tensor")
LEVELS = ("L0", "L1", "mix")
DATA_MODES = ("all", "forward", "backward", "input", "output")
SUMMARY_MODES = ("statistics", "md5", "xor")
WHEN_FULL = ("wait", "drop")
#: the debugger tasks of `msprobe_engine.dump.tasks` (overflow_check, grad_probe, free_benchmark, diff_check)
DEBUGGER_TASKS = tuple(TASK_LEVELS)
RISK_LEVELS = ("CORE", "FOCUS", "ALL")
PREDECESSOR_FORMATS = ("26.2", "1.x")
#: the predecessor's other tasks: their sections are ignored, choosing them is an error
OTHER_TASKS = ("run_ut", "acc_check", "structure")
SECTION_KEYS = ("scope", "list", "data_mode", "summary_mode")
TOP_KEYS = ("task", "dump_path", "rank", "step", "level", "framework", "enable_dataloader", "async_dump",
            "is_deterministic", "stack", "queue_size", "when_full", "strict", "risk_level",
            "predecessor_format")
#: the predecessor's keys this dump has no counterpart for: accepted at these values (its
#: defaults, or values that change nothing here); any other value is an error saying what to use
PREDECESSOR_ONLY: dict[str, tuple[tuple, str]] = {
    "precision": (("low", "high"), "statistics are accumulated in float64 here whatever the precision"),
    "extra_info": ((True,), "the dump always writes the same fields"),
    "dump_enable": ((None,), "switch the dump with start()/stop() and the step/rank lists"),
    "custom_op_namespaces": ((None, []), "NPU custom operators are not captured here"),
    "load": ((None, {}), "read a dump with msprobe_engine.dump.load_dump and feed the tensors yourself"),
    **legacy_keys.TOP_KEYS,
}
PREDECESSOR_SECTION_ONLY: dict[str, tuple[tuple, str]] = {
    "slice": ((None, []), "whole tensors are dumped; slice them after loading"),
    "request_id": ((None,), "inference request selection is not implemented; use step/rank lists"),
    "diff_nums": ((None, 1), "used by its overflow/nan tasks, not by the dump"),
    "bench_path": ((None, ""), "compare two dumps with `msprobe-engine compare`"),
    "tensor_list": ((None, []), "use task 'tensor' with a 'list' of API names"),
    **legacy_keys.SECTION_KEYS,
}
_RANGE_RE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")

DumpConfigSource = Union[str, Path, dict, "DumpConfig", None]


@dataclass(frozen=True)
class DumpConfig:
    """A validated dump configuration (see the module docstring for the keys)."""
    dump_path: Path
    task: str = "statistics"
    level: str = "L1"
    ranks: frozenset[int] | None = None
    steps: frozenset[int] | None = None
    scope: tuple[str, str] | None = None
    api_list: tuple[str, ...] = ()
    data_mode: frozenset[str] = frozenset({"all"})
    summary_mode: str = "statistics"
    stack: bool = True
    risk_level: str = "FOCUS"
    predecessor_format: str = "26.2"
    queue_size: int = 256
    when_full: str = "wait"
    strict: bool = False
    #: the options of a debugger task (`msprobe_engine.dump.tasks`), None for statistics/tensor
    options: TaskOptions | None = None

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def check_ranks(self, world_size: int) -> None:
        """Raise if a configured rank does not exist in a run of `world_size` processes."""
        missing = sorted(r for r in self.ranks or () if r >= world_size)
        if missing:
            raise ConfigError(f"rank: {', '.join(map(str, missing))} does not exist: this run has "
                              f"{world_size} process{'es' if world_size > 1 else ''} "
                              f"(ranks 0-{world_size - 1})")


def load_dump_config(source: DumpConfigSource = None, **overrides: Any) -> DumpConfig:
    """Build a `DumpConfig` from a config.json/.yaml path, a dict or a DumpConfig.

    Keyword overrides use the same keys (``task="tensor"``, ``level="L0"``, ``step=[0]``...).
    """
    if isinstance(source, DumpConfig):
        if overrides:
            raise ConfigError(f"config: keyword overrides {sorted(overrides)} need a path or a dict, not a DumpConfig")
        return source
    origin = "config"
    if source is None:
        data: dict = {}
    elif isinstance(source, dict):
        data = dict(source)
    elif isinstance(source, (str, Path)):
        data, origin = read_file(Path(source)), str(source)
    else:
        raise ConfigError(f"config: expected a path, a dict or a DumpConfig, got {type(source).__name__}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return _build(data)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def _build(data: dict) -> DumpConfig:
    if data.get("task") in legacy_keys.OTHER_TASK_USE:
        raise ConfigError(f"task: {data['task']!r} is a predecessor option this dump does not implement; use one of "
                          f"{', '.join(TASKS + DEBUGGER_TASKS)}; {legacy_keys.OTHER_TASK_USE[data['task']]}")
    task = _choice(data.get("task", "statistics"), "task", TASKS + DEBUGGER_TASKS, OTHER_TASKS)
    section = _section(data, task)
    for key in data:
        if key in PREDECESSOR_ONLY:
            _predecessor_only(key, data[key], PREDECESSOR_ONLY[key])
        elif key not in TOP_KEYS and key not in SECTION_KEYS and key not in TASKS + DEBUGGER_TASKS + OTHER_TASKS:
            _unknown(key, TOP_KEYS + SECTION_KEYS + TASKS + DEBUGGER_TASKS)
    _reject_unsupported(data)
    if "dump_path" not in data:
        raise ConfigError("dump_path: required key is missing")
    dump_path = data["dump_path"]
    if not isinstance(dump_path, (str, Path)) or not str(dump_path).strip():
        raise ConfigError(f"dump_path: expected a non-empty path string, got {dump_path!r}")
    level = _choice(data.get("level", "L1"), "level", LEVELS, ("L2",))
    options = _task_options(task, section, level, "level" in data)
    return DumpConfig(
        dump_path=Path(dump_path), task=task, level=level,
        ranks=parse_id_list(data.get("rank", []), "rank"),
        steps=parse_id_list(data.get("step", []), "step"),
        scope=_scope(section.get("scope", []), level),
        api_list=tuple(_strings(section.get("list", []), "list")),
        data_mode=_data_mode(section.get("data_mode", ["all"])),
        summary_mode=_choice(section.get("summary_mode", "statistics"), "summary_mode", SUMMARY_MODES),
        stack=_bool(data.get("stack", True), "stack"),
        risk_level=_choice(data.get("risk_level", "FOCUS"), "risk_level", RISK_LEVELS),
        predecessor_format=_choice(str(data.get("predecessor_format", "26.2")), "predecessor_format",
                                   PREDECESSOR_FORMATS),
        queue_size=_positive(data.get("queue_size", 256), "queue_size"),
        when_full=_choice(data.get("when_full", "wait"), "when_full", WHEN_FULL),
        strict=_bool(data.get("strict", False), "strict"),
        options=options,
    )


def _section(data: dict, task: str) -> dict:
    section = data.get(task, {})
    allowed = _section_keys(task)
    if not isinstance(section, dict):
        raise ConfigError(f"{task}: expected a mapping of {', '.join(allowed)}, got {section!r}")
    for key in section:
        if key in allowed:
            pass
        elif key in PREDECESSOR_SECTION_ONLY:  # a key of another task of the predecessor's
            _predecessor_only(f"{task}.{key}", section[key], PREDECESSOR_SECTION_ONLY[key])
        else:
            _unknown(f"{task}.{key}", allowed, key)
        if key in data:
            raise ConfigError(f"{key}: given both at the top level and in '{task}'; keep one")
    return {**{k: data[k] for k in SECTION_KEYS if k in data},
            **{k: v for k, v in section.items() if k in allowed}}


def _predecessor_only(key: str, value: Any, spec: tuple[tuple, str]) -> None:
    accepted, instead = spec
    if not any(value == a and type(value) is type(a) for a in accepted):
        shown = ", ".join(json.dumps(a) for a in accepted)
        raise ConfigError(f"{key}: {value!r} is not supported here (accepted: {shown}); {instead}")


def _unknown(path: str, allowed: tuple[str, ...], key: str | None = None) -> None:
    near = difflib.get_close_matches(key or path, allowed, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise ConfigError(f"{path}: unknown key{hint}; allowed: {', '.join(allowed)}")


def _reject_unsupported(data: dict) -> None:
    if data.get("framework", "pytorch") not in FRAMEWORKS:
        raise ConfigError(f"framework: {data['framework']!r} is not supported; use one of {', '.join(FRAMEWORKS)} "
                          "(the session's framework decides; this key is only checked)")
    for key in ("enable_dataloader", "is_deterministic"):
        if data.get(key, False) is not False:
            raise ConfigError(f"{key}: only false is supported (call start/stop/step yourself), "
                              f"got {data[key]!r}")
    if "async_dump" in data:
        _bool(data["async_dump"], "async_dump")  # always asynchronous here; accepted for compatibility


def _choice(value: Any, key: str, allowed: tuple[str, ...], known_unsupported: tuple[str, ...] = ()) -> str:
    if value in allowed:
        return value
    if value in known_unsupported:
        raise ConfigError(f"{key}: {value!r} is a predecessor option this dump does not implement; "
                          f"use one of {', '.join(allowed)}")
    raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"{key}[{i}]: expected a non-empty string, got {item!r}")
    return [item.strip() for item in value]


def parse_id_list(value: Any, key: str) -> frozenset[int] | None:
    """``[0, 2, "4-6"]`` -> {0, 2, 4, 5, 6}; an empty list means all (None)."""
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of integers or \"a-b\" ranges, got {value!r}")
    ids: set[int] = set()
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(item, int) and not isinstance(item, bool):
            if item < 0:
                raise ConfigError(f"{where}: {item} is negative; {key} ids start at 0")
            ids.add(item)
        elif isinstance(item, str) and item.strip().isdigit():
            ids.add(int(item))
        elif isinstance(item, str) and (m := _RANGE_RE.match(item)):
            low, high = int(m.group(1)), int(m.group(2))
            if low > high:
                raise ConfigError(f"{where}: range {item!r} is inverted (start {low} > end {high}); "
                                  f"write \"{high}-{low}\"")
            ids.update(range(low, high + 1))
        else:
            raise ConfigError(f"{where}: {item!r} is neither a non-negative integer nor a range like \"4-6\"")
    return frozenset(ids) if ids else None


def _data_mode(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        value = [value]
    modes = _strings(value, "data_mode")
    if not modes:
        raise ConfigError("data_mode: empty; use [\"all\"] or a combination of forward, backward, input, output")
    for i, mode in enumerate(modes):
        if mode not in DATA_MODES:
            raise ConfigError(f"data_mode[{i}]: {mode!r} is not one of {', '.join(DATA_MODES)}")
    if "all" in modes and len(modes) > 1:
        raise ConfigError(f"data_mode: 'all' must be given alone, got {modes}")
    return frozenset(modes)


def _scope(value: Any, level: str) -> tuple[str, str] | None:
    names = _strings(value, "scope")
    if not names:
        return None
    if len(names) != 2:
        raise ConfigError(f"scope: expected two full names bounding a range (first and last), got {names}")
    parsed = []
    for i, name in enumerate(names):
        entry = parse_entry_name(name)
        if entry is None or entry.phase == "parameters_grad":
            raise ConfigError(f"scope[{i}]: {name!r} is not a full name such as "
                              f"'Module.conv1.Conv2d.forward.0' or 'Tensor.add.0.forward'")
        if level == "L0" and not entry.is_module:
            raise ConfigError(f"scope[{i}]: {name!r} is an API name but level is L0 (module names only)")
        if level == "L1" and entry.is_module:
            raise ConfigError(f"scope[{i}]: {name!r} is a module name but level is L1 (API names only)")
        parsed.append(entry)
    first, last = parsed
    if first.phase == "backward" and last.phase == "forward":
        raise ConfigError(f"scope: inverted: {names[0]!r} (backward) runs after {names[1]!r} (forward)")
    if first.key == last.key and first.counter > last.counter:
        raise ConfigError(f"scope: inverted: call {first.counter} of {first.key} comes after call {last.counter}")
    return names[0], names[1]



# ---- debugger tasks (overflow_check, grad_probe, free_benchmark, diff_check; issue 17) --------
def _section_keys(task: str) -> tuple[str, ...]:
    """The keys the section named after `task` accepts."""
    return section_keys(task) if task in DEBUGGER_TASKS else SECTION_KEYS


def _task_options(task: str, section: dict, level: str, level_given: bool) -> TaskOptions | None:
    """A debugger task's options (its own keys; scope/list/data_mode stay with the dump's)."""
    if task not in DEBUGGER_TASKS:
        return None
    own = {k: v for k, v in section.items() if k not in SECTION_KEYS}
    return parse_task_options(task, own, level, level_given)
