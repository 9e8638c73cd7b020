"""Registries: the only lists of statistics, rules, sinks and frameworks.

A component is one class registered under a name, with its own nested ``Config``
dataclass (the keys it takes, their types and defaults). The config loader takes its
choices and sub-schemas from here, so a component registered by a user's module
(imported before the config is loaded) is configured exactly like a built-in one::

    from msprobe_engine.rules import Rule, register_rule

    @register_rule("my_rule")
    class MyRule(Rule):
        @dataclass(kw_only=True, slots=True)
        class Config(Rule.Config):
            limit: float = 1.0
        ...

Frameworks are registered by module name and imported on first use, so the engine
core never imports torch or mindspore itself (`load_framework`, `framework_of`).
"""
from __future__ import annotations

import difflib
import importlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from msprobe_engine.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named classes of one kind. `builtins`: the module whose import registers the built-in
    ones (imported on the first look-up, so registration order never matters)."""

    def __init__(self, kind: str, builtins: str) -> None:
        self.kind = kind
        self._builtins = builtins
        self._loaded = False
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make the class selectable by `name`."""
        def add(cls: T) -> T:
            if not name or not isinstance(name, str):
                raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
            self._load()  # the built-ins first, whoever registers first
            self._entries[name] = cls
            setattr(cls, "name", name)
            return cls
        return add

    def get(self, name: str, where: str = "") -> T:
        """The class registered as `name`; a `ConfigError` naming `where` and the choices if none."""
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            near = difflib.get_close_matches(str(name), list(self._entries), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{where or self.kind}: {name!r} is not a registered {self.kind}{hint}; "
                              f"known: {', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        self._load()
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[tuple[str, T]]:
        self._load()
        return iter(list(self._entries.items()))

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self._builtins)


# ---- frameworks ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameworkEntry:
    """What the core knows of a framework before importing it: `module` holds its `FRAMEWORK`
    (a `contract.Framework`), `packages` are the packages its models' and tensors' classes come
    from, `dump_format` is the `framework` field of its dumps (the predecessor's
    name: "pytorch" for torch), `tensor_suffix` the suffix of the tensor files it loads
    (`Framework.load_tensor_file`; None: its dumps hold numpy files) and `precheck` whether it
    replays recorded API calls (`Framework.precheck`, the `run_ut` verb)."""

    module: str
    packages: tuple[str, ...]
    dump_format: str
    tensor_suffix: str | None = None
    precheck: bool = False


#: framework name -> what implements it (imported on first use)
_FRAMEWORKS: dict[str, FrameworkEntry] = {
    "torch": FrameworkEntry("msprobe_engine.frameworks.torch.adapter", ("torch",), "pytorch", ".pt", True),
    "mindspore": FrameworkEntry("msprobe_engine.frameworks.mindspore.adapter", ("mindspore",), "mindspore"),
}


def register_framework(name: str, module: str, *, packages: tuple[str, ...] | None = None,
                       dump_format: str | None = None, tensor_suffix: str | None = None,
                       precheck: bool = False) -> None:
    """Make the framework implemented in `module` (a module path, imported on first use)
    known as `name`. The module has a top-level `FRAMEWORK` object (see
    `msprobe_engine.contract.Framework`) whose `name` is `name` and whose `dump_format` is
    `dump_format`; `packages` (default: `name`) are the packages of its classes
    (see `FrameworkEntry` for the rest)."""
    _FRAMEWORKS[name] = FrameworkEntry(module, tuple(packages or (name,)), dump_format or name, tensor_suffix,
                                       precheck)


def framework_names() -> tuple[str, ...]:
    return tuple(_FRAMEWORKS)


def framework_entry(name: str) -> FrameworkEntry:
    """The registration of framework `name` (a `ConfigError` when there is none)."""
    if name not in _FRAMEWORKS:
        raise ConfigError(f"framework {name!r} is not registered; known: {', '.join(_FRAMEWORKS)}")
    return _FRAMEWORKS[name]


def load_framework(name: str) -> Any:
    """The `Framework` object of `name` (its module is imported now)."""
    return importlib.import_module(framework_entry(name).module).FRAMEWORK


def framework_where(**facts: Any) -> str | None:
    """The registered framework whose registration has these `facts` (e.g. `dump_format="pytorch"`,
    `tensor_suffix=".pt"`), without importing any; None when none has."""
    return next((name for name, entry in _FRAMEWORKS.items()
                 if all(getattr(entry, key) == value for key, value in facts.items())), None)


def framework_of(obj: Any) -> str | None:
    """The registered framework whose classes `obj` is built from (e.g. a `torch.nn.Module`
    subclass defined anywhere: 'torch'), judged by the modules of its class hierarchy, without
    importing any framework; for a module (a backend) or an object of a framework package's own
    classes, the framework whose package holds it. None when no registered framework matches."""
    modules = [obj.__name__] if isinstance(obj, types.ModuleType) else [k.__module__ or "" for k in type(obj).__mro__]
    for module in modules:
        for name, entry in _FRAMEWORKS.items():
            if any(module == package or module.startswith(package + ".")
                   for package in (*entry.packages, entry.module.rsplit(".", 1)[0])):
                return name
    return None
