"""Mergeable per-tensor statistics.

Every backend reduces a batch of tensors to one row of *partial* statistics per
tensor, in the column order of `stats.columns` (declared once there, with each
column's identity and merge)::

    min, max, sum, sumsq, nan_count, inf_count, zero_count, numel

Partials merge exactly across micro-batches, shards and ranks (min of mins,
max of maxes, the rest add), which is what the distributed reductions rely on.
`finalize` turns partials into the user-facing statistics, each a registered
`Statistic` (`stats.registry`, one file each in `stats/statistics/`).

Non-finite values follow IEEE semantics and are never filtered out: a tensor
holding a nan has nan min/max/mean/norm; one holding +inf (and no nan) has
max=inf and norm=inf. nan_count and inf_count are always exact.
An empty tensor (or an empty shard) has min=+inf and max=-inf, the identities
of the merge; `finalize` reports its min/max/mean as absent (nan) and its norm as 0.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from msprobe_engine.stats.columns import (COLUMN, EMPTY_ROW, N_COLUMNS, P_INF, P_MAX, P_MIN, P_NAN, P_NUMEL,
                                          P_SUM, P_SUMSQ, P_ZERO, PARTIAL_COLUMNS, empty_rows, merge)
from msprobe_engine.stats.registry import STATISTICS, Statistic, optional_columns, register_statistic

DEFAULT_STATS: tuple[str, ...] = ("min", "max", "mean", "norm", "nan_count", "inf_count")


def divide(partials, divisor: float):
    """The partial rows of the same tensors divided by `divisor` > 0 (e.g. a loss scale).

    In place; numpy arrays and torch tensors alike (plain slicing)."""
    partials[..., P_MIN:P_SUM + 1] /= divisor
    partials[..., P_SUMSQ] /= divisor * divisor
    return partials


def finalize(partials: np.ndarray, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Turn partial rows ``[..., N_COLUMNS]`` into named statistics arrays: every registered
    statistic, or those in `names`."""
    p = np.asarray(partials, dtype=np.float64)
    columns = {name: p[..., i] for name, i in COLUMN.items()}
    wanted = STATISTICS.names() if names is None else names
    return {name: STATISTICS.get(name)().compute(columns) for name in wanted}


def reference_partial(values: np.ndarray) -> np.ndarray:
    """Plain numpy float64 partial statistics of one array (the tests' reference)."""
    x = np.asarray(values).astype(np.float64).ravel()
    if x.size == 0:
        return np.array(EMPTY_ROW, dtype=np.float64)
    return np.array([
        x.min() if not np.isnan(x).any() else np.nan,
        x.max() if not np.isnan(x).any() else np.nan,
        x.sum(), (x * x).sum(), np.isnan(x).sum(), np.isinf(x).sum(), (x == 0).sum(), x.size,
    ], dtype=np.float64)


__all__: Sequence[str] = (
    "PARTIAL_COLUMNS", "N_COLUMNS", "DEFAULT_STATS", "STATISTICS", "Statistic", "register_statistic",
    "optional_columns", "merge", "divide", "finalize", "reference_partial", "empty_rows",
    "P_MIN", "P_MAX", "P_SUM", "P_SUMSQ", "P_NAN", "P_INF", "P_ZERO", "P_NUMEL",
)
