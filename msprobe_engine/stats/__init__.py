"""Mergeable per-tensor statistics.

Every backend reduces a batch of tensors to one row of *partial* statistics per
tensor, in the column order of `stats.columns` (registered there, with each
column's identity, merge and per-backend reducer; the built-in ones)::

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

from msprobe_engine.stats import columns as _columns
from msprobe_engine.stats.columns import (P_INF, P_MAX, P_MIN, P_NAN, P_NUMEL, P_SUM, P_SUMSQ, P_ZERO, PartialColumn,
                                          column_names, empty_rows, merge, register_column)
from msprobe_engine.stats.registry import STATISTICS, Statistic, optional_columns, register_statistic

DEFAULT_STATS: tuple[str, ...] = ("min", "max", "mean", "norm", "nan_count", "inf_count")


def divide(partials, divisor: float):
    """The partial rows of the same tensors divided by `divisor` > 0 (e.g. a loss scale).

    In place; numpy arrays and torch tensors alike (plain slicing). Registered columns are
    left as they are (their scaling is unknown here)."""
    for at in (P_MIN, P_MAX, P_SUM):
        partials[..., at] /= divisor
    partials[..., P_SUMSQ] /= divisor * divisor
    return partials


def finalize(partials: np.ndarray, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Turn partial rows ``[..., n_columns()]`` into named statistics arrays: every registered
    statistic, or those in `names`."""
    p = np.asarray(partials, dtype=np.float64)
    by_name = {name: p[..., i] for i, name in enumerate(_columns.names()[:p.shape[-1]])}
    wanted = STATISTICS.names() if names is None else names
    return {name: STATISTICS.get(name)().compute(by_name) for name in wanted}


def reference_partial(values: np.ndarray) -> np.ndarray:
    """Plain numpy float64 partial statistics of one array (the tests' reference; registered
    columns by their ``numpy`` reducer)."""
    x = np.asarray(values).astype(np.float64).ravel()
    if x.size == 0:
        return np.array(_columns.empty_row(), dtype=np.float64)
    nan = bool(np.isnan(x).any())
    row = _columns.builtin_row({
        "min": np.nan if nan else x.min(), "max": np.nan if nan else x.max(), "sum": x.sum(),
        "sumsq": (x * x).sum(), "nan_count": np.isnan(x).sum(), "inf_count": np.isinf(x).sum(),
        "zero_count": (x == 0).sum(), "numel": x.size})
    for i, reduce in enumerate(_columns.extra_reducers("numpy"), start=_columns.N_BUILTIN):
        if reduce is not None:
            row[i] = float(reduce(x))
    return np.array(row, dtype=np.float64)


__all__: Sequence[str] = (
    "DEFAULT_STATS", "STATISTICS", "Statistic", "register_statistic", "PartialColumn", "register_column",
    "column_names", "optional_columns", "merge", "divide", "finalize", "reference_partial", "empty_rows",
    "P_MIN", "P_MAX", "P_SUM", "P_SUMSQ", "P_NAN", "P_INF", "P_ZERO", "P_NUMEL",
)
