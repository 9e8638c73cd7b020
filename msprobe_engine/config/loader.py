"""Load a `MonitorConfig` from a dict, a JSON file or a YAML file.

Validation happens here, before training starts: unknown keys, wrong types
and values outside their choices raise `ConfigError` naming the key path,
the bad value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from msprobe_engine.config.errors import ConfigError
from msprobe_engine.config.legacy import translate_legacy
from msprobe_engine.config.schema import MonitorConfig

ConfigSource = Union[str, Path, dict, MonitorConfig, None]


def load_config(source: ConfigSource = None) -> MonitorConfig:
    """Build a validated config from a path (.json/.yaml/.yml), a dict, or None (defaults)."""
    if isinstance(source, MonitorConfig):
        return source
    if source is None:
        return MonitorConfig()
    if isinstance(source, dict):
        return from_dict(source)
    if isinstance(source, (str, Path)):
        return from_dict(read_file(Path(source)), origin=str(source))
    raise ConfigError(f"config: expected a path, a dict or a MonitorConfig, got {type(source).__name__}")


def read_file(path: Path) -> dict:
    """Parse a JSON or YAML file into a dict, naming the file on any problem."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def from_dict(data: dict, origin: str = "config") -> MonitorConfig:
    """Validate a plain dict (ours or the predecessor's monitor keys) into a config."""
    try:
        if isinstance(data, dict):
            import_plugins(data.get("plugins", []))
        return _build(MonitorConfig, translate_legacy(data), "")
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def import_plugins(modules: Any) -> None:
    """Import the modules listed under `plugins` (they register statistics, rules, sinks)
    before the rest of the config is validated against the registries."""
    if not isinstance(modules, list):
        raise ConfigError(f"plugins: expected a list of module names, got {_show(modules)}")
    for i, name in enumerate(modules):
        if not isinstance(name, str):
            raise ConfigError(f"plugins[{i}]: expected a module name, got {_show(name)}")
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError or an error inside the user's module
            raise ConfigError(f"plugins[{i}]: cannot import {name!r}: {type(exc).__name__}: {exc}") from None


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<top>'}: expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{_join(path, key)}: unknown key{hint}; allowed: {', '.join(fields)}")
    kwargs = {}
    for name, spec in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name), spec.metadata)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_join(path, name)}: required key is missing")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, path: str, meta: typing.Mapping) -> Any:
    origin = typing.get_origin(hint)
    if origin is Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in typing.get_args(hint) if a is not type(None)][0]
        return _convert(inner, value, path, meta)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        if "registry" in meta:
            return [_component(meta, v, f"{path}[{i}]") for i, v in enumerate(value)]
        item = typing.get_args(hint)[0]
        return [_convert(item, v, f"{path}[{i}]", meta) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    return _scalar(hint, value, path, meta)


def _component(meta: typing.Mapping, value: Any, path: str) -> Any:
    """One entry of a list of registered components (rules, sinks): the class named by its
    `meta["key"]` builds it from its own `Config`, so keys it does not have are errors."""
    registry, key = meta["registry"], meta["key"]
    if meta.get("shorthand") and isinstance(value, str):
        value = {key: value}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping with '{key}', got {_show(value)}")
    if key not in value:
        raise ConfigError(f"{path}.{key}: required key is missing (one of {', '.join(registry.names())})")
    cls = registry.get(value[key], f"{path}.{key}")
    check = getattr(cls, "check_available", None)
    if check is not None:
        check(path)
    return _build(cls.Config, value, path)


def _scalar(hint: type, value: Any, path: str, meta: typing.Mapping) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ConfigError(f"{path}: expected {hint.__name__}, got {_show(value)}")
    allowed = meta.get("choices")
    if allowed is not None and not isinstance(allowed, tuple):  # a registry: its names now
        allowed = allowed.names()
    if allowed and value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(allowed)}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{path}: {value!r} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{path}: {value!r} is above the maximum {meta['max']}")
    return value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"
