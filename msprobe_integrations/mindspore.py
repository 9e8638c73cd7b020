"""MindSpore: a Callback for `Model.train`, and a monitor for functional loops.

`Model.train`::

    model.train(epochs, dataset, callbacks=[MonitorCallback(net, optimizer, config="monitor.yaml")],
                dataset_sink_mode=False)

A `mindspore.value_and_grad` loop, two lines::

    monitor = MindSporeMonitor(net, optimizer, config="monitor.yaml")
    for x, y in data:
        loss, grads = grad_fn(x, y)     # grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
        optimizer(grads)
        monitor.step_end(loss, grads)
    monitor.close()

Statistics are computed with MindSpore ops (`msprobe_engine.frameworks.mindspore.backend`);
torch is never imported. In PyNative mode Cell hooks see activations and the
optimizer Cell's hooks see the gradients. In GRAPH_MODE (and inside
`mindspore.jit`) hooks do not run: activations are measured by taps compiled into
the graph (`frameworks.mindspore.graph_capture`); the loss, parameters and
optimizer state are read at step end, and gradients when they are handed over:
`step_end(loss, grads)`, or, under `Model.train`, a train network that returns
them, `Model(nn.TrainOneStepCell(net_with_loss, optimizer, return_grad=True))`.
There a rule's `skip` cannot act from the host; `FiniteGate(optimizer)` skips a
step with non-finite gradients inside the graph.

A rule's `skip` (PyNative) undoes that step's optimizer call: every Parameter of the optimizer
Cell is restored bitwise (`cell_hooks.OptimizerState`); `stop` raises `TrainingStopped` out of
the optimizer call, before the weights change. Under data parallelism (`msrun`,
`mindspore.communication.init()`) statistics are merged over the group
(`frameworks.mindspore.distributed`).
"""
from __future__ import annotations

from typing import Any

from mindspore import nn
from mindspore.experimental import optim
from mindspore.train import Callback, RunContext

from msprobe_engine.frameworks.mindspore import backend as mindspore_backend
from msprobe_engine.frameworks.mindspore.cell_hooks import is_tensor
from msprobe_engine.frameworks.mindspore.distributed import DataParallelMerge, data_parallel_world
from msprobe_engine.frameworks.mindspore.finite_gate import FiniteGate
from msprobe_engine.frameworks.mindspore.wiring import CellWiring
from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.contract import Integration
from msprobe_engine.monitor import Monitor
from msprobe_engine.records import StepRecord

__all__ = ["FiniteGate", "MindSporeMonitor", "MonitorCallback", "split_outputs"]


class MindSporeMonitor(Integration):
    """Monitor a MindSpore Cell and its optimizer; call `step_end(loss, grads)` once per step.
    The monitor's facade (`close`, `flush`, `history`, `state_dict`, ...) is reached through it."""

    def __init__(self, net: nn.Cell, optimizer: Any = None, config: ConfigSource = None, **kwargs: Any) -> None:
        if not isinstance(net, nn.Cell):
            raise TypeError(f"MindSporeMonitor: net must be a mindspore.nn.Cell, got {type(net).__name__}; "
                            "nothing would be monitored")
        if optimizer is not None and not isinstance(optimizer, (nn.Optimizer, optim.Optimizer)):
            raise TypeError("MindSporeMonitor: optimizer must be a mindspore.nn.Optimizer or "
                            f"mindspore.experimental.optim.Optimizer, got {type(optimizer).__name__}; pass None "
                            "to monitor without optimizer state (gradients then come from step_end(loss, grads))")
        rank, world = data_parallel_world()
        if world > 1:
            kwargs.setdefault("rank", rank)
        config = load_config(config)
        if world > 1:  # statistics of the whole data-parallel batch (per_rank: each rank's own data too)
            kwargs.setdefault("reducer", DataParallelMerge(world, per_rank=config.per_rank))
        super().__init__(Monitor(config, backend=mindspore_backend, **kwargs).attach(net, optimizer))
        self.wiring = next(a for a in self.monitor.attachments if isinstance(a, CellWiring))
        self.batch, self.cells, self.optim = self.wiring.batch, self.wiring.cells, self.wiring.optim

    def step_end(self, loss: Any = None, grads: Any = None) -> StepRecord | None:
        """Close the optimizer step. `grads` (a tuple in optimizer-parameter order, or a
        {parameter name: grad} dict) is used only when the optimizer's hooks did not run."""
        if self.monitor.replaying:  # a replayed step (`Monitor.run_step`): its rows go to the replay
            self.wiring.replayed_step_end(loss, grads)
            return None
        self.wiring.grads = grads
        try:
            return self.monitor.step_end(loss)
        finally:
            self.wiring.grads = None


class MonitorCallback(Callback):
    """`Model.train` callback: monitors `net` and `optimizer` every step; closes at train end."""

    def __init__(self, net: nn.Cell, optimizer: Any = None, config: ConfigSource = None, **kwargs: Any) -> None:
        super().__init__()
        self.monitor = MindSporeMonitor(net, optimizer, config, **kwargs)

    def on_train_step_end(self, run_context: RunContext) -> None:
        loss, grads = split_outputs(run_context.original_args().net_outputs)
        self.monitor.step_end(loss, grads)

    def on_train_end(self, run_context: RunContext) -> None:
        self.monitor.close()


def split_outputs(outputs: Any) -> tuple[Any, Any]:
    """(loss, grads) from a train network's outputs: a loss, (loss, {name: grad}) from
    TrainOneStepCell(return_grad=True), or (loss, overflow, scale) with loss scaling."""
    if isinstance(outputs, (tuple, list)) and outputs:
        grads = outputs[1] if len(outputs) > 1 and isinstance(outputs[1], dict) else None
        return outputs[0], grads
    return (outputs if is_tensor(outputs) or isinstance(outputs, (int, float)) else None), None
