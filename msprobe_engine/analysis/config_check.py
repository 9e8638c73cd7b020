"""`config-check RUN_A RUN_B`: what differs between two runs' environments, first difference first.

Each run is a monitor run (its directory, a rank directory) or an environment.json; the file is
written by every monitor run at start (`incident.environment.snapshot`) and grows the sections
the training adds (`Monitor.record_environment`: hyper-parameters, data-order and weight
fingerprints). The differences are listed in this order of sections: Python, packages, imported
frameworks, environment variables, world, hyper-parameters, config, data, weights, then any
other; within a section in the first run's order (data: batch by batch). Keys that differ
between any two runs (the time, the host, the output directory and run name) are left out
unless `everything`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from msprobe_engine.errors import read_utf8
from msprobe_engine.incident.environment import ENVIRONMENT_FILE

SECTIONS = ("python", "packages", "frameworks", "env", "world", "hyperparameters", "config", "data", "weights")
#: dotted keys that differ between any two runs
INCIDENTAL = ("world.host", "config.output_dir", "config.run_name", "config.resume")
MISSING = "<absent>"

Difference = tuple[str, Any, Any]


def find_environment(path: Path | str) -> Path:
    """The environment.json of a run directory, a rank directory (rank 0 first) or the file itself."""
    path = Path(path)
    if path.is_file():
        return path
    candidates = [path / ENVIRONMENT_FILE, *sorted(path.glob(f"rank*/{ENVIRONMENT_FILE}"),
                                                   key=lambda p: int(p.parent.name[4:] or 0))]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ValueError(f"{path}: no {ENVIRONMENT_FILE} (written by a monitor run at start, in <run>/rank<R>/)")


def load_environment(path: Path | str) -> dict[str, Any]:
    file = find_environment(path)
    try:
        document = json.loads(read_utf8(file))  # a byte that is not UTF-8: its error names file, line, column
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except OSError as exc:
        raise ValueError(f"{file}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(document).__name__}")
    return document


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}[{i}]", out)
    elif isinstance(value, list) and prefix.startswith("data."):  # fingerprints: batch by batch
        for i, item in enumerate(value):
            out[f"{prefix}[{i}]"] = item
    else:
        out[prefix] = value


def differences(a: dict[str, Any], b: dict[str, Any], everything: bool = False) -> list[Difference]:
    """(dotted key, value in A, value in B) for every key that differs, in section order."""
    order = [s for s in SECTIONS] + [s for s in [*a, *b] if s not in SECTIONS]
    found: list[Difference] = []
    for section in dict.fromkeys(order):
        flat_a, flat_b = {}, {}
        _flatten(a.get(section, {}), section, flat_a)
        _flatten(b.get(section, {}), section, flat_b)
        for key in dict.fromkeys([*flat_a, *flat_b]):
            if not everything and key in INCIDENTAL:
                continue
            va, vb = flat_a.get(key, MISSING), flat_b.get(key, MISSING)
            if va != vb:
                found.append((key, va, vb))
    return found


def format_differences(a: str, b: str, found: list[Difference]) -> str:
    if not found:
        return f"config-check: {a} and {b}: the same environment, packages, config and fingerprints"
    lines = [f"config-check: {len(found)} difference(s), first first ({a} | {b})"]
    lines += [f"  {key}: {va} | {vb}" for key, va, vb in found]
    return "\n".join(lines)


# ---- the verb ------------------------------------------------------------------------------
def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="a monitor run (its directory or a rank directory) or an environment.json")
    p.add_argument("b", help="the other run")
    p.add_argument("--all", action="store_true", help="also keys that differ between any two runs (host, paths)")
    p.add_argument("--json", metavar="PATH", help="also write the differences as JSON ('-' for stdout only)")


def run(args: argparse.Namespace) -> int:
    """Print the differences; exit 0 when there are none, 1 when there are (as diff does)."""
    found = differences(load_environment(args.a), load_environment(args.b), args.all)
    if args.json != "-":
        print(format_differences(args.a, args.b, found))
    if args.json:
        text = json.dumps([{"key": k, "a": va, "b": vb} for k, va, vb in found], indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text, encoding="utf-8")
    return 1 if found else 0
