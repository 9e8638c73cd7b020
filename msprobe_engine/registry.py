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
from typing import Any, Callable, Generic, Iterator, TypeVar

from msprobe_engine.config.errors import ConfigError

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
#: framework name -> the module that implements it (imported on first use)
_FRAMEWORKS: dict[str, str] = {
    "torch": "msprobe_engine.frameworks.torch.adapter",
    "mindspore": "msprobe_engine.frameworks.mindspore.adapter",
}


def register_framework(name: str, module: str) -> None:
    """Make the framework implemented in `module` (a module path, imported on first use)
    known as `name`. The module has a top-level `FRAMEWORK` object (see
    `msprobe_engine.contract.Framework`)."""
    _FRAMEWORKS[name] = module


def framework_names() -> tuple[str, ...]:
    return tuple(_FRAMEWORKS)


def load_framework(name: str) -> Any:
    """The `Framework` object of `name` (its module is imported now)."""
    if name not in _FRAMEWORKS:
        raise ConfigError(f"framework {name!r} is not registered; known: {', '.join(_FRAMEWORKS)}")
    return importlib.import_module(_FRAMEWORKS[name]).FRAMEWORK


def framework_of(obj: Any) -> str | None:
    """The registered framework whose classes `obj` is built from (e.g. a `torch.nn.Module`
    subclass defined anywhere: 'torch'), judged by the modules of its class hierarchy, without
    importing any framework; for a module (a backend), the framework whose package holds it.
    None when no registered framework matches."""
    if isinstance(obj, types.ModuleType):
        return next((name for name, module in _FRAMEWORKS.items()
                     if obj.__name__.startswith(module.rsplit(".", 1)[0] + ".")), None)
    for klass in type(obj).__mro__:
        top = (klass.__module__ or "").split(".", 1)[0]
        if top in _FRAMEWORKS:
            return top
    return None
