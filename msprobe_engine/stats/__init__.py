"""Mergeable per-tensor statistics.

Every backend reduces a batch of tensors to one row of *partial* statistics per
tensor, in this column order::

    min, max, sum, sumsq, nan_count, inf_count, zero_count, numel

Partials merge exactly across micro-batches, shards and ranks (min of mins,
max of maxes, the rest add), which is what the distributed reductions rely on.
`finalize` turns partials into the user-facing statistics.

Non-finite values follow IEEE semantics and are never filtered out: a tensor
holding a nan has nan min/max/mean/norm; one holding +inf (and no nan) has
max=inf and norm=inf. nan_count and inf_count are always exact.
An empty tensor (or an empty shard) has min=+inf and max=-inf, the identities
of the merge; `finalize` reports nan min/max/mean/norm for numel == 0.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PARTIAL_COLUMNS: tuple[str, ...] = (
    "min", "max", "sum", "sumsq", "nan_count", "inf_count", "zero_count", "numel",
)
P_MIN, P_MAX, P_SUM, P_SUMSQ, P_NAN, P_INF, P_ZERO, P_NUMEL = range(len(PARTIAL_COLUMNS))

#: Statistics a user can ask for, in display order.
STAT_NAMES: tuple[str, ...] = (
    "min", "max", "mean", "norm", "nan_count", "inf_count", "zero_frac", "numel",
)
DEFAULT_STATS: tuple[str, ...] = ("min", "max", "mean", "norm", "nan_count", "inf_count")


def merge(partials: np.ndarray, axis: int = 0) -> np.ndarray:
    """Merge partial rows along `axis` (e.g. shards or ranks) into one row each."""
    partials = np.asarray(partials, dtype=np.float64)
    out = np.sum(partials, axis=axis)
    out[..., P_MIN] = np.min(partials[..., P_MIN], axis=axis)
    out[..., P_MAX] = np.max(partials[..., P_MAX], axis=axis)
    return out


def divide(partials, divisor: float):
    """The partial rows of the same tensors divided by `divisor` > 0 (e.g. a loss scale).

    In place; numpy arrays and torch tensors alike (plain slicing)."""
    partials[..., P_MIN:P_SUM + 1] /= divisor
    partials[..., P_SUMSQ] /= divisor * divisor
    return partials


def finalize(partials: np.ndarray) -> dict[str, np.ndarray]:
    """Turn partial rows ``[..., 8]`` into named statistics arrays."""
    p = np.asarray(partials, dtype=np.float64)
    numel = p[..., P_NUMEL]
    empty = numel == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        safe = np.where(empty, np.nan, numel)
        return {
            "min": np.where(empty, np.nan, p[..., P_MIN]),
            "max": np.where(empty, np.nan, p[..., P_MAX]),
            "mean": p[..., P_SUM] / safe,
            "norm": np.where(empty, np.nan, np.sqrt(p[..., P_SUMSQ])),
            "nan_count": p[..., P_NAN],
            "inf_count": p[..., P_INF],
            "zero_frac": p[..., P_ZERO] / safe,
            "numel": numel,
        }


def reference_partial(values: np.ndarray) -> np.ndarray:
    """Plain numpy float64 partial statistics of one array (the tests' reference)."""
    x = np.asarray(values).astype(np.float64).ravel()
    if x.size == 0:
        return np.array([np.inf, -np.inf, 0, 0, 0, 0, 0, 0], dtype=np.float64)
    return np.array([
        x.min() if not np.isnan(x).any() else np.nan,
        x.max() if not np.isnan(x).any() else np.nan,
        x.sum(), (x * x).sum(), np.isnan(x).sum(), np.isinf(x).sum(), (x == 0).sum(), x.size,
    ], dtype=np.float64)


__all__: Sequence[str] = (
    "PARTIAL_COLUMNS", "STAT_NAMES", "DEFAULT_STATS", "merge", "divide", "finalize", "reference_partial",
)
