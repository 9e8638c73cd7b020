"""Partial-statistics rows computed inside a compiled MindSpore graph, and their merge.

These functions are compiled into the user's graph (GRAPH_MODE, a `mindspore.jit` step) by the
taps of `graph_capture`; they are plain MindSpore code, traced from this file's source. A row
has the columns of `stats.columns` in row order, with the semantics of the backend
(`backend.partial_stats`): float16/bfloat16/float32 accumulate in float32, other dtypes in
float64; nan and inf are counted exactly; where a nan was counted, min and max are nan; the
zero count is nan unless requested; an empty tensor has the identity row. Registered (not
built-in) columns are nan: their reducers run outside compiled graphs.

`write` merges a row into its slot of the statistics Parameter (`min`/`max`/`sum` by column,
as `stats.columns.merge`) and stamps the slot with the order of its first write, taken from the
Parameter's last row (a counter): the host reads the rows in execution order.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from msprobe_engine.frameworks.mindspore.backend import sums
from msprobe_engine.stats import columns

_LOW_PRECISION = (ms.float16, ms.bfloat16, ms.float32)
_NAN = float("nan")


def buffer_rows(slots: int) -> np.ndarray:
    """The statistics Parameter's value at a step's start: `slots` identity rows, each with an
    order column of inf (not written: `written`), then the counter row (all 0)."""
    rows = np.zeros((slots + 1, columns.n_columns() + 1))
    rows[:slots, :-1] = columns.empty_rows(slots)
    rows[:slots, -1] = np.inf
    return rows


def written(rows: np.ndarray) -> np.ndarray:
    """The order column of the slots of host `rows` (the Parameter's value): the order of each
    slot's first write this step, inf where none was written."""
    return rows[:-1, -1]


def _merge_masks() -> tuple[np.ndarray, np.ndarray]:
    width = columns.n_columns() + 1
    low, high = np.zeros(width, bool), np.zeros(width, bool)
    low[columns.merge_indices("min")] = True
    high[columns.merge_indices("max")] = True
    low[width - 1] = True  # the order column keeps the first write's (a reset slot's is inf)
    return low, high


_MIN_MASK, _MAX_MASK = (Tensor(mask) for mask in _merge_masks())
_N_EXTRA = len(columns.EXTRA)


def tensor_row(tensor, count_zeros):
    """The partial row of `tensor` (``[n_columns()]`` float64). nan and inf are counted only when
    the sum of squares is not finite (a branch inside the graph), as in the backend."""
    f64 = ms.float64
    numel = tensor.size
    if numel == 0:
        return Tensor(columns.empty_row(), f64)
    acc = ms.float32 if tensor.dtype in _LOW_PRECISION else f64
    flat = tensor.astype(acc).reshape(1, numel)
    low, high = ops.aminmax(flat, axis=1)
    total, squares = sums(flat, 1, numel)
    if count_zeros:
        zeros = (flat == 0).astype(acc).sum(1)
    else:
        zeros = ops.fill(acc, (1,), _NAN)
    row = ops.cat([low, high, total, squares, ops.zeros((2,), acc), zeros, ops.fill(acc, (1,), numel)]).astype(f64)
    if not ops.isfinite(squares[0]):
        nans = ops.isnan(flat).astype(ms.int32).sum().astype(f64)
        infs = ops.isinf(flat).astype(ms.int32).sum().astype(f64)
        nan = ops.where(nans > 0, Tensor(_NAN, f64), Tensor(0.0, f64))  # min and max skip nan
        row = ops.cat([row[:2] + nan, row[2:4], ops.stack([nans, infs]), row[6:]])
    if _N_EXTRA:
        row = ops.cat([row, ops.fill(f64, (_N_EXTRA,), _NAN)])
    return row


def write(buffer, slot, row):
    """Merge `row` into row `slot` of `buffer` (a Parameter from `buffer_rows`); returns the update,
    for `ops.depend`."""
    counter = buffer.shape[0] - 1
    old = buffer[slot]
    stamp = buffer[counter, 0] + 1
    new = ops.cat([row, stamp.reshape(1)])
    # merged with a reset slot's identity row a row is itself; the order column keeps the first write's
    merged = ops.where(_MIN_MASK, ops.minimum(old, new), ops.where(_MAX_MASK, ops.maximum(old, new), old + new))
    counted = ops.scatter_update(buffer, Tensor([counter], ms.int32), ops.fill(ms.float64, (1, buffer.shape[1]), 0)
                                 + stamp)
    return ops.depend(ops.scatter_update(buffer, slot.reshape(1), merged.reshape(1, -1)), counted)
