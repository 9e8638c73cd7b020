"""Keeping only some calls of a dumped step (overflow_check, diff_check), framework-neutral.

A recorder collects every call of the step as for a statistics dump; after the step's one
host transfer these helpers pick the entries to write: those whose outputs hold nan/inf
(`overflowing`), or any chosen list of names (`keep_entries`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np

from msprobe_engine.dump.entry import TensorSlot
from msprobe_engine.dump.writer import StepData
from msprobe_engine.stats import P_INF, P_MAX, P_MIN, P_NAN, P_NUMEL, P_SUM

log = logging.getLogger("msprobe_engine")
#: the step's summary of overflow_check: which calls overflowed, the first one first
OVERFLOW_SUMMARY_JSON = "overflow_summary.json"
#: the part of an entry that is its call's result (forward: its output; backward: the input gradients)
OUTPUT_KEY = "output"
#: an entry whose every tensor is a result (the gradients of a module's/Cell's parameters)
PARAMS_GRAD = ".parameters_grad"


def result_slots(name: str, skeleton: dict) -> Iterator[TensorSlot]:
    """The tensor slots of an entry that are its call's result (see `OUTPUT_KEY`, `PARAMS_GRAD`)."""
    if name.endswith(PARAMS_GRAD) or f"{PARAMS_GRAD}." in name:
        return iter_slots(skeleton)
    return iter_slots(skeleton.get(OUTPUT_KEY))


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


def nonfinite_rows(host_rows: np.ndarray, nan_only: bool = False) -> np.ndarray:
    """Per packed statistics row: True when its tensor holds a nan or an inf (`nan_only`: a nan)."""
    if not len(host_rows):
        return np.zeros(0, dtype=bool)
    rows = np.asarray(host_rows, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        nans = np.nan_to_num(rows[:, P_NAN]) > 0
        if nan_only:
            return nans & (rows[:, P_NUMEL] > 0)
        counted = nans | (np.nan_to_num(rows[:, P_INF]) > 0)
        spread = ~np.isfinite(rows[:, [P_MIN, P_MAX, P_SUM]]).all(axis=1)
    return (counted | spread) & (rows[:, P_NUMEL] > 0)


def _infinite_argument(skeleton: dict) -> bool:
    """True when a plain argument of the call is +-inf (``masked_fill(mask, -inf)``, ``full(.., inf)``)."""
    def walk(item: Any) -> bool:
        if isinstance(item, dict) and item.get("type") == "float":
            value = item.get("value")
            return isinstance(value, float) and math.isinf(value)
        if isinstance(item, dict):
            return any(walk(v) for v in item.values())
        if isinstance(item, list):
            return any(walk(v) for v in item)
        return False
    return walk(skeleton.get("input_args")) or walk(skeleton.get("input_kwargs"))


def overflowing(entries: dict[str, Any], host_rows: np.ndarray, limit: int) -> list[str]:
    """Names of the first `limit` entries (-1: all), in execution order, whose outputs (parameters_grad:
    its gradients) hold nan/inf.

    A call given an infinite value as an argument (a -inf attention mask fill) may return
    infinities: only a nan in its outputs counts."""
    bad, nans = nonfinite_rows(host_rows), nonfinite_rows(host_rows, nan_only=True)
    found: list[str] = []
    for name, skeleton in entries.items():
        if not isinstance(skeleton, dict):
            continue
        flags = nans if _infinite_argument(skeleton) else bad
        if any(0 <= s.row < len(flags) and flags[s.row] for s in result_slots(name, skeleton)):
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


def held_items(data: StepData, names: list[str], held: list[tuple[TensorSlot, Any, str]], suffix: str,
               to_host: Callable[[Any], Any]) -> list[tuple[TensorSlot, Any]]:
    """The held tensors of the chosen entries `names`, copied to the host, their slots named
    ``<entry>.<suffix>`` (the tensor files the writer saves); the others are left."""
    wanted = {id(slot) for name in names for slot in iter_slots(data.entries[name])}
    items = []
    for slot, tensor, name in held:
        if id(slot) in wanted:
            slot.data_name = f"{name}.{suffix}"
            items.append((slot, to_host(tensor)))
    return items


def overflow_summary(step: int, names: list[str], limit: int) -> dict[str, Any]:
    """overflow_check's extra file of a step whose calls `names` overflowed (logged once a step)."""
    log.warning("msprobe overflow_check: step %d: %d call(s) with nan/inf dumped; the first is %s",
                step, len(names), names[0])
    return {OVERFLOW_SUMMARY_JSON: {"step": step, "overflow_nums": limit, "first_overflow": names[0],
                                    "overflowed": names}}
