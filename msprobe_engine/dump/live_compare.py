"""diff_check (live compare): a step's calls against a reference dump, framework-neutral.

The reference is a dump_path of an earlier run (statistics, tensor or md5 dumps). Each step
is compared with the reference's same step and rank, call by call (entries matched by
name, tensors by role and position): shapes and dtypes must match; CRC-32 values when both
sides carry them (``summary_mode: md5``), otherwise Max/Min/Mean/Norm within
``|ours - ref| <= atol + rtol * |ref|`` (nan matches nan, inf the same inf). A call the
reference lacks diverges ("not in the reference"). Steps the reference lacks are skipped.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.reader import DumpError, load_dump
from msprobe_engine.dump.schema import STAT_KEYS, iter_tensors

#: the step's summary: the first divergent call and why, then the others
SUMMARY_JSON = "diff_summary.json"


@dataclass(frozen=True)
class Divergence:
    """One call that differs from the reference, and the first difference found in it."""
    name: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class Reference:
    """The reference dump, loaded once before training."""

    def __init__(self, bench_path: Path) -> None:
        try:
            self._dumps = load_dump(bench_path)
        except DumpError as exc:
            raise ConfigError(f"diff_check.bench_path: {bench_path} is not a usable dump: {exc}") from None

    @property
    def steps(self) -> list:
        return sorted({step for step, _ in self._dumps}, key=lambda s: -1 if s is None else s)

    def entries(self, step: int, rank: int | None) -> dict[str, Any] | None:
        """The reference's dump.json data of (step, rank), None when it has no such step."""
        dump = self._dumps.get((step, rank))
        return None if dump is None else dump.data


def _close(ours: Any, ref: Any, rtol: float, atol: float) -> bool:
    if ours is None or ref is None or isinstance(ours, bool) or isinstance(ref, bool):
        return ours == ref
    if math.isnan(ours) or math.isnan(ref):
        return math.isnan(ours) and math.isnan(ref)
    if math.isinf(ours) or math.isinf(ref):
        return ours == ref
    return abs(ours - ref) <= atol + rtol * abs(ref)


def record_difference(ours: dict, ref: dict, rtol: float, atol: float) -> str | None:
    """The first difference of two tensor records, or None when they agree."""
    for key in ("dtype", "shape"):
        if ours.get(key) != ref.get(key):
            return f"{key} {ours.get(key)} vs reference {ref.get(key)}"
    if "md5" in ours and "md5" in ref:
        return None if ours["md5"] == ref["md5"] else f"md5 {ours['md5']} vs reference {ref['md5']}"
    for key in STAT_KEYS:
        if not _close(ours.get(key), ref.get(key), rtol, atol):
            return f"{key} {ours.get(key)!r} vs reference {ref.get(key)!r}"
    return None


def entry_difference(name: str, ours: dict, ref: dict | None, rtol: float, atol: float) -> str | None:
    """The first difference of an entry and its reference entry, or None when they agree."""
    if ref is None:
        return "not in the reference"
    theirs = {t.label: t.record for t in iter_tensors(name, ref)}
    mine = {t.label: t.record for t in iter_tensors(name, ours)}
    for label, record in mine.items():
        if label not in theirs:
            return f"{label}: not in the reference"
        found = record_difference(record, theirs[label], rtol, atol)
        if found is not None:
            return f"{label}: {found}"
    missing = [label for label in theirs if label not in mine]
    return f"{missing[0]}: only in the reference" if missing else None


def divergent(entries: dict[str, dict], reference: dict[str, Any], rtol: float, atol: float,
              limit: int) -> list[Divergence]:
    """The first `limit` (-1: all) rendered entries, in execution order, that differ from the reference."""
    found: list[Divergence] = []
    for name, entry in entries.items():
        reason = entry_difference(name, entry, reference.get(name), rtol, atol)
        if reason is not None:
            found.append(Divergence(name, reason))
            if len(found) == limit:
                break
    return found
