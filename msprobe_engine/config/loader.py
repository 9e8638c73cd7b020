"""Load a `MonitorConfig` from a dict, a JSON file or a YAML file.

Validation happens here, before training starts: unknown keys, wrong types, values
outside their choices or bounds, numbers that are not finite, regular expressions that
do not compile, pairs out of order and nesting deeper than `MAX_DEPTH` raise one
`ConfigError` that lists every problem (`errors`), each naming the key path, the bad
value (cut to `MAX_SHOWN` characters) and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from msprobe_engine.config import shipped
from msprobe_engine.errors import ConfigError, read_utf8
from msprobe_engine.fields import INT_LIMIT
from msprobe_engine.config.legacy import LEGACY_KEYS, translate_legacy
from msprobe_engine.config.schema import MonitorConfig
from msprobe_engine.config.yaml_bounded import load_yaml, yaml_problem

#: mappings and lists nested deeper than this are refused (no config needs more)
MAX_DEPTH = 32
#: a bad value is shown with at most this many characters
MAX_SHOWN = 80
#: one problem's message is cut to this many characters
MAX_MESSAGE = 400


class ConfigErrors(ConfigError):
    """Several configuration problems at once; `errors` holds one message per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors) if len(errors) > 1 else errors[0])
        self.errors = errors


def problems(exc: ConfigError) -> list[str]:
    """The messages of a `ConfigError`, one per problem."""
    return list(getattr(exc, "errors", None) or [str(exc)])

ConfigSource = Union[str, Path, dict, MonitorConfig, None]


def load_config(source: ConfigSource = None) -> MonitorConfig:
    """Build a validated config from a path (.json/.yaml/.yml), a shipped config's name
    (`msprobe_engine.config.shipped`: "full", "minimal", "grads_optimizer", ...), a dict, or None
    (defaults)."""
    if isinstance(source, MonitorConfig):
        return source
    if source is None:
        return MonitorConfig()
    if isinstance(source, dict):
        return from_dict(source)
    if isinstance(source, (str, Path)):  # a path, or a shipped config's name ("full")
        return from_dict(read_file(shipped.resolve(source)), origin=str(source))
    raise ConfigError(f"config: expected a path, a dict or a MonitorConfig, got {type(source).__name__}")


def read_file(path: Path) -> dict:
    """Parse a JSON or YAML file into a dict, naming the file on any problem."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found" if not path.exists() else f"{path}: not a regular file")
    try:
        text = read_utf8(path)
        if not text.strip():
            raise ConfigError(f"{path}: the file is empty (write {{}} for every default)")
        data = json.loads(text) if path.suffix == ".json" else load_yaml(text)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: cannot parse: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: cannot parse: {_cut(yaml_problem(exc), MAX_MESSAGE)}") from None
    except ConfigError:
        raise
    except ValueError as exc:  # not UTF-8 (read_utf8 names the file, line and column)
        raise ConfigError(str(exc)) from None
    except RecursionError:
        raise ConfigError(f"{path}: cannot parse: nested deeper than {MAX_DEPTH} levels") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def from_dict(data: dict, origin: str = "config") -> MonitorConfig:
    """Validate a plain dict (ours or the predecessor's monitor keys) into a config; every
    problem found is listed in the one `ConfigError` raised."""
    try:
        _check_depth(data)
        if isinstance(data, dict):
            import_plugins(data.get("plugins", []))
        return _build(MonitorConfig, _translate(data), "")
    except ConfigError as exc:
        raise ConfigErrors([_cut(f"{origin}: {message}", MAX_MESSAGE) for message in problems(exc)]) from None


def _check_depth(data: Any) -> None:
    """Refuse nesting deeper than `MAX_DEPTH`, naming where (walked without recursion)."""
    todo: list[tuple[Any, str, int]] = [(data, "", 0)]
    while todo:
        value, path, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            todo += [(item, _join(path, _cut(str(key), MAX_SHOWN)), depth + 1) for key, item in value.items()]
        elif isinstance(value, list):
            todo += [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]


def _translate(data: Any) -> Any:
    """The predecessor's keys rewritten into ours; a value the translation cannot read is a
    `ConfigError` naming the predecessor key it came from."""
    if not isinstance(data, dict):
        return data
    try:
        return translate_legacy(data)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
        raise ConfigError(f"{_legacy_culprit(data)}: cannot be read as the predecessor's key: "
                          f"{type(exc).__name__}: {exc}") from None


def _legacy_culprit(data: dict) -> str:
    """The first predecessor key whose value alone makes the translation fail."""
    for key in LEGACY_KEYS:
        if key in data:
            try:
                translate_legacy({key: data[key]})
            except Exception:  # the culprit: whatever its error is
                return key
    return "predecessor keys"


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


def build_section(cls: type, data: Any, path: str) -> Any:
    """Validate `data` into the config dataclass `cls` (e.g. a `Schedule` from a control file);
    a `ConfigError` lists every problem, named under `path`."""
    _check_depth(data)
    return _build(cls, data, path)


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<top>'}: expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    errors: list[str] = []
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            errors.append(f"{_join(path, _cut(str(key), MAX_SHOWN))}: unknown key{hint}; allowed: {', '.join(fields)}")
    kwargs = {}
    for name, spec in fields.items():
        if name in data:
            try:
                kwargs[name] = _convert(hints[name], data[name], _join(path, name), spec.metadata)
            except ConfigError as exc:
                errors += problems(exc)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            errors.append(f"{_join(path, name)}: required key is missing")
    for name, spec in fields.items():
        other = spec.metadata.get("above")
        if other and kwargs.get(name) is not None and isinstance(kwargs.get(other), (int, float)) \
                and not kwargs[name] > kwargs[other]:
            errors.append(f"{_join(path, name)}: {kwargs[name]!r} must be greater than "
                          f"{_join(path, other)} ({kwargs[other]!r})")
    if errors:
        raise ConfigErrors(errors)
    return cls(**kwargs)


def _each(items: list, convert: typing.Callable[[Any, str], Any], path: str) -> list:
    """Convert every item of a list, collecting the problems of all of them."""
    out, errors = [], []
    for i, item in enumerate(items):
        try:
            out.append(convert(item, f"{path}[{i}]"))
        except ConfigError as exc:
            errors += problems(exc)
    if errors:
        raise ConfigErrors(errors)
    return out


def _convert(hint: Any, value: Any, path: str, meta: typing.Mapping) -> Any:
    if "check" in meta:  # a field that converts and checks its value itself (`fields.checked`)
        return meta["check"](value, path)
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
            return _each(value, lambda v, where: _component(meta, v, where), path)
        item = typing.get_args(hint)[0]
        return _each(value, lambda v, where: _convert(item, v, where, meta), path)
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
        try:
            value = float(value) if ok else value
        except OverflowError:  # an integer beyond float's range
            raise ConfigError(f"{path}: {_cut(repr(value), MAX_SHOWN)} is too large") from None
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ConfigError(f"{path}: expected {hint.__name__}, got {_show(value)}")
    if hint in (int, float):
        _check_number(value, path, hint)
    if meta.get("path"):
        _check_path(value, path)
    if meta.get("regex"):
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise ConfigError(f"{path}: {_show(value)} is not a valid regular expression: {exc}") from None
    allowed = meta.get("choices")
    if allowed is not None and not isinstance(allowed, tuple):  # a registry: its names now
        allowed = allowed.names()
    if allowed and value not in allowed:
        raise ConfigError(f"{path}: {_cut(repr(value), MAX_SHOWN)} is not one of {', '.join(allowed)}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{path}: {value!r} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{path}: {value!r} is above the maximum {meta['max']}")
    return value


#: the longest path, and path component, a POSIX file system takes (bytes)
PATH_MAX, NAME_MAX = 4096, 255


def _check_path(value: str, path: str) -> None:
    """A path the file system can take: no NUL, at most PATH_MAX bytes, NAME_MAX per component."""
    if "\0" in value:
        raise ConfigError(f"{path}: {_show(value)} contains a NUL character")
    raw = value.encode("utf-8", "surrogateescape")
    if len(raw) > PATH_MAX:
        raise ConfigError(f"{path}: a path of {len(raw)} bytes (at most {PATH_MAX})")
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise ConfigError(f"{path}: a path component of {len(longest)} bytes (at most {NAME_MAX})")


def _check_number(value: float, path: str, hint: type) -> None:
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"{path}: {value!r} is not a finite number")
    if hint is int and abs(value) > INT_LIMIT:
        raise ConfigError(f"{path}: {_cut(repr(value), MAX_SHOWN)} is out of range (at most {INT_LIMIT})")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit - 25]}... ({len(text)} characters)"


def _show(value: Any) -> str:
    return f"{_cut(repr(value), MAX_SHOWN)} ({type(value).__name__})"
