"""Partial-statistics rows computed inside a compiled MindSpore graph, and their merge.

These functions are compiled into the user's graph (GRAPH_MODE, a `mindspore.jit` step) by the
taps of `graph_capture`; they are plain MindSpore code, traced from this file's source. A row
has the columns of `stats.columns` in row order. On CPU the C kernel's operator
(`kernel_op.write_op`) computes it and merges it into its slot in one call, with the torch side's
CPU semantics (squares summed in float64); elsewhere MindSpore's reductions do (`tensor_row`), with
the semantics of the backend (`backend.partial_stats`): float16/bfloat16/float32 accumulate in
float32, other dtypes in float64. Either way nan and inf are counted exactly; where a nan was counted, min and max are nan; the
zero count is nan unless requested; an empty tensor has the identity row. Registered (not
built-in) columns are nan: their reducers run outside compiled graphs.

`write` merges a row into its slot of the statistics Parameter (`min`/`max`/`sum` by column,
as `stats.columns.merge`) and stamps the slot with the order of its first write, taken from the
Parameter's last row (a counter): the host reads the rows in execution order. After the order
column come the tensor's dtype and shape (`tensor_meta`: constants of the compiled graph, for
dumps), read by the host with the order (`meta_of`).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from msprobe_engine.frameworks.mindspore.backend import sums
from msprobe_engine.frameworks.mindspore.kernel_op import DTYPES as KERNEL_DTYPES
from msprobe_engine.stats import columns

_LOW_PRECISION = (ms.float16, ms.bfloat16, ms.float32)
_NAN = float("nan")


#: the dtypes a row's dtype code stands for (its index)
DTYPES = (ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int8, ms.int16, ms.int32, ms.int64, ms.uint8,
          ms.bool_)
#: dimensions of a shape kept (a longer shape keeps its first ones)
MAX_DIMS = 8
#: the columns after a row's statistics: order, dtype code, ndim, MAX_DIMS sizes
_TAIL = 3 + MAX_DIMS


def buffer_rows(slots: int) -> np.ndarray:
    """The statistics Parameter's value at a step's start: `slots` identity rows, each with an
    order column (and meta columns) of inf (not written: `written`), then the counter row (all 0)."""
    n = columns.n_columns()
    rows = np.zeros((slots + 1, n + _TAIL))
    rows[:slots, :n] = columns.empty_rows(slots)
    rows[:slots, n:] = np.inf
    return rows


def written(rows: np.ndarray) -> np.ndarray:
    """The order column of the slots of host `rows` (the Parameter's value): the order of each
    slot's first write this step, inf where none was written."""
    return rows[:-1, columns.n_columns()]


def meta_of(row: np.ndarray) -> tuple[str, list[int]]:
    """(dtype as MindSpore prints it, e.g. ``Float32``; shape) of a written row of the Parameter."""
    code, ndim, *sizes = row[columns.n_columns() + 1:]
    return str(DTYPES[int(code)]), [int(d) for d in sizes[:min(int(ndim), MAX_DIMS)]]


def tensor_meta(tensor):
    """The meta columns of `tensor` (dtype code, ndim, sizes; constants when compiled)."""
    code = -1
    for i in range(len(DTYPES)):
        if tensor.dtype == DTYPES[i]:
            code = i
    shape = tensor.shape[:MAX_DIMS]
    sizes = shape + (0,) * (MAX_DIMS - len(shape))
    return ops.tuple_to_array((code, len(tensor.shape)) + sizes).astype(ms.float64)


def _merge_masks() -> tuple[np.ndarray, np.ndarray]:
    width = columns.n_columns() + _TAIL
    low, high = np.zeros(width, bool), np.zeros(width, bool)
    low[columns.merge_indices("min")] = True
    high[columns.merge_indices("max")] = True
    low[columns.n_columns():] = True  # order and meta keep the first write's (a reset slot's are inf)
    return low, high


_MIN_MASK, _MAX_MASK = (Tensor(mask) for mask in _merge_masks())
_N_EXTRA = len(columns.EXTRA)


def tensor_row(tensor, count_zeros):
    """The partial row of `tensor` (``[n_columns()]`` float64) by MindSpore's reductions. nan and inf
    are counted only when the sum of squares is not finite (a branch inside the graph), as in the backend."""
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


def write_tensor(buffer, slot, tensor, count_zeros, kernel=None, on=None):
    """Merge the row of `tensor` into its slot of `buffer` (`write`); returns the update, for
    `ops.depend`. `slot`: int32 ``[slot, counter row]`` (`slot_rows`). By `kernel`
    (`kernel_op.write_op`, or None) where it reads the tensor: the row, its merge, the order and
    the meta columns in one call (nothing when `on`, its bool flag, is false) and one scatter; else
    by MindSpore's reductions (`tensor_row`) and `write`."""
    if kernel is not None and tensor.size > 0 and tensor.dtype in KERNEL_DTYPES:
        return ops.scatter_update(buffer, slot, kernel(on, buffer, slot, ops.stop_gradient(tensor)))  # no bprop
    return write(buffer, slot[0], tensor_row(tensor, count_zeros), tensor_meta(tensor))


def slot_rows(slot: int, slots: int) -> Tensor:
    """The rows of a write to `slot` of a Parameter of `slots` slots (`buffer_rows`): the slot's and
    the counter's (a constant of the compiled graph)."""
    return Tensor([slot, slots], ms.int32)


def write(buffer, slot, row, meta):
    """Merge `row` (and `meta`, `tensor_meta`) into row `slot` of `buffer` (a Parameter from
    `buffer_rows`); returns the update, for `ops.depend`."""
    counter = buffer.shape[0] - 1
    old = buffer[slot]
    stamp = buffer[counter, 0] + 1
    new = ops.cat([row, stamp.reshape(1), meta])
    # merged with a reset slot's identity row a row is itself; the order column keeps the first write's
    merged = ops.where(_MIN_MASK, ops.minimum(old, new), ops.where(_MAX_MASK, ops.maximum(old, new), old + new))
    counted = ops.scatter_update(buffer, Tensor([counter], ms.int32), ops.fill(ms.float64, (1, buffer.shape[1]), 0)
                                 + stamp)
    return ops.depend(ops.scatter_update(buffer, slot.reshape(1), merged.reshape(1, -1)), counted)
