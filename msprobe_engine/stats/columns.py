"""The partial-statistics row: its columns, each with its identity and how two rows merge.

Declared once here; the numpy merge (`stats.merge`), the empty row, the torch and
MindSpore merges and the distributed reduction all derive from this table. Columns::

    min, max, sum, sumsq, nan_count, inf_count, zero_count, numel
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PartialColumn:
    """One column: `identity` is its value for an empty tensor (the merge's neutral element),
    `merge` how two rows combine: 'min', 'max' or 'sum'."""
    name: str
    identity: float
    merge: str


PARTIALS: tuple[PartialColumn, ...] = (
    PartialColumn("min", math.inf, "min"),
    PartialColumn("max", -math.inf, "max"),
    PartialColumn("sum", 0.0, "sum"),
    PartialColumn("sumsq", 0.0, "sum"),
    PartialColumn("nan_count", 0.0, "sum"),
    PartialColumn("inf_count", 0.0, "sum"),
    PartialColumn("zero_count", 0.0, "sum"),
    PartialColumn("numel", 0.0, "sum"),
)
PARTIAL_COLUMNS: tuple[str, ...] = tuple(c.name for c in PARTIALS)
N_COLUMNS = len(PARTIALS)
COLUMN = {c.name: i for i, c in enumerate(PARTIALS)}
P_MIN, P_MAX, P_SUM, P_SUMSQ, P_NAN, P_INF, P_ZERO, P_NUMEL = (COLUMN[n] for n in PARTIAL_COLUMNS)
#: column indices by merge kind (for vectorised merges in any array library)
MIN_COLUMNS = [i for i, c in enumerate(PARTIALS) if c.merge == "min"]
MAX_COLUMNS = [i for i, c in enumerate(PARTIALS) if c.merge == "max"]
SUM_COLUMNS = [i for i, c in enumerate(PARTIALS) if c.merge == "sum"]
#: the row of an empty tensor: every column's identity
EMPTY_ROW: tuple[float, ...] = tuple(c.identity for c in PARTIALS)


def empty_rows(count: int = 0) -> np.ndarray:
    """`count` empty rows (``[count, N_COLUMNS]`` float64)."""
    return np.tile(np.array(EMPTY_ROW, dtype=np.float64), (count, 1))


def merge(partials: np.ndarray, axis: int = 0) -> np.ndarray:
    """Merge partial rows along `axis` (e.g. shards or ranks) into one row each."""
    partials = np.asarray(partials, dtype=np.float64)
    out = np.sum(partials, axis=axis)
    if MIN_COLUMNS:
        out[..., MIN_COLUMNS] = np.min(partials[..., MIN_COLUMNS], axis=axis)
    if MAX_COLUMNS:
        out[..., MAX_COLUMNS] = np.max(partials[..., MAX_COLUMNS], axis=axis)
    return out
