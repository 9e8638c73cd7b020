"""The dump configuration: the predecessor's ``config.json`` keys, validated before training.

Accepted layout (the predecessor's)::

    {"task": "statistics", "dump_path": "./dump", "rank": [], "step": [0, "4-6"], "level": "L1",
     "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}

The section named after the task (``statistics`` or ``tensor``) holds scope/list/data_mode/
summary_mode; those keys may also be given at the top level. The debugger tasks
(overflow_check, grad_probe, free_benchmark, diff_check) have their own keys in their section,
see `msprobe_engine.dump.tasks`; a task from a ``plugins:`` module (`msprobe_engine.dump.task`)
has its own. Sections of the predecessor's other tasks are ignored.
``risk_level`` (the predecessor's key: CORE, FOCUS (its default) or ALL) picks the APIs recorded
at L1/mix. Our own keys: ``predecessor_format`` (``"26.2"``, the default: ``proc<pid>/``
directories and names as mindstudio-probe 26.2 writes them; ``"1.x"``: its 1.x spellings,
``rank/`` and ``parameters_grad`` without a counter), ``stack`` (write stack.json, on by default
as in the predecessor), ``queue_size`` and
``when_full`` (the writer queue), ``strict`` (errors inside hooks raise), ``plugins`` (modules
imported first: they register tasks and recorders). The keys are typed fields (`DumpKeys`, each
task's `Config`) validated by the main config loader: one `ConfigError` lists every problem,
each naming the key and the value.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

from msprobe_engine.errors import ConfigError
from msprobe_engine.fields import choices
from msprobe_engine.config.loader import ConfigErrors, build_section, import_plugins, problems, read_file
from msprobe_engine.dump import checks, legacy_keys
from msprobe_engine.dump.checks import checked
from msprobe_engine.dump.schema import FRAMEWORKS
from msprobe_engine.dump.task import DUMP_TASKS, LEVELS, DumpTask, FullSelection

WHEN_FULL = ("wait", "drop")
RISK_LEVELS = ("CORE", "FOCUS", "ALL")
PREDECESSOR_FORMATS = ("26.2", "1.x")
#: the predecessor's other tasks: their sections are ignored, choosing them is an error
OTHER_TASKS = ("run_ut", "acc_check", "structure")
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

DumpConfigSource = Union[str, Path, dict, "DumpConfig", None]


def _framework(value: Any, path: str) -> str:
    if value not in FRAMEWORKS:
        raise ConfigError(f"{path}: {value!r} is not supported; use one of {', '.join(FRAMEWORKS)} "
                          "(the session's framework decides; this key is only checked)")
    return value


def _task(value: Any, path: str) -> str:
    advice = legacy_keys.OTHER_TASK_USE.get(value) if isinstance(value, str) else None
    if advice is not None:
        raise ConfigError(f"{path}: {value!r} is a predecessor option this dump does not implement; use one of "
                          f"{', '.join(DUMP_TASKS.names())}; {advice}")
    return checks.one_of(DUMP_TASKS.names)(value, path)


def _predecessor_only(key: str) -> Any:
    return field(default=None, metadata=checked(checks.accepted_only(*PREDECESSOR_ONLY[key])))


@dataclass(kw_only=True, slots=True)
class DumpKeys(FullSelection):
    """The top level of a dump config (the selection keys may also stand in the task's section)."""
    plugins: tuple[str, ...] = field(default=(), metadata=checked(checks.strings))
    task: str = field(default="statistics", metadata=checked(_task))
    dump_path: Path = field(metadata=checked(checks.non_empty_path))
    rank: Optional[frozenset[int]] = field(default=None, metadata=checked(checks.id_list))
    step: Optional[frozenset[int]] = field(default=None, metadata=checked(checks.id_list))
    level: str = field(default="L1", metadata=checked(checks.one_of(LEVELS, ("L2",))))
    framework: str = field(default="pytorch", metadata=checked(_framework))
    enable_dataloader: bool = field(default=False, metadata=checked(checks.only_false))
    async_dump: bool = field(default=False, metadata=checked(checks.flag))  # always asynchronous here
    is_deterministic: bool = field(default=False, metadata=checked(checks.only_false))
    stack: bool = field(default=True, metadata=checked(checks.flag))
    queue_size: int = field(default=256, metadata=checked(checks.positive))
    when_full: str = field(default="wait", metadata=choices(*WHEN_FULL))
    strict: bool = field(default=False, metadata=checked(checks.flag))
    risk_level: str = field(default="FOCUS", metadata=checked(checks.one_of(RISK_LEVELS)))
    predecessor_format: str = field(default="26.2", metadata=checked(checks.one_of(PREDECESSOR_FORMATS,
                                                                                    convert=str)))
    precision: Any = _predecessor_only("precision")
    extra_info: Any = _predecessor_only("extra_info")
    dump_enable: Any = _predecessor_only("dump_enable")
    custom_op_namespaces: Any = _predecessor_only("custom_op_namespaces")
    load: Any = _predecessor_only("load")
    acl_config: Any = _predecessor_only("acl_config")


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
    #: the task's own section: an instance of its `DumpTask.Config` (selection keys merged in)
    options: Any = None

    @property
    def task_class(self) -> type[DumpTask]:
        """The registered `DumpTask` of `task`."""
        return DUMP_TASKS.get(self.task, "task")

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


def is_dump_config(data: dict) -> bool:
    """A config file's top level is a dump config's (it names a task or a dump_path), not a monitor's."""
    return "task" in data or "dump_path" in data


def load_dump_config(source: DumpConfigSource = None, **overrides: Any) -> DumpConfig:
    """Build a `DumpConfig` from a config.json/.yaml path, a dict or a DumpConfig.

    Keyword overrides use the same keys (``task="tensor"``, ``level="L0"``, ``step=[0]``...).
    A `ConfigError` lists every problem found (`loader.problems`), each naming the key.
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
        raise ConfigErrors([f"{origin}: {message}" for message in problems(exc)]) from None


def _build(data: dict) -> DumpConfig:
    plugins = data.get("plugins", [])
    import_plugins(plugins if isinstance(plugins, list) else [])  # they may register the task
    name = data.get("task", "statistics")
    sections = set(DUMP_TASKS.names()) | set(OTHER_TASKS)
    errors: list[str] = []
    keys = options = None
    try:
        keys = build_section(DumpKeys, {k: v for k, v in data.items() if k not in sections}, "")
    except ConfigError as exc:
        errors += problems(exc)
    task = DUMP_TASKS.get(name) if isinstance(name, str) and name in DUMP_TASKS else None
    section: dict = {}
    if task is not None:
        section = data.get(name, {})
        try:
            options = _options(task, section, data)
        except ConfigError as exc:
            errors += problems(exc)
    if errors:
        raise ConfigErrors(errors)
    options = replace(options, **{k: getattr(keys, k) for k in task.selection_keys() if k in data})
    _check_across(task, keys, options, section, "level" in data)
    return DumpConfig(
        dump_path=keys.dump_path, task=name, level=keys.level, ranks=keys.rank, steps=keys.step,
        scope=_pick("scope", options, keys, section), api_list=_pick("list", options, keys, section),
        data_mode=_pick("data_mode", options, keys, section),
        summary_mode=_pick("summary_mode", options, keys, section),
        stack=keys.stack, risk_level=keys.risk_level, predecessor_format=keys.predecessor_format,
        queue_size=keys.queue_size, when_full=keys.when_full, strict=keys.strict, options=options)


def _pick(key: str, options: Any, keys: DumpKeys, section: dict) -> Any:
    """A selection key: from the task's section when it sets it there, else from the top level."""
    return getattr(options, key) if key in section else getattr(keys, key)


def _options(task: type[DumpTask], section: Any, data: dict) -> Any:
    """The task's section built into its `Config` (the predecessor's keys of other tasks checked)."""
    allowed = tuple(f.name for f in fields(task.Config))
    if not isinstance(section, dict):
        raise ConfigError(f"{task.name}: expected a mapping of {', '.join(allowed)}, got {section!r}")
    errors: list[str] = []
    own = {}
    for key, value in section.items():
        where = f"{task.name}.{key}"
        if key not in allowed and key in PREDECESSOR_SECTION_ONLY:  # a key of another task of the predecessor's
            try:
                checks.accepted_only(*PREDECESSOR_SECTION_ONLY[key])(value, where)
            except ConfigError as exc:
                errors.append(str(exc))
            continue
        own[key] = value
        if key in data:
            errors.append(f"{key}: given both at the top level and in '{task.name}'; keep one")
    try:
        options = build_section(task.Config, own, task.name)
    except ConfigError as exc:
        errors += problems(exc)
    if errors:
        raise ConfigErrors(errors)
    return options


def _check_across(task: type[DumpTask], keys: DumpKeys, options: Any, section: dict, level_given: bool) -> None:
    """What needs two keys: the level the task takes, a scope's names against the level, the task's own."""
    if task.levels is not None and keys.level not in task.levels:
        where = "" if level_given else " (the default)"
        raise ConfigError(f"level: {keys.level!r}{where} is not supported by task {task.name}; "
                          f"use one of {', '.join(task.levels)}")
    scope = _pick("scope", options, keys, section)
    if scope is not None:
        checks.scope_level(scope, keys.level, f"{task.name}.scope" if "scope" in section else "scope")
    try:
        task.check(options, set(section))
    except ConfigError as exc:
        raise ConfigError(f"{task.name}.{exc}") from None
