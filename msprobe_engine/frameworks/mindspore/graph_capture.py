"""Activation statistics from inside a compiled MindSpore graph (GRAPH_MODE, a `mindspore.jit` step).

No Python hook runs in a compiled graph, but a Cell's `construct` is compiled from its source.
So each watched Cell gets, for the monitor's lifetime, its own subclass (`_tapped_class`) whose
`construct` calls the original one and then, compiled into the same graph, reduces the outputs
(and inputs) to partial rows and merges them into their slots of one preallocated float64
statistics Parameter (`graph_rows.write_tensor`: on CPU one call of the C kernel's operator,
`kernel_op`, and one `ops.scatter_update`; kept by `ops.depend`). The
gradient w.r.t. each output goes through `GradTap`, an identity Cell whose custom `bprop`
writes the gradient's row the same way. The Parameter is held outside the Cells' parameter
lists (the net's parameters, names and checkpoints are unchanged).

Called eagerly (PyNative, no `jit`), the subclass's `__call__` marks the Cell as running in
Python and its `construct` is the original one: the Cell hooks measure as before. The mark is
read as a constant when MindSpore compiles the Cell, where it is always False.

Once a step, at its end (`take`), the Parameter is read to the host (one transfer, no compiled
launch), its written rows gathered there and the Parameter reset (one assign), and handed to
the monitor (`wiring`) or a dump (`capture.graph_recorder`) as rows of the step under
PyNative's names (`actv/<path>/output`, `output.<i>` for a tuple's items, `input.<i>`,
`actv_grad/...`): the forward rows in the order the graph wrote them, then the gradient rows,
the Cells in reverse order. Which slots a graph writes is learned from one
host read of the Parameter at the first monitored step whose graph wrote any.

Limits: a Cell called several times in a step has one row (its calls merged), not `path:1`...;
at most `ROWS_PER_CELL` tensors of a tuple (one level) per Cell and role, positional inputs
only; on an unmonitored step (`monitor(False)`) the kernel's operator reads no tensor and leaves
the Parameter as it is, but its calls and scatters still run (MindSpore's reductions, where the
kernel is not used, run in full at every step); registered columns are nan. The subclass must be
in place before the graph is compiled: a net compiled before the monitor was attached keeps its
graph (a warning says so).
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from msprobe_engine.frameworks.mindspore import kernel_op
from msprobe_engine.frameworks.mindspore.graph_rows import buffer_rows, meta_of, slot_rows, write_tensor, written
from msprobe_engine.stats import columns
from msprobe_engine.stats.table import MetricKey

#: tensors of a tuple measured per Cell and role (the rest are not)
ROWS_PER_CELL = 4
#: slots per Cell and role: a bare tensor, then a tuple's items
_SECTION = ROWS_PER_CELL + 1
#: (attribute of the tapped Cell holding the section's first slot, metric kind, role prefix)
_SECTIONS = (("_msprobe_out", "actv", "output"), ("_msprobe_in", "actv", "input"),
             ("_msprobe_grad", "actv_grad", "output"))

STALE_GRAPH = ("no statistics came from the compiled graph in a monitored step: a graph compiled before the "
               "monitor was attached keeps its Cells as they were; attach the monitor before the first call")


class _Holder:
    """Holds the statistics Parameter and the flag where a Cell's `bprop` may use them (MindSpore
    refuses a Parameter of the Cell itself there)."""

    def __init__(self, buffer: Parameter, on: Parameter) -> None:
        self.buffer, self.on = buffer, on


class GradTap(nn.Cell):
    """Identity on `x`; its bprop writes the row of the incoming gradient into its slot (`slot`:
    `graph_rows.slot_rows`)."""

    def __init__(self, buffer: Parameter, on: Parameter, count_zeros: bool, kernel) -> None:
        super().__init__()
        object.__setattr__(self, "_msprobe_holder", _Holder(buffer, on))  # not parameters of this Cell
        self.count_zeros = count_zeros
        self.kernel = kernel
        self.slots = buffer.shape[0] - 1

    def construct(self, x, slot):
        return x

    def bprop(self, x, slot, out, dout):
        holder = self._msprobe_holder
        done = write_tensor(holder.buffer, slot, dout, self.count_zeros, self.kernel, holder.on)
        return ops.depend(dout, done), ops.zeros_like(slot)


def _record(buffer, first, value, count_zeros, kernel, on):
    """`value` (a tensor, or a tuple/list whose tensors are measured) kept after its rows are
    written (`write_tensor` by `kernel` and its flag `on`) from slot `first` (a bare tensor) or
    `first + 1 + i` (item i)."""
    if isinstance(value, Tensor):
        return ops.depend(value, write_tensor(buffer, slot_rows(first, buffer.shape[0] - 1), value, count_zeros,
                                             kernel, on))
    if isinstance(value, (tuple, list)):
        for i in range(min(len(value), ROWS_PER_CELL)):
            item = value[i]
            if isinstance(item, Tensor):
                value = ops.depend(value, write_tensor(buffer, slot_rows(first + 1 + i, buffer.shape[0] - 1), item,
                                                       count_zeros, kernel, on))
    return value


def _floating(value):
    return isinstance(value, Tensor) and value.dtype in (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def _grad_taps(tap, first, value):
    """`value` with its floating-point tensors passed through `tap` (their gradients' rows)."""
    if _floating(value):
        return tap(value, slot_rows(first, tap.slots))
    if isinstance(value, tuple):
        items = ()
        for i in range(len(value)):
            item = value[i]
            if i < ROWS_PER_CELL and _floating(item):
                item = tap(item, slot_rows(first + 1 + i, tap.slots))
            items = items + (item,)
        return items
    return value


def _tapped_class(base: type) -> type:
    """The subclass of Cell class `base` whose compiled `construct` writes the rows."""

    class Tapped(base):
        def construct(self, *args, **kwargs):
            # `super()`, not `base.construct(self, ...)`: compiled that way, the Cell's own attribute
            # assignments (`self.calls = self.calls + 1` on a Parameter) would not update its Parameters
            if self._msprobe_eager:
                return super().construct(*args, **kwargs)
            out = super().construct(*args, **kwargs)
            if self._msprobe_in >= 0:
                out = ops.depend(out, _record(self._msprobe_buffer, self._msprobe_in, args, self._msprobe_zeros,
                                              self._msprobe_kernel, self._msprobe_on))
            if self._msprobe_out >= 0:
                out = _record(self._msprobe_buffer, self._msprobe_out, out, self._msprobe_zeros, self._msprobe_kernel,
                              self._msprobe_on)
            if self._msprobe_grad >= 0:
                out = _grad_taps(self._msprobe_tap, self._msprobe_grad, out)
            return out

    return tapped(Tapped, base)


def tapped(cls: type, base: type) -> type:
    """`cls`, a tapped subclass of Cell class `base`, named as `base` and with a `__call__` that marks
    the Cell as running in Python (`_msprobe_eager`: PyNative, where the hooks measure) while it runs."""

    def __call__(self, *args, **kwargs):
        object.__setattr__(self, "_msprobe_eager", True)
        try:
            return base.__call__(self, *args, **kwargs)
        finally:
            object.__setattr__(self, "_msprobe_eager", False)

    cls.__call__ = __call__
    cls.__name__, cls.__qualname__ = base.__name__, base.__qualname__
    return cls


_TAP_ATTRIBUTES = ("_msprobe_eager", "_msprobe_buffer", "_msprobe_zeros", "_msprobe_tap", "_msprobe_kernel", "_msprobe_on",
                   *(attr for attr, _, _ in _SECTIONS))


class GraphCapture:
    """The taps on the Cells `cells` ([(path, cell)]), their statistics Parameter, and each step's
    rows (`take`). `wanted`: (outputs, inputs, output gradients) to measure; `warn`: says what
    went wrong, once. `remove()` gives every Cell its own class back. A Cell another capture
    taps already (the monitor's and a dump's on one net) keeps that one's taps and is left out."""

    def __init__(self, cells: list[tuple[str, nn.Cell]], wanted: tuple[bool, bool, bool], count_zeros: bool,
                 warn: Callable[[str], None]) -> None:
        self.warn = warn
        wanted_in = dict(zip(("_msprobe_out", "_msprobe_in", "_msprobe_grad"), wanted))
        #: slot -> (kind, path, role of a bare tensor; an item's is role.<i>)
        self.slots: list[tuple[str, str, str]] = []
        self._cells: list[tuple[nn.Cell, type]] = []
        taken = [path for path, cell in cells if "_msprobe_buffer" in cell.__dict__]
        if taken:
            warn(f"Cells tapped by another monitor or dump are left out: {', '.join(taken)}")
        cells = [(path, cell) for path, cell in cells if path not in taken]
        self._reset = Tensor(buffer_rows(len(cells) * _SECTION * sum(wanted)))
        self.buffer = Parameter(self._reset.copy(), name="msprobe_graph_statistics", requires_grad=False)
        #: whether the step about to run is measured (read by the kernel's operator at run time)
        self.on = Parameter(Tensor(True), name="msprobe_graph_monitored", requires_grad=False)
        self._on = True
        # on CPU, where built; registered columns (nan in graphs) keep MindSpore's reductions
        kernel = kernel_op.write_op(count_zeros) if kernel_op.usable(()) and columns.n_columns() == kernel_op.WIDTH \
            else None
        self._kernel = kernel is not None
        self._grad_tap = GradTap(self.buffer, self.on, count_zeros, kernel)
        for path, cell in cells:
            base = type(cell)
            self._cells.append((cell, base))
            cell.__class__ = _tapped_class(base)
            for attr, value in (("_msprobe_eager", False), ("_msprobe_buffer", self.buffer),
                                ("_msprobe_zeros", count_zeros), ("_msprobe_tap", self._grad_tap),
                                ("_msprobe_kernel", kernel), ("_msprobe_on", self.on)):
                object.__setattr__(cell, attr, value)
            for attr, kind, role in _SECTIONS:
                first = len(self.slots) if wanted_in[attr] else -1
                object.__setattr__(cell, attr, first)
                if wanted_in[attr]:
                    self.slots += [(kind, path, role)] + [(kind, path, f"{role}.{i}") for i in range(ROWS_PER_CELL)]
        self._index: np.ndarray | None = None  # the written slots, in the order written (learned once)
        self.keys: list[MetricKey] = []
        #: key -> (dtype, shape) of the tensor each written slot measured (learned with the slots)
        self.meta: dict[MetricKey, tuple[str, list[int]]] = {}

    def monitor(self, on: bool) -> None:
        """Whether the next step's graph measures (a host write only when it changes). Unmeasured,
        the kernel's writes leave the Parameter as it is; MindSpore's reductions still write it
        (`take` resets it)."""
        if on != self._on:
            ops.assign(self.on, Tensor(on))
            self._on = on

    def take(self, wanted: bool = True) -> tuple[list[MetricKey], np.ndarray] | None:
        """This step's rows (`keys`, and the rows read to the host: one transfer, no launch) and the
        Parameter reset; None when not `wanted` (only reset, unless the step was unmeasured and the
        kernel's writes left the Parameter as the last reset did) or nothing was written."""
        if not self.slots:
            return None
        if not wanted or (self._index is None and not self._learn()):
            if not (self._kernel and not wanted and not self._on):  # else nothing was written: no launch
                self._clear()
            return None
        rows = self.buffer.asnumpy()[self._index, :columns.n_columns()]  # no order column
        self._clear()
        return self.keys, rows

    def _clear(self) -> None:
        """The Parameter back to its value at a step's start (one assign)."""
        ops.assign(self.buffer, self._reset)

    def _learn(self) -> bool:
        """Which slots the graph writes (one host read, once), in the order PyNative reports them:
        the Cells' forward rows in the order the graph wrote them (outputs, then inputs), then
        the gradient rows, the Cells in reverse order (a custom bprop's writes carry no order)."""
        rows = self.buffer.asnumpy()
        order = written(rows)
        slots = np.flatnonzero(np.isfinite(order))
        if not slots.size:
            self.warn(STALE_GRAPH)
            return False
        first: dict[str, float] = {}  # a Cell's first forward write
        for i in slots:
            kind, path, _ = self.slots[i]
            if kind == "actv":
                first[path] = min(first.get(path, np.inf), order[i])
        rank = {path: n for n, path in enumerate(sorted(first, key=first.__getitem__))}

        def place(i: int) -> tuple:
            kind, path, _ = self.slots[i]
            at = rank.get(path, len(rank))
            return (1, -at, i) if kind == "actv_grad" else (0, at, i)

        ordered = sorted(slots.tolist(), key=place)
        self.keys = [MetricKey(*self.slots[i]) for i in ordered]
        self.meta = {key: meta_of(rows[i]) for key, i in zip(self.keys, ordered)}
        self._index = np.array(ordered, np.int64)
        return True

    def remove(self) -> None:
        for cell, base in self._cells:
            cell.__class__ = base
            for attr in _TAP_ATTRIBUTES:
                cell.__dict__.pop(attr, None)
        self._cells.clear()

