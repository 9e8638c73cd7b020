"""grad_probe's files (the predecessor's layout), framework-neutral; written on the writer thread::

    <dump_path>/rank<R>/grad_summary_<step>.csv      one row per parameter
    <dump_path>/rank<R>/step<step>/<param>.npy       L1, L2: the gradient's direction (grad > 0, bool)

CSV columns by ``grad_level``: L0 ``param_name, MD5, max, min, norm, shape``; L1 ``param_name,
max, min, norm, shape``; L2 ``param_name, <one share per interval of bounds>, =0, max, min, norm,
shape``, the intervals being ``(-inf, b0], (b0, b1], ..., (bn, inf)``. A single-process run
writes ``rank0``.
"""
from __future__ import annotations

import csv
import difflib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from msprobe_engine.errors import ConfigError

STAT_HEADER = ("max", "min", "norm", "shape")
SUMMARY_PREFIX = "grad_summary_"


@dataclass
class GradRows:
    """One step of one rank, on the host: names, shapes, max/min/norm, and per level the
    interval counts and zero counts (L2), float32 values (L0, for MD5) or directions (L1, L2)."""
    names: list[str]
    shapes: list[list[int]]
    stats: np.ndarray                        # [n, 3]: max, min, norm
    counts: np.ndarray | None = None         # [n, len(bounds) + 2]: intervals..., zeros (numel-normalised later)
    values: list[np.ndarray] | None = None   # L0: float32 values for the MD5
    directions: list[np.ndarray] | None = None


def check_param_list(wanted: Sequence[str], names: Sequence[str], owner: str) -> None:
    """A ConfigError naming the first ``param_list`` entry that is not one of `names`, the
    parameters `owner` has (e.g. "the model has no trainable"), with the closest name as a hint."""
    for i, name in enumerate(wanted):
        if name not in names:
            near = difflib.get_close_matches(name, list(names), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"grad_probe.param_list[{i}]: {owner} parameter {name!r}{hint}")


def interval_names(bounds: Sequence[float]) -> list[str]:
    """``(-inf, b0]``, ``(b0, b1]``... ``(bn, inf)`` as the predecessor writes them."""
    names = [f"(-inf, {bounds[0]}]"]
    names += [f"({low}, {high}]" for low, high in zip(bounds, bounds[1:])]
    return names + [f"({bounds[-1]}, inf)"]


def csv_header(level: str, bounds: Sequence[float]) -> list[str]:
    head = ["param_name"]
    if level == "L0":
        head.append("MD5")
    if level == "L2":
        head += interval_names(bounds) + ["=0"]
    return head + list(STAT_HEADER)


def interval_counts(values: np.ndarray, bounds: Sequence[float]) -> np.ndarray:
    """Counts of `values` per interval ``(-inf, b0], (b0, b1]... (bn, inf)`` and of exact zeros,
    compared in float64 (a value equal to a bound falls in the interval it closes)."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    index = np.searchsorted(np.asarray(bounds, dtype=np.float64), flat, side="left")
    counts = np.bincount(index, minlength=len(bounds) + 1)
    return np.concatenate([counts, [np.count_nonzero(flat == 0)]]).astype(np.float64)


def rank_dir(root: Path, rank: int | None) -> Path:
    return Path(root) / f"rank{rank or 0}"


def write_grad_step(root: Path, rank: int | None, step: int, level: str, bounds: Sequence[float],
                    rows: GradRows) -> Path:
    """Write one step's CSV (and direction files); returns the CSV's path."""
    out = rank_dir(root, rank)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, name in enumerate(rows.names):
        line: list = [name]
        if level == "L0":
            line.append(hashlib.md5(np.ascontiguousarray(rows.values[i]).tobytes()).hexdigest())
        if level == "L2":
            numel = int(np.prod(rows.shapes[i]))
            line += [c / numel if numel else 0 for c in rows.counts[i].tolist()]
        line += rows.stats[i].tolist() + [rows.shapes[i]]
        lines.append(line)
    path = out / f"{SUMMARY_PREFIX}{step}.csv"
    tmp = path.with_suffix(".csv.partial")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(csv_header(level, bounds))
        writer.writerows(lines)
    os.replace(tmp, path)
    if rows.directions is not None:
        step_dir = out / f"step{step}"
        step_dir.mkdir(exist_ok=True)
        for name, direction in zip(rows.names, rows.directions):
            np.save(step_dir / f"{name}.npy", direction)
    return path
