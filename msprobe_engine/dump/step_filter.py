"""Keeping only some calls of a dumped step (overflow_check, diff_check), framework-neutral.

A recorder collects every call of the step as for a statistics dump; after the step's one
host transfer these helpers pick the entries to write: those whose outputs hold nan/inf
(`overflowing`), or any chosen list of names (`keep_entries`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator

import numpy as np

from msprobe_engine.dump.entry import TensorSlot
from msprobe_engine.dump.writer import StepData
from msprobe_engine.stats import P_INF, P_MAX, P_MIN, P_NAN, P_NUMEL, P_SUM

#: the part of an entry that is its call's result (forward: its output; backward: the input gradients)
OUTPUT_KEY = "output"


def iter_slots(skeleton: Any) -> Iterator[TensorSlot]:
    """Every tensor slot of an entry skeleton, in order."""
    if isinstance(skeleton, TensorSlot):
        yield skeleton
    elif isinstance(skeleton, list):
        for item in skeleton:
            yield from iter_slots(item)
    elif isinstance(skeleton, dict):
        for item in skeleton.values():
            yield from iter_slots(item)


def nonfinite_rows(host_rows: np.ndarray) -> np.ndarray:
    """Per packed statistics row: True when its tensor holds a nan or an inf."""
    if not len(host_rows):
        return np.zeros(0, dtype=bool)
    rows = np.asarray(host_rows, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        counted = (np.nan_to_num(rows[:, P_NAN]) > 0) | (np.nan_to_num(rows[:, P_INF]) > 0)
        spread = ~np.isfinite(rows[:, [P_MIN, P_MAX, P_SUM]]).all(axis=1)
    return (counted | spread) & (rows[:, P_NUMEL] > 0)


def overflowing(entries: dict[str, Any], host_rows: np.ndarray, limit: int) -> list[str]:
    """Names of the first `limit` entries (-1: all), in execution order, whose outputs hold nan/inf."""
    bad = nonfinite_rows(host_rows)
    found: list[str] = []
    for name, skeleton in entries.items():
        if isinstance(skeleton, dict) and any(0 <= s.row < len(bad) and bad[s.row]
                                              for s in iter_slots(skeleton.get(OUTPUT_KEY))):
            found.append(name)
            if len(found) == limit:
                break
    return found


def keep_entries(data: StepData, names: list[str]) -> StepData:
    """`data` with only the entries `names` (and their construct/stack records)."""
    keep = set(names)
    return replace(data, entries={n: data.entries[n] for n in names},
                   construct={n: p for n, p in data.construct.items() if n in keep},
                   stacks=None if data.stacks is None else {n: f for n, f in data.stacks.items() if n in keep},
                   write_empty=False)
