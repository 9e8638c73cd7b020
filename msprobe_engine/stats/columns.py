"""The partial-statistics row: its columns, each registered with its identity, merge and reducers.

The registry is the only place that knows the order of a row's columns. The built-in ones come
first, in the order the single-pass kernels (C on CPU, Triton on CUDA) and the torch packers
write them::

    min, max, sum, sumsq, nan_count, inf_count, zero_count, numel

A statistic needing another column registers it with one reducer per backend (a function of one
flat tensor of that backend returning a 0-dim value) and names it in `Statistic.needs`::

    register_column(PartialColumn("absmax", 0.0, "max"),
                    torch=lambda t: t.abs().amax(), numpy=lambda a: np.abs(a).max())

Every backend appends the registered columns after the built-in ones (a backend without a
reducer for one leaves it nan); the merges (`merge`, the distributed reductions), the empty row
and `finalize` all read this table. Indices are looked up by name (`index`) or by merge kind
(`merge_indices`), never written by position elsewhere; `P_MIN` ... `P_NUMEL` are the built-in
columns' indices, which registering a column never changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True, slots=True)
class PartialColumn:
    """One column: `identity` is its value for an empty tensor (the merge's neutral element),
    `merge` how two rows combine: 'min', 'max' or 'sum'."""
    name: str
    identity: float
    merge: str


MERGES = ("min", "max", "sum")
BUILTIN: tuple[PartialColumn, ...] = (
    PartialColumn("min", math.inf, "min"),
    PartialColumn("max", -math.inf, "max"),
    PartialColumn("sum", 0.0, "sum"),
    PartialColumn("sumsq", 0.0, "sum"),
    PartialColumn("nan_count", 0.0, "sum"),
    PartialColumn("inf_count", 0.0, "sum"),
    PartialColumn("zero_count", 0.0, "sum"),
    PartialColumn("numel", 0.0, "sum"),
)
#: the built-in columns' count: what the single-pass kernels write
N_BUILTIN = len(BUILTIN)

_COLUMNS: list[PartialColumn] = list(BUILTIN)
#: the registered (not built-in) columns, in row order: empty unless a plugin registered one, which
#: is all a backend's fast path checks
EXTRA: list[PartialColumn] = []
#: registered column name -> backend name ("torch", "mindspore", "numpy") -> reducer
_REDUCERS: dict[str, dict[str, Callable[[Any], Any]]] = {}


def register_column(column: PartialColumn, **reducers: Callable[[Any], Any]) -> PartialColumn:
    """Add `column` after the others, with its reducer per backend (``torch=``, ``mindspore=``,
    ``numpy=``): a function of one flat tensor returning its 0-dim value. Registering the same
    column again replaces its reducers."""
    if column.merge not in MERGES:
        raise ValueError(f"column {column.name!r}: merge must be one of {', '.join(MERGES)}, got {column.merge!r}")
    known = index_or_none(column.name)
    if known is not None and known < N_BUILTIN:
        raise ValueError(f"column {column.name!r} is built in")
    if known is None:
        _COLUMNS.append(column)
        EXTRA.append(column)
    elif _COLUMNS[known] != column:
        raise ValueError(f"column {column.name!r} is registered already as {_COLUMNS[known]}")
    _REDUCERS[column.name] = dict(reducers)
    return column


def columns() -> tuple[PartialColumn, ...]:
    """Every column, in row order."""
    return tuple(_COLUMNS)


def names() -> tuple[str, ...]:
    """Every column's name, in row order."""
    return tuple(c.name for c in _COLUMNS)


column_names = names


def n_columns() -> int:
    """A row's width."""
    return len(_COLUMNS)


def index(name: str) -> int:
    """The position of column `name` in a row."""
    found = index_or_none(name)
    if found is None:
        raise KeyError(f"no partial column {name!r}; known: {', '.join(names())}")
    return found


def index_or_none(name: str) -> int | None:
    return next((i for i, c in enumerate(_COLUMNS) if c.name == name), None)


def merge_indices(kind: str) -> list[int]:
    """The positions of the columns merged by `kind` ('min', 'max', 'sum')."""
    return [i for i, c in enumerate(_COLUMNS) if c.merge == kind]


def extra_reducers(backend: str) -> list[Callable[[Any], Any] | None]:
    """For each registered (not built-in) column in row order, its reducer on `backend` (or None).
    Empty when only the built-in columns exist: a backend's fast path checks this."""
    return [_REDUCERS[c.name].get(backend) for c in EXTRA]


def empty_row() -> tuple[float, ...]:
    """The row of an empty tensor: every column's identity."""
    return tuple(c.identity for c in _COLUMNS)


def empty_rows(count: int = 0) -> np.ndarray:
    """`count` empty rows (``[count, n_columns()]`` float64)."""
    return np.tile(np.array(empty_row(), dtype=np.float64), (count, 1))


def builtin_row(values: dict[str, float]) -> list[float]:
    """A row from the built-in columns' values by name (registered columns: nan)."""
    return [values[c.name] for c in BUILTIN] + [math.nan] * (len(_COLUMNS) - N_BUILTIN)


def merge(partials: np.ndarray, axis: int = 0) -> np.ndarray:
    """Merge partial rows along `axis` (e.g. shards or ranks) into one row each."""
    partials = np.asarray(partials, dtype=np.float64)
    out = np.sum(partials, axis=axis)
    for kind, reduce in (("min", np.min), ("max", np.max)):
        at = merge_indices(kind)
        if at:
            out[..., at] = reduce(partials[..., at], axis=axis)
    return out


P_MIN, P_MAX, P_SUM, P_SUMSQ, P_NAN, P_INF, P_ZERO, P_NUMEL = (index(c.name) for c in BUILTIN)
