"""Value checks of the dump config's fields, for the config loader's ``checked`` metadata.

A dump config key (the predecessor's ``config.json`` keys) often takes what the loader's plain
types do not say: ``[0, "4-6"]`` id lists, ``-1`` meaning all, ``"true"`` for true, a value
that must be one of a few with a note for the predecessor's options not implemented here.
Each check takes (value, key path), returns the converted value or raises `ConfigError`
naming the path; `checked` puts one on a dataclass field::

    overflow_nums: int = field(default=1, metadata=checked(count()))
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.schema import parse_entry_name

Check = Callable[[Any, str], Any]
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
DATA_MODES = ("all", "forward", "backward", "input", "output")
_RANGE_RE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def checked(check: Check) -> dict[str, Any]:
    """Field metadata: the loader converts and checks the value with `check(value, path)`."""
    return {"check": check}


def one_of(allowed: tuple[str, ...] | Callable[[], tuple[str, ...]], known_unsupported: tuple[str, ...] = (),
           convert: Callable[[Any], Any] = lambda v: v) -> Check:
    """The value is one of `allowed` (or a function giving them now: a registry's names);
    `known_unsupported` are the predecessor's options this dump does not implement."""
    def check(value: Any, path: str) -> Any:
        value = convert(value)
        names = allowed() if callable(allowed) else allowed
        if value in names:
            return value
        if value in known_unsupported:
            raise ConfigError(f"{path}: {value!r} is a predecessor option this dump does not implement; "
                              f"use one of {', '.join(names)}")
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(names)}")
    return check


def flag(value: Any, path: str) -> bool:
    """true or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def loose_flag(value: Any, path: str) -> bool:
    """true or false, also as the strings "true"/"false" (the predecessor's documentation writes them)."""
    if value in ("true", "false"):
        return value == "true"
    return flag(value, path)


def only_false(value: Any, path: str) -> bool:
    if value is not False:
        raise ConfigError(f"{path}: only false is supported (call start/stop/step yourself), got {value!r}")
    return value


def positive(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: expected a positive integer, got {value!r}")
    return value


def count(allow_all: bool = True) -> Check:
    """A positive integer; with `allow_all` also -1 (all)."""
    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_all and value == -1)):
            extra = " or -1 (all)" if allow_all else ""
            raise ConfigError(f"{path}: expected a positive integer{extra}, got {value!r}")
        return value
    return check


def tolerance(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ConfigError(f"{path}: expected a finite number >= 0, got {value!r}")
    return float(value)


def non_empty_path(value: Any, path: str) -> Path:
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise ConfigError(f"{path}: expected a non-empty path string, got {value!r}")
    return Path(value)


def directory(value: Any, path: str) -> Path:
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise ConfigError(f"{path}: expected a path, got {value!r}")
    if not Path(value).is_dir():
        raise ConfigError(f"{path}: {str(value)!r} is not a directory")
    return Path(value)


def accepted_only(accepted: tuple, instead: str) -> Check:
    """A predecessor key with no counterpart here: accepted at these values only."""
    def check(value: Any, path: str) -> Any:
        if not any(value == a and type(value) is type(a) for a in accepted):
            shown = ", ".join(json.dumps(a) for a in accepted)
            raise ConfigError(f"{path}: {value!r} is not supported here (accepted: {shown}); {instead}")
        return value
    return check


def strings(value: Any, path: str) -> tuple[str, ...]:
    """A list of non-empty strings (stripped)."""
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"{path}[{i}]: expected a non-empty string, got {item!r}")
    return tuple(item.strip() for item in value)


def names(value: Any, path: str) -> tuple[str, ...]:
    """A list of parameter names."""
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"{path}: expected a list of parameter names, got {value!r}")
    return tuple(value)


def id_list(value: Any, path: str) -> frozenset[int] | None:
    """``[0, 2, "4-6"]`` -> {0, 2, 4, 5, 6}; an empty list means all (None)."""
    key = path.rsplit(".", 1)[-1]
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of integers or \"a-b\" ranges, got {value!r}")
    ids: set[int] = set()
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
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


def data_mode(value: Any, path: str) -> frozenset[str]:
    modes = strings([value] if isinstance(value, str) else value, path)
    if not modes:
        raise ConfigError(f"{path}: empty; use [\"all\"] or a combination of forward, backward, input, output")
    for i, mode in enumerate(modes):
        if mode not in DATA_MODES:
            raise ConfigError(f"{path}[{i}]: {mode!r} is not one of {', '.join(DATA_MODES)}")
    if "all" in modes and len(modes) > 1:
        raise ConfigError(f"{path}: 'all' must be given alone, got {list(modes)}")
    return frozenset(modes)


def scope(value: Any, path: str) -> tuple[str, str] | None:
    """Two full names bounding a range, in order (checked against the level by `scope_level`)."""
    given = strings(value, path)
    if not given:
        return None
    if len(given) != 2:
        raise ConfigError(f"{path}: expected two full names bounding a range (first and last), got {list(given)}")
    parsed = []
    for i, name in enumerate(given):
        entry = parse_entry_name(name)
        if entry is None or entry.phase == "parameters_grad":
            raise ConfigError(f"{path}[{i}]: {name!r} is not a full name such as "
                              f"'Module.conv1.Conv2d.forward.0' or 'Tensor.add.0.forward'")
        parsed.append(entry)
    first, last = parsed
    if first.phase == "backward" and last.phase == "forward":
        raise ConfigError(f"{path}: inverted: {given[0]!r} (backward) runs after {given[1]!r} (forward)")
    if first.key == last.key and first.counter > last.counter:
        raise ConfigError(f"{path}: inverted: call {first.counter} of {first.key} comes after call {last.counter}")
    return given[0], given[1]


def scope_level(names_: tuple[str, str], level: str, path: str) -> None:
    """L0 scopes name modules, L1 scopes name APIs."""
    for i, name in enumerate(names_):
        entry = parse_entry_name(name)
        if level == "L0" and not entry.is_module:
            raise ConfigError(f"{path}[{i}]: {name!r} is an API name but level is L0 (module names only)")
        if level == "L1" and entry.is_module:
            raise ConfigError(f"{path}[{i}]: {name!r} is a module name but level is L1 (API names only)")


def bounds(value: Any, path: str) -> tuple[float, ...]:
    """A non-empty, strictly ascending list of finite numbers within int64."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{path}: expected a non-empty ascending list of numbers, got {value!r}")
    key = path.rsplit(".", 1)[-1]
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            raise ConfigError(f"{path}[{i}]: {item!r} is not a finite number")
        if not INT64_MIN <= item <= INT64_MAX:
            raise ConfigError(f"{path}[{i}]: {item!r} is outside the int64 range")
        if i and item <= value[i - 1]:
            raise ConfigError(f"{path}[{i}]: {item!r} is not greater than {key}[{i - 1}] = {value[i - 1]!r}; "
                              f"{key} must be strictly ascending")
    return tuple(value)
