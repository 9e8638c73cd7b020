"""Gradient, parameter and optimizer-state statistics from inside a compiled MindSpore train step.

In GRAPH_MODE (or a `mindspore.jit` train step) the optimizer Cell is compiled into the train
step's graph, called with the step's gradients. For the monitor's lifetime the optimizer gets its
own subclass (`_tapped_class`, as `graph_capture` does for the watched Cells) whose compiled
`construct` runs the original one and then, in the same graph, measures the gradients, the
parameters and the optimizer state after the step, and the update (on CPU by the C kernel's
custom operators, `kernel_op`: one read of each tensor, two of an update's pair; elsewhere, or for a
dtype the kernel does not read, by `backend.stat_rows`: the rows and semantics of
`backend.partial_stats`) and assigns the rows into a preallocated float64
statistics Parameter, whose last row counts the steps written. There is no second graph launch:
at the step's end the host reads the Parameter (`take`: one transfer) and hands its rows to the
monitor under the names the optimizer hooks use (`grad/<param>`, `param/<param>`,
`optim/<param>/exp_avg`, `optim/<param>/update`). The Parameter is held outside the optimizer's
parameter list (its parameters, names and checkpoints are unchanged).

Called eagerly (PyNative), the subclass's `construct` is the original one and the optimizer hooks
measure as before. An unmonitored step skips the statistics by a flag Parameter (`monitor`, set by
the host before the step; switching costs no recompile): the kernel's operators read it and measure
nothing when it is false (no branch in the graph: one costs MindSpore's CPU backend about 1.6 ms a
step); MindSpore's reductions sit in a branch of the graph on it.
Limits: the parameters' copy for the update is still taken at every step; registered columns
are nan; a step whose optimizer did not run
(a `FiniteGate` that skipped it) or a graph compiled before the monitor was attached writes no
rows: `take` returns None and the monitor measures what it was handed, as without the tap.
"""
from __future__ import annotations

from typing import Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from msprobe_engine.frameworks.mindspore import kernel_op
from msprobe_engine.frameworks.mindspore.backend import Difference, plan_rows, stat_rows, tensor_meta
from msprobe_engine.frameworks.mindspore.graph_capture import tapped
from msprobe_engine.stats import columns
from msprobe_engine.stats.table import MetricKey

#: what a row measures: a gradient (`gradients[i]`), a parameter or a state after the step
#: (`sources[s][i]`), or an update (parameter `i` after minus before); see `OptimizerTap`
GRAD, AFTER, UPDATE = 0, 1, 2


def _tapped_class(base: type) -> type:
    """The subclass of optimizer class `base` whose compiled `construct` writes the rows."""

    class Tapped(base):
        def construct(self, gradients):
            # `super()`, not `base.construct(self, ...)`: compiled that way, the optimizer's own
            # attribute assignments (Adam's `self.beta1_power = ...`) would not update its Parameters
            if self._msprobe_eager:
                return super().construct(gradients)
            params = self._msprobe_sources[0]
            before = ()
            if self._msprobe_update:  # copies of the parameters before the step
                for i in range(len(params)):
                    before = before + (ops.deepcopy(params[i]),)
            out = super().construct(gradients)
            if self._msprobe_kernel:  # its operators read the flag: an unmonitored step reads no tensor
                out = self._msprobe_write(gradients, params, before, out)
            elif self._msprobe_on:  # a graph branch: an unmonitored step skips the statistics
                out = self._msprobe_write(gradients, params, before, out)
            return out

        def _msprobe_write(self, gradients, params, before, out):
            kernel = self._msprobe_kernel
            tensors, afters, befores = (), (), ()  # what is measured as it is; the updates' pairs
            for what, source, i in self._msprobe_items:
                if what == GRAD:
                    tensors = tensors + (gradients[i],)
                elif what == AFTER:
                    tensors = tensors + (ops.depend(self._msprobe_sources[source][i], out),)
                elif kernel:
                    afters, befores = afters + (ops.depend(params[i], out),), befores + (before[i],)
                else:  # stat_rows takes an update as its two tensors, in its plan's order
                    tensors = tensors + (ops.depend(params[i], out), before[i])
            if kernel:  # the C kernel's operators, the rows in `keys` order (the updates last)
                blocks = ()
                on = self._msprobe_on
                if tensors:
                    blocks = blocks + (self._msprobe_rows_op(on, *tensors),)
                if afters:
                    blocks = blocks + (self._msprobe_diff_op(on, *afters, *befores),)
                rows = ops.cat(blocks) if len(blocks) > 1 else blocks[0]
                written = ops.cast(on, ms.float64)  # an unmonitored step's nan rows are not counted
            else:
                plan = self._msprobe_plan
                rows = stat_rows(tensors, plan.layout, plan.differences, plan.empty, plan.gather, self._msprobe_zeros,
                                 plan.pack)
                written = 1.0
            buffer = self._msprobe_buffer
            width = buffer.shape[1]
            if width > rows.shape[1]:  # registered columns: nan (their reducers run outside graphs)
                rows = ops.cat([rows, ops.fill(ms.float64, (rows.shape[0], width - rows.shape[1]), float("nan"))], 1)
            done = ops.assign(buffer, ops.cat([rows, buffer[-1:] + written]))
            return ops.depend(out, done)

    return tapped(Tapped, base)


_TAP_ATTRIBUTES = ("_msprobe_on", "_msprobe_eager", "_msprobe_sources", "_msprobe_update", "_msprobe_items",
                   "_msprobe_plan", "_msprobe_zeros", "_msprobe_buffer", "_msprobe_kernel", "_msprobe_rows_op",
                   "_msprobe_diff_op")


class OptimizerTap:
    """The tap on `optimizer` and its statistics Parameter. `order`: the names in the net of the
    gradients the optimizer is called with (None: not monitored); `params`: the monitored (name,
    Parameter), in that order; `states`: (role, [(name, state Parameter)]) in the same order;
    `grads`, `after`, `update`: whether to measure the gradients, the parameters after the step,
    the update. `remove()` gives the optimizer its own class back."""

    def __init__(self, optimizer: nn.Cell, order: Sequence[str | None], params: Sequence[tuple[str, Parameter]],
                 states: Sequence[tuple[str, Sequence[tuple[str, Parameter]]]], *, grads: bool, after: bool,
                 update: bool, count_zeros: bool) -> None:
        sources = (tuple(p for _, p in params), *(tuple(v for _, v in values) for _, values in states))
        positions = [i for i, name in enumerate(order) if name is not None]  # of params[j]'s gradient
        keys: list[MetricKey] = []
        items: list[tuple[int, int, int]] = []
        stand_ins: list = []  # what stat_rows measures, for its plan (a parameter stands for its gradient)
        if grads:
            keys += [MetricKey("grad", name) for name, _ in params]
            items += [(GRAD, 0, i) for i in positions]
            stand_ins += list(sources[0])
        if after:
            keys += [MetricKey("param", name) for name, _ in params]
            items += [(AFTER, 0, j) for j in range(len(params))]
            stand_ins += list(sources[0])
        for s, (role, values) in enumerate(states, start=1):
            keys += [MetricKey("optim", name, role) for name, _ in values]
            items += [(AFTER, s, j) for j in range(len(values))]
            stand_ins += list(sources[s])
        if update:
            keys += [MetricKey("optim", name, "update") for name, _ in params]
            items += [(UPDATE, 0, j) for j in range(len(params))]
            stand_ins += [Difference(p, p) for p in sources[0]]
        self.keys = keys
        #: (dtype, shape, requires_grad) of what each row measures, for incidents
        self.meta = {key: tensor_meta(item) for key, item in zip(keys, stand_ins)}
        self.optimizer = optimizer if keys else None
        self._written = 0.0
        if not keys:
            return
        measured = [item for item in stand_ins if not isinstance(item, Difference)]
        kernel = kernel_op.usable(measured) and (not update or kernel_op.usable(sources[0], differences=True))
        plan = None if kernel else plan_rows(stand_ins, range(len(stand_ins)), packed=True)
        self.buffer = Parameter(Tensor(np.zeros((len(keys) + 1, columns.n_columns()))),
                                name="msprobe_optimizer_statistics", requires_grad=False)
        self._base = type(optimizer)
        optimizer.__class__ = _tapped_class(self._base)
        #: whether the step about to run is monitored (read by the graph at run time: no recompile)
        self.on = Parameter(Tensor(True), name="msprobe_optimizer_monitored", requires_grad=False)
        self._on = True
        values = (self.on, False, sources, update, tuple(items) if kernel else tuple(items[i] for i in plan.order), plan,
                  count_zeros, self.buffer, kernel, kernel_op.rows_op(count_zeros) if kernel and measured else None,
                  kernel_op.diff_rows_op(count_zeros) if kernel and update else None)
        for attr, value in zip(_TAP_ATTRIBUTES, values):
            object.__setattr__(optimizer, attr, value)

    def monitor(self, on: bool) -> None:
        """Whether the next step's graph measures (a host write only when it changes)."""
        if self.optimizer is not None and on != self._on:
            ops.assign(self.on, Tensor(on))
            self._on = on

    def take(self) -> np.ndarray | None:
        """The rows the graph wrote since the last call (host float64, in `keys` order), read with
        one transfer; None when no step wrote any."""
        if self.optimizer is None:
            return None
        rows = self.buffer.asnumpy()
        written = float(rows[-1, 0])
        if written == self._written:
            return None
        self._written = written
        return rows[:-1]

    def remove(self) -> None:
        if self.optimizer is not None:
            self.optimizer.__class__ = self._base
            for attr in _TAP_ATTRIBUTES:
                self.optimizer.__dict__.pop(attr, None)
            self.optimizer = None
