"""Batched partial statistics of many MindSpore tensors, with MindSpore's own ops.

Same rows and semantics as `torch_backend` (see `msprobe_engine.stats`), computed
on the tensors' own device and returned as a float64 ``[k, 8]`` tensor.

All the reductions of one call run as ONE compiled graph (`mindspore.jit`): in
PyNative mode every eager op is a trip through the dispatch pipeline, and a few
dozen of them would cost more than the training step. The graph is compiled
once per layout (the shapes and dtypes of the tensors, stable from step to
step; about a second on CPU) and then reused. Inside it, tensors of the same
length (a layer's weight, its gradient, both Adam moments, its update) are
concatenated into one matrix and reduced along its rows; tensors above
LARGE_NUMEL elements are reduced on their own (no concatenated copy: MindSpore's CPU concat
of three 1M-element tensors costs 16 ms, 20x their sum).
A tensor passed twice (a module's output is the next one's input) is reduced once;
a `Difference` (a parameter's update) is computed inside the graph too.

float16/bfloat16/float32 tensors accumulate in float32; float64, integer and
bool tensors in float64, so integers stay exact. nan/inf are counted (exactly,
in int32) only when the sum of squares of all the tensors is not finite, a
branch taken inside the graph, with no host read; where a nan was counted, min
and max are nan (MindSpore's min/max skip nan). The zero count is taken only on
request, as in torch.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from msprobe_engine.frameworks.mindspore.packed_rows import Pack, pack, packed_counts, packed_matrix, packed_stats
from msprobe_engine.stats import columns

#: Tensors above this many elements are reduced on their own, not concatenated.
LARGE_NUMEL = 1 << 16
#: Graph taps measure float32-family tensors of at most this many elements packed together
#: (`packed_rows`): fewer kernels; larger ones cost more in the packing copy than they save.
PACK_NUMEL = 1 << 14
#: Longer tensors are summed in float32 per chunk of this many elements, the chunk sums
#: in float64 (MindSpore's float32 sum of a million elements drifts by about 1e-5).
SUM_CHUNK = 1 << 10

_LOW_PRECISION = (ms.float16, ms.bfloat16, ms.float32)
_NAN, _INF = float("nan"), float("inf")


class Difference(NamedTuple):
    """``after - before`` (a parameter's update), measured as a tensor: computed inside the
    statistics graph, so it costs no launch of its own."""
    after: Tensor
    before: Tensor

    @property
    def dtype(self) -> ms.dtype:
        return self.after.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.after.shape

    @property
    def size(self) -> int:
        return self.after.size


Measured = Union[Tensor, Difference]


def partial_stats(tensors: Sequence[Measured], count_zeros: bool = False, deferred: bool = False) -> Tensor:
    """Return a ``[len(tensors), n_columns()]`` float64 tensor of partial statistics.

    Columns follow `msprobe_engine.stats.columns`: the built-in ones from the one compiled
    graph (in `columns.BUILTIN` order), then the registered ones by their ``mindspore``
    reducers (nan without one). The zero count is nan unless `count_zeros`. Nothing is
    transferred to the host. `deferred` is part of the backend interface; here the rows are
    always packed.
    """
    if not tensors:
        return Tensor(np.empty((0, columns.n_columns())), ms.float64)
    rows = _builtin_stats(tensors, count_zeros)
    return ops.cat([rows, _extra_rows(tensors)], 1) if columns.EXTRA else rows


def _extra_rows(tensors: Sequence[Measured]) -> Tensor:
    """``[len(tensors), len(columns.EXTRA)]`` by the registered columns' ``mindspore`` reducers."""
    reducers = columns.extra_reducers("mindspore")
    rows = []
    for item in tensors:
        flat = (item.after - item.before if isinstance(item, Difference) else item).reshape(-1)
        rows.append(ops.stack([Tensor(column.identity if flat.size == 0 else _NAN, ms.float64)
                               if reduce is None or flat.size == 0 else reduce(flat).astype(ms.float64).reshape(())
                               for reduce, column in zip(reducers, columns.EXTRA)]))
    return ops.stack(rows)


def _builtin_stats(tensors: Sequence[Measured], count_zeros: bool) -> Tensor:
    """The built-in columns of `partial_stats`, by the one compiled graph."""
    distinct = list({id(tensor): tensor for tensor in tensors}.values())
    slot = {id(tensor): i for i, tensor in enumerate(distinct)}
    plan = plan_rows(distinct, [slot[id(tensor)] for tensor in tensors])
    items = [distinct[i] for i in plan.order]
    inputs = tuple(t for item in items for t in (item if isinstance(item, Difference) else (item,)))
    return _rows(ms.mutable(inputs), plan.layout, plan.differences, plan.empty, plan.gather, count_zeros)


class RowPlan(NamedTuple):
    """How `stat_rows` measures some items: `order` (the items in the order it takes them), and its
    arguments `layout`, `differences`, `empty`, `gather`, `pack` (constants of its compiled graph)."""
    order: list[int]
    layout: tuple[tuple[int, int, bool], ...]
    differences: tuple[bool, ...]
    empty: int
    gather: tuple[int, ...]
    pack: Pack | None = None


def plan_rows(items: Sequence[Measured], rows_of: Sequence[int], packed: bool = False) -> RowPlan:
    """The plan of `stat_rows` for the distinct `items` (only their dtypes and sizes are read: a
    Parameter may stand for its gradient), whose row i is that of item `rows_of[i]`: same-length
    items of a family grouped, the float32 family first, the empty ones last. `packed`: the
    float32-family items of at most PACK_NUMEL elements are measured together (`packed_rows`),
    first (for graph taps: fewer kernels)."""
    groups: dict[tuple[bool, int, int], list[int]] = {}
    empty: list[int] = []
    together: list[int] = []
    for i, item in enumerate(items):
        numel = item.size
        if numel == 0:
            empty.append(i)
        elif packed and numel <= PACK_NUMEL and item.dtype in _LOW_PRECISION:
            together.append(i)
        else:
            alone = i if numel > LARGE_NUMEL else -1
            groups.setdefault((item.dtype not in _LOW_PRECISION, numel, alone), []).append(i)
    groups = dict(sorted(groups.items(), key=lambda entry: entry[0][0]))  # the float32 family first
    order = together + [i for members in groups.values() for i in members] + empty
    layout = tuple((numel, len(members), wide) for (wide, numel, _), members in groups.items())
    row_of = np.argsort(order)
    constants = pack([items[i].size for i in together]) if together else None
    return RowPlan(order, layout, tuple(isinstance(items[i], Difference) for i in order), len(empty),
                   tuple(int(row_of[i]) for i in rows_of), constants)


def tensor_meta(tensor: Measured) -> tuple:
    """(dtype, shape, False) for incidents' dump.json, whose MindSpore format has no requires_grad
    (reading a Parameter's waits for the device work queued before it: a sync per tensor)."""
    return tensor.dtype, tensor.shape, False


def host_partial_stats(values: Sequence[np.ndarray], count_zeros: bool = False) -> np.ndarray:
    """`partial_stats` of arrays already on the host (a compiled step's loss, read to the host at its
    end): the same accumulation dtypes and semantics, no launch; registered columns nan."""
    rows = []
    for value in values:
        value = np.asarray(value)
        acc = np.float32 if value.dtype in (np.float16, np.float32) or value.dtype.name == "bfloat16" else np.float64
        flat = value.astype(acc).ravel()
        nans, infs = int(np.isnan(flat).sum()), int(np.isinf(flat).sum())
        low, high = (flat.min(), flat.max()) if flat.size else (_INF, -_INF)
        rows.append(columns.builtin_row({
            "min": _NAN if nans else low, "max": _NAN if nans else high, "sum": flat.sum(dtype=acc),
            "sumsq": (flat * flat).sum(dtype=acc), "nan_count": nans, "inf_count": infs,
            "zero_count": int((flat == 0).sum()) if count_zeros or not flat.size else _NAN, "numel": flat.size}))
    return np.array(rows, np.float64).reshape(len(values), columns.n_columns())


def concat(rows: Sequence[Tensor | np.ndarray]) -> Tensor | np.ndarray:
    """Pack the step's row blocks into one tensor; blocks already on the host (the rows a compiled
    train step wrote, read with its statistics Parameter) stay there when every block is."""
    if all(isinstance(block, np.ndarray) for block in rows):
        return np.concatenate(list(rows))
    rows = [Tensor(block) if isinstance(block, np.ndarray) else block for block in rows]
    return ops.cat(rows) if len(rows) > 1 else rows[0]


def to_host(rows: Tensor | np.ndarray) -> np.ndarray:
    """The single device-to-host copy of a step's packed statistics (numpy float64; host rows as
    they are)."""
    if isinstance(rows, np.ndarray):
        return rows.astype(np.float64, copy=False)
    return rows.asnumpy().astype(np.float64, copy=False)


def scalar(value: float) -> Tensor:
    return Tensor(value, ms.float64)


@ms.jit
def _rows(tensors, layout, differences, empty, gather, count_zeros):
    """`stat_rows`, as one compiled launch."""
    return stat_rows(tensors, layout, differences, empty, gather, count_zeros)


def stat_rows(tensors, layout, differences, empty, gather, count_zeros, packed=None):
    """Built-in rows of the measured items (plain MindSpore code: also compiled into a train step's
    graph by `graph_optimizer`): first the `packed` ones (a `packed_rows.Pack`, or None), then groups
    of (numel, members, accumulate in float64) as
    `layout` says, the float32 family first, then `empty` empty tensors; an item is one
    tensor, or two (after, before) where `differences` says so; row `gather[i]` is the i-th
    result. Compiled once per layout; traced, so the Python loops unroll."""
    f64 = ms.float64
    narrow, wide = [], []  # (min, max, sum, sum of squares) per group, by family
    matrices = []  # (matrix, its Pack or None)
    start = 0  # the next item
    position = 0  # its first tensor
    numels = []
    if packed is not None:
        flats = []
        for item in range(packed.members):
            value, position = _item(tensors, position, differences[item])
            flats.append(value.astype(ms.float32).reshape(-1))
        start = packed.members
        matrix = packed_matrix(flats, packed)
        narrow.append(packed_stats(matrix, packed))
        matrices.append((matrix, packed))
        numels.append(packed.numels)
    for numel, members, is_wide in layout:
        acc = f64 if is_wide else ms.float32
        flats = []
        for item in range(start, start + members):
            value, position = _item(tensors, position, differences[item])
            flats.append(value.astype(acc).reshape(1, numel))
        start += members
        matrix = ops.cat(flats) if members > 1 else flats[0]
        low, high = ops.aminmax(matrix, axis=1)
        stats = (low, high, *sums(matrix, members, numel))
        if is_wide:
            wide.append(stats)
        else:
            narrow.append(stats)
        matrices.append((matrix, None))
    blocks = []
    if narrow:
        blocks.append(_stack(narrow))
    if wide:
        blocks.append(_stack(wide))
    if empty:
        blocks.append(ops.tile(Tensor([[_INF, -_INF, 0, 0]], f64), (empty, 1)))
    values = ops.cat(blocks) if len(blocks) > 1 else blocks[0]
    k = start + empty
    if ops.isfinite(values[:, 3].sum()):  # a finite sum of squares: no nan, no inf anywhere
        counts = ops.zeros((k, 2), f64)
    else:
        counts = ops.stack([_counts(ops.isnan, matrices, empty), _counts(ops.isinf, matrices, empty)], 1)
        values = ops.cat([ops.where(counts[:, :1] > 0, Tensor(_NAN, f64), values[:, :2]),  # min/max skip nan
                          values[:, 2:]], 1)
    if count_zeros:
        zeros = _counts(_is_zero, matrices, empty)
    else:
        zeros = ops.cat(([ops.fill(f64, (start,), _NAN)] if start else []) + _zeros(empty, f64))  # torch: 0 if empty
    numels += [ops.fill(f64, (members,), numel) for numel, members, _ in layout] + _zeros(empty, f64)
    rows = ops.cat([values, counts, ops.stack([zeros, ops.cat(numels)], 1)], 1)
    return ops.gather(rows, Tensor(gather, ms.int32), 0)


def _item(tensors, position, difference):
    """The item whose first tensor is `tensors[position]` (a `Difference`'s after minus before), and
    the position of the next one."""
    if difference:
        return tensors[position] - tensors[position + 1], position + 2
    return tensors[position], position + 1


def sums(matrix, members, numel):
    """Row sums and sums of squares of `matrix` (`members` rows of `numel`), chunked when its rows
    are long; also compiled into the graph taps (`graph_rows`)."""
    if numel <= SUM_CHUNK:
        return matrix.sum(1), (matrix * matrix).sum(1)
    pad = -numel % SUM_CHUNK
    if pad:
        matrix = ops.cat([matrix, ops.zeros((members, pad), matrix.dtype)], 1)
    # a 2-D reduction: MindSpore's CPU reduction over a 3-D tensor's last axis is 7x slower
    chunks = matrix.reshape(-1, SUM_CHUNK)
    return tuple(part.sum(1).astype(ms.float64).reshape(members, -1).sum(1).astype(matrix.dtype)
                 for part in (chunks, chunks * chunks))


def _stack(family):
    """``[k, 4]`` float64 from the (min, max, sum, sum of squares) vectors of some groups."""
    columns = [ops.cat([group[i] for group in family]) if len(family) > 1 else family[0][i] for i in range(4)]
    return ops.stack(columns, 1).astype(ms.float64)


def _counts(test, matrices, empty):
    """Per tensor, how many elements pass `test` (exact, int32), as one float64 vector."""
    parts = [test(matrix).astype(ms.int32).sum(1) if constants is None else packed_counts(test, matrix, constants)
             for matrix, constants in matrices] + _zeros(empty, ms.int32)
    return ops.cat(parts).astype(ms.float64)


def _zeros(n, dtype):
    """``[n]`` zeros as a list of one block, or no block when `n` is 0: an empty `ops.zeros`
    makes MindSpore's CPU Cast kernel warn at every launch ("the memory size of output must
    be greater than 0")."""
    return [ops.zeros((n,), dtype)] if n else []


def _is_zero(matrix):
    return matrix == 0
