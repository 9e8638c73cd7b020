"""What monitors a MindSpore net: the step's tensor batch, the Cell hooks (PyNative mode) and the
optimizer's hooks and state reads, and the work at each step's end (`MindSporeFramework.attach`,
`msprobe_integrations.mindspore.MindSporeMonitor`).

The tensors of a step are measured together, with one backend call, at the step's end: the
wiring is the monitor's step closer (`contract.StepCloser`). Where the optimizer step ran
compiled (no optimizer hook ran), its gradients (given as `grads`) and state are read then.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mindspore import nn

from msprobe_engine.frameworks.mindspore.cell_hooks import CellHooks, OptimizerState, TensorBatch, compiled, is_tensor
from msprobe_engine.handles import Handles
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.contract import MonitorPort

GRAPH_MODE_WARNING = (
    "GRAPH_MODE: Cell hooks do not run in a compiled graph, so activations and activation gradients "
    "are NOT monitored; loss, parameters and optimizer state are read at step end, and parameter "
    "gradients when they are handed over (step_end(loss, grads), or a train network built with "
    "nn.TrainOneStepCell(..., return_grad=True)). Use PYNATIVE_MODE to monitor activations.")


class CellWiring(Handles):
    """The hooks on `net` and `optimizer` for `monitor` (removed by `remove()`); registers itself
    as the monitor's step closer. `grads`: the step's gradients handed over for its end (a tuple
    in optimizer-parameter order, or a {parameter name: grad} dict), used only when the
    optimizer's hooks did not run."""

    def __init__(self, monitor: "MonitorPort", net: nn.Cell, optimizer: Any = None) -> None:
        self.monitor = monitor
        self.batch = TensorBatch(monitor)
        pynative = not compiled()
        if not pynative:
            monitor.warn(GRAPH_MODE_WARNING)
        self.cells = CellHooks(monitor, net, self.batch) if pynative else None
        self.optim = OptimizerState(monitor, net, optimizer, self.batch, hooks=pynative)
        super().__init__([*([self.cells] if self.cells is not None else []), self.optim])
        self.grads: Any = None
        self._ran_compiled = False
        self.optim.snapshot()  # for a first step whose optimizer runs where no hook does
        monitor.add_step_closer(self)

    def close_step(self, loss: Any) -> Any:
        """Before the step's end: read a compiled optimizer step, measure the step's batch (with a
        tensor loss: one backend call per step); returns the loss still to report."""
        monitor = self.monitor
        self._ran_compiled = not self.optim.stepped
        if self._ran_compiled:
            self._read_compiled_step(self.grads)
        if monitor.active and self.cells is not None and self.cells.paths and not self.cells.fired:
            monitor.warn("no Cell hook ran in a monitored step: the net ran compiled (mindspore.jit); "
                         "activations are not monitored")
        if monitor.active and is_tensor(loss):  # measured with the rest: one backend call per step
            self.batch.add([MetricKey("train", "loss")], [loss])
            loss = None
        self.batch.flush()
        return loss

    def step_closed(self) -> None:
        """After the step's end: the next step begins."""
        self.optim.stepped = False
        if self.cells is not None:
            self.cells.fired = False
        if self._ran_compiled:
            self.optim.snapshot()

    def _read_compiled_step(self, grads: Any) -> None:
        """The optimizer step ran where no hook runs: read its gradients and state now."""
        monitor = self.monitor
        if self.cells is None or not self.cells.fired:
            monitor.micro_step_begin()
        if monitor.active and grads is None and monitor.config.watch.param_grads:
            monitor.warn("parameter gradients are not monitored: no optimizer hook saw them (compiled "
                         "step, or no optimizer given); pass them as step_end(loss, grads)")
        self.optim.before_step(grads)
        self.optim.after_step()
