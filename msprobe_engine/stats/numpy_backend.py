"""A host backend: partial statistics of numbers and numpy arrays (no framework needed).

The monitor uses it when it is given plain numbers (a float loss) or numpy arrays and no
framework backend; its rows are already on the host, so `to_host` copies nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from msprobe_engine.stats import empty_rows, reference_partial


def partial_stats(tensors: Sequence[Any], count_zeros: bool = False, deferred: bool = False) -> np.ndarray:
    """``[len(tensors), n_columns()]`` float64 rows (the zero count is always taken: it is cheap here)."""
    if not tensors:
        return empty_rows()
    return np.stack([reference_partial(np.asarray(t)) for t in tensors])


def concat(rows: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(list(rows)) if rows else empty_rows()


def to_host(rows: np.ndarray) -> np.ndarray:
    return np.asarray(rows, dtype=np.float64)


def scalar(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float64)


def pick(sources: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """Rows already measured: row `pos` of each `(rows, pos)`."""
    return np.stack([rows[pos] for rows, pos in sources])
