"""The dump.json format: entry names, tensor records, validation and iteration.

A dump.json holds ``task``, ``level``, ``framework``, ``dump_data_dir`` and ``data``; ``data``
maps entry names (in call order) to entries. An entry maps a role (``input_args``,
``input_kwargs``, ``output``, ``parameters``, ``input``; or parameter names for
``parameters_grad``) to items. An item is a tensor record, a non-tensor record
(``{"type": "int", "value": 3}``), ``null``, or a list/dict of items.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

TOP_KEYS = {"task": str, "level": str, "framework": str, "dump_data_dir": (str, type(None)), "data": dict}
LEVELS = ("L0", "L1", "L2", "mix")
FRAMEWORKS = ("pytorch", "mindspore")
STAT_KEYS = ("Max", "Min", "Mean", "Norm")
INPUT_ROLES = ("input_args", "input_kwargs", "parameters", "input")
OUTPUT_ROLES = ("output", "parameters_grad")
ENTRY_ROLES = INPUT_ROLES + ("output",)
MODULE_PREFIXES = ("Module", "Cell")
_MODULE_RE = re.compile(r"^(Module|Cell)\.(.+)\.(forward|backward)\.(\d+)$")
_PARAM_GRAD_RE = re.compile(r"^(Module|Cell)\.(.+)\.parameters_grad(?:\.(\d+))?$")
_API_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)\.(.+)\.(\d+)\.(forward|backward)$")
_MD5_RE = re.compile(r"^[0-9a-fA-F]{8}$")
#: summary_mode xor: a 64-bit XOR checksum (a 0-dim tensor's value itself is a number)
_XOR_RE = re.compile(r"^0x[0-9a-f]{16}$")


@dataclass(frozen=True, slots=True)
class EntryName:
    """A parsed entry name.

    ``key`` is the name without its call counter (``Functional.relu.forward``,
    ``Module.layers.0.Linear.forward``): the same call site in two runs has the same key.
    """
    name: str
    prefix: str
    target: str
    phase: str
    counter: int | None

    @property
    def key(self) -> str:
        return f"{self.prefix}.{self.target}.{self.phase}"

    @property
    def is_module(self) -> bool:
        return self.prefix in MODULE_PREFIXES

    @property
    def api_name(self) -> str:
        """Lower-case ``<prefix>.<api>`` (``torch.empty``, ``distributed.recv``) used by ignore rules."""
        return f"{self.prefix.lower()}.{self.target}"


def parse_entry_name(name: str) -> EntryName | None:
    """Parse ``Module.<path>.<Class>.forward.<n>``, ``Module.<path>.<Class>.parameters_grad.<n>``
    (1.x: no counter), ``<Prefix>.<api>.<n>.forward|backward`` (Cell for Module in MindSpore);
    None if none fits."""
    if m := _MODULE_RE.match(name):
        return EntryName(name, m.group(1), m.group(2), m.group(3), int(m.group(4)))
    if m := _PARAM_GRAD_RE.match(name):
        return EntryName(name, m.group(1), m.group(2), "parameters_grad",
                         int(m.group(3)) if m.group(3) is not None else None)
    if m := _API_RE.match(name):
        return EntryName(name, m.group(1), m.group(2), m.group(4), int(m.group(3)))
    return None


@dataclass(frozen=True, slots=True)
class TensorRef:
    """One tensor record of an entry: where it sits (role, path) and its record dict."""
    entry: str
    role: str
    path: tuple[int | str, ...]
    record: dict[str, Any]

    @property
    def label(self) -> str:
        """``output.0``, ``input_args.1.0``, ``parameters.weight``, ``parameters_grad.weight.0``."""
        return ".".join([self.role, *map(str, self.path)])

    @property
    def is_input(self) -> bool:
        return self.role in INPUT_ROLES

    def stat(self, key: str) -> float | None:
        """A statistic as a float (bools as 0/1), or None when absent, null or not a number."""
        value = self.record.get(key)
        if isinstance(value, int) and abs(value) >= _FLOAT_LIMIT:
            return None  # not a float64: validation names it
        return float(value) if isinstance(value, (int, float)) else None


def is_tensor_record(item: Any) -> bool:
    """True for a tensor record: a dict whose ``type`` names a Tensor or Parameter class."""
    kind = item.get("type") if isinstance(item, dict) else None
    return isinstance(kind, str) and (kind.endswith("Tensor") or kind.endswith("Parameter"))


def is_nonfinite(value: float | None) -> bool:
    """True for nan/inf; None (a null statistic) is not an anomaly."""
    return value is not None and not math.isfinite(value)


def has_nonfinite(ref: TensorRef) -> bool:
    """True when any of Max/Min/Mean/Norm of the record is nan or inf."""
    return any(is_nonfinite(ref.stat(key)) for key in STAT_KEYS)


def _walk(entry: str, role: str, item: Any, path: tuple) -> Iterator[TensorRef]:
    if is_tensor_record(item):
        yield TensorRef(entry, role, path, item)
    elif isinstance(item, list):
        for i, sub in enumerate(item):
            yield from _walk(entry, role, sub, path + (i,))
    elif isinstance(item, dict) and "type" not in item:
        for key, sub in item.items():
            yield from _walk(entry, role, sub, path + (key,))


def iter_tensors(entry_name: str, entry: dict[str, Any]) -> Iterator[TensorRef]:
    """Every tensor record of one entry, in document order, with its role and index/key path.

    In a ``parameters_grad`` entry the role is ``parameters_grad`` and the path starts with
    the parameter name."""
    if _PARAM_GRAD_RE.match(entry_name):
        yield from _walk(entry_name, "parameters_grad", entry, ())
        return
    for role in ENTRY_ROLES:
        if role in entry:
            yield from _walk(entry_name, role, entry[role], ())


def iter_dump_tensors(dump: dict[str, Any]) -> Iterator[TensorRef]:
    """Every tensor record of a dump.json dict, entries in execution (insertion) order."""
    for name, entry in dump.get("data", {}).items():
        if isinstance(entry, dict):
            yield from iter_tensors(name, entry)


# ---------------------------------------------------------------- validation

#: JSON integers beyond this do not fit a float64 (a 400-digit ``Max`` is a corrupt record, not a number)
_FLOAT_LIMIT = 2 ** 1024
#: a dimension beyond this does not fit an int64 (no tensor has it)
_DIM_LIMIT = 2 ** 63


def _is_number(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) < _FLOAT_LIMIT
    return isinstance(value, float)


def _short(value: Any) -> str:
    """A value for a message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _valid_md5(value: Any) -> bool:
    """A CRC-32 (summary_mode md5) or a XOR checksum (summary_mode xor: hex, or a 0-dim value)."""
    if isinstance(value, str):
        return bool(_MD5_RE.match(value) or _XOR_RE.match(value))
    return _is_number(value)


def _check_tensor(where: str, rec: dict, task: str, framework: str) -> list[str]:
    problems = []
    if not isinstance(rec.get("dtype"), str):
        problems.append(f"{where}: missing 'dtype'" if "dtype" not in rec else f"{where}: 'dtype' must be a string")
    shape = rec.get("shape")
    if "shape" not in rec:
        problems.append(f"{where}: missing 'shape'")
    elif not (isinstance(shape, list) and all(_is_number(d) and int(d) == d and 0 <= d < _DIM_LIMIT for d in shape)):
        problems.append(f"{where}: 'shape' must be a list of non-negative integers, got {_short(shape)}")
    for key in STAT_KEYS:
        if key not in rec:
            problems.append(f"{where}: missing '{key}'")
            continue
        value = rec[key]
        bool_ok = key in ("Max", "Min") and isinstance(value, bool)
        if not (value is None or _is_number(value) or bool_ok):
            problems.append(f"{where}: '{key}' must be a number or null, got {_short(value)}")
    if framework == "pytorch" and "requires_grad" in rec and not isinstance(rec["requires_grad"], bool):
        problems.append(f"{where}: 'requires_grad' must be true/false, got {rec['requires_grad']!r}")
    if "data_name" in rec and not isinstance(rec["data_name"], str):
        problems.append(f"{where}: 'data_name' must be a string")
    elif task == "tensor" and "data_name" not in rec:
        problems.append(f"{where}: missing 'data_name' (task is 'tensor')")
    if "md5" in rec and not _valid_md5(rec["md5"]):
        problems.append(f"{where}: 'md5' must be an 8-digit hex CRC-32, got {rec['md5']!r}")
    return problems


def _check_item(where: str, item: Any, task: str, framework: str) -> list[str]:
    if item is None:
        return []
    if isinstance(item, list):
        return [p for i, sub in enumerate(item) for p in _check_item(f"{where}[{i}]", sub, task, framework)]
    if not isinstance(item, dict):
        return [f"{where}: expected an object, a list or null, got {type(item).__name__}"]
    if is_tensor_record(item):
        return _check_tensor(where, item, task, framework)
    if "type" in item:
        return [] if isinstance(item["type"], str) else [f"{where}: 'type' must be a string"]
    return [p for k, sub in item.items() for p in _check_item(f"{where}[{k!r}]", sub, task, framework)]


def validate_entry(name: str, entry: Any, task: str = "statistics", framework: str = "pytorch") -> list[str]:
    """Problems of one entry, each prefixed with ``data['<name>']``."""
    where = f"data[{name!r}]"
    parsed = parse_entry_name(name)
    if parsed is None and not isinstance(entry, dict):
        return [f"{where}: expected an object, got {type(entry).__name__}"]
    if parsed is None:
        return [f"{where}: unrecognised entry name (expected Module/Cell.<path>.<Class>.forward|backward.<n>, "
                f"Module/Cell.<path>.<Class>.parameters_grad or <Prefix>.<api>.<n>.forward|backward)"]
    if not isinstance(entry, dict):
        return [f"{where}: expected an object, got {type(entry).__name__}"]
    if parsed.phase == "parameters_grad":
        return _check_item(where, entry, task, framework)
    problems = []
    for role in ENTRY_ROLES:
        if role not in entry:
            continue
        value = entry[role]
        container = dict if role in ("input_kwargs", "parameters") else list
        if not isinstance(value, container):
            problems.append(f"{where}.{role}: expected {'an object' if container is dict else 'a list'}, "
                            f"got {type(value).__name__}")
        problems += _check_item(f"{where}.{role}", value, task, framework)
    return problems


def validate_dump_json(doc: Any) -> list[str]:
    """All problems of a parsed dump.json, as precise messages; empty when valid."""
    if not isinstance(doc, dict):
        return [f"top level: expected an object, got {type(doc).__name__}"]
    problems = []
    for key, kind in TOP_KEYS.items():
        if key not in doc:
            problems.append(f"missing top-level key '{key}'")
        elif not isinstance(doc[key], kind):
            problems.append(f"'{key}': wrong type {type(doc[key]).__name__}")
    if doc.get("level") not in (None, *LEVELS) and isinstance(doc.get("level"), str):
        problems.append(f"'level': {doc['level']!r} is not one of {', '.join(LEVELS)}")
    if isinstance(doc.get("framework"), str) and doc["framework"] not in FRAMEWORKS:
        problems.append(f"'framework': {doc['framework']!r} is not one of {', '.join(FRAMEWORKS)}")
    task = doc.get("task") if isinstance(doc.get("task"), str) else "statistics"
    framework = doc.get("framework") if isinstance(doc.get("framework"), str) else "pytorch"
    if isinstance(doc.get("data"), dict):
        for name, entry in doc["data"].items():
            problems += validate_entry(name, entry, task, framework)
    return problems
