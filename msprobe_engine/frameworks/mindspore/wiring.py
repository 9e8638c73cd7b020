"""What monitors a MindSpore net: the step's tensor batch, the Cell hooks (PyNative mode), the
taps compiled into a graph (GRAPH_MODE, `mindspore.jit`: `graph_capture`), the optimizer's hooks
and state reads, and the work at each step's end (`MindSporeFramework.attach`,
`msprobe_integrations.mindspore.MindSporeMonitor`).

The tensors of a step are measured together, with one backend call, at the step's end: the
wiring is the monitor's step closer (`contract.StepCloser`). Where the forward ran compiled
(no Cell hook fired), the rows the graph wrote are taken then (or at the optimizer's pre-hook
when only the optimizer ran eagerly); where the optimizer step ran compiled (no optimizer hook
ran), its gradients (given as `grads`) and state are read at the step's end.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator

from mindspore import nn

from msprobe_engine.frameworks.mindspore.backend import host_partial_stats
from msprobe_engine.frameworks.mindspore.cell_hooks import (CellHooks, OptimizerState, TensorBatch, compiled,
                                                             is_tensor, watched_cells)
from msprobe_engine.frameworks.mindspore.graph_capture import GraphCapture
from msprobe_engine.frameworks.mindspore.graph_optimizer import OptimizerTap
from msprobe_engine.frameworks.mindspore.replay import MindSporeReplayHost
from msprobe_engine.handles import Handles
from msprobe_engine.stats import optional_columns
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.contract import MonitorPort

GRAPH_MODE_WARNING = (
    "GRAPH_MODE: Cell outputs and their gradients are measured inside the compiled graph (one row per Cell, "
    "its calls merged), and so are the optimizer's gradients, parameters and state; a rule's skip acts only "
    "through msprobe_integrations.mindspore.FiniteGate (docs/mindspore.md, GRAPH_MODE and mindspore.jit)")


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
        self.net = net
        self.watched = watched_cells(monitor, net)
        cells = self.watched
        self.cells = CellHooks(monitor, net, cells, self.batch) if pynative else None
        count_zeros = "zero_count" in optional_columns(monitor.config.stats)
        watch = monitor.config.watch
        wanted = (watch.module_outputs, watch.module_inputs, watch.activation_grads)
        self.graph = GraphCapture(cells, wanted, count_zeros, monitor.warn) if cells else None
        self.optim = OptimizerState(monitor, net, optimizer, self.batch, hooks=pynative)
        self.optim.before_grads = self._compiled_forward
        optim = self.optim
        self.count_zeros = count_zeros
        self.optim_tap = OptimizerTap(optimizer, optim.order, optim.params, optim.states, grads=watch.param_grads,
                                      after=optim.read_params, update=optim.update, count_zeros=count_zeros
                                      ) if optimizer is not None else None
        super().__init__([part for part in (self.cells, self.graph, self.optim, self.optim_tap) if part is not None])
        self.grads: Any = None
        self._ran_compiled = False
        self._forward_taken = False
        self._snapshot()  # for a first step whose optimizer runs where no hook does
        self._set_taps(monitor.active)
        monitor.add_step_closer(self)

    def close_step(self, loss: Any) -> Any:
        """Before the step's end: read a compiled optimizer step, measure the step's batch (with a
        tensor loss: one backend call per step); returns the loss still to report."""
        monitor = self.monitor
        self._ran_compiled = not self.optim.stepped
        if self._ran_compiled:
            self._read_compiled_step(self.grads)
        if monitor.active and is_tensor(loss):
            if self._ran_compiled:  # read to the host with the step's rows: no launch
                monitor.rows.add(monitor.step, [MetricKey("train", "loss")],
                                 host_partial_stats([loss.asnumpy()], self.count_zeros), remember=False,
                                 seconds=0.0, measured=1)
            else:  # measured with the rest: one backend call per step
                self.batch.add([MetricKey("train", "loss")], [loss])
            loss = None
        self.batch.flush()
        return loss

    def step_closed(self) -> None:
        """After the step's end: the next step begins."""
        host = self._replay_host()
        if host is not None:
            host.compiled, host.step_call = self._ran_compiled, False
        self.optim.stepped = False
        self._forward_taken = False
        if self.cells is not None:
            self.cells.fired = False
        if self._ran_compiled:
            self._snapshot()
        self._set_taps(self.monitor.active)

    def _set_taps(self, active: bool) -> None:
        """Whether the compiled taps measure the next step."""
        for tap in (self.graph, self.optim_tap):
            if tap is not None:
                tap.monitor(active)

    def _snapshot(self) -> None:
        """The parameters' copy for the update of a step whose optimizer runs where no hook does,
        unless the optimizer's tap measures it inside the graph."""
        if self.optim_tap is None or self.optim_tap.optimizer is None or not self.optim.update:
            self.optim.snapshot()

    def _read_compiled_step(self, grads: Any) -> None:
        """The optimizer step ran where no hook runs: take the rows its tap wrote in the graph, or
        read its gradients and state now."""
        monitor = self.monitor
        self._compiled_forward()
        tapped = monitor.active and self._take_optimizer_rows()
        if monitor.active and not tapped and grads is None and monitor.config.watch.param_grads:
            monitor.warn("parameter gradients are not monitored: no optimizer hook saw them (compiled "
                         "step, or no optimizer given); pass them as step_end(loss, grads)")
        self.optim.before_step(None if tapped else grads)
        self.optim.after_step(read=not tapped)

    def _take_optimizer_rows(self) -> bool:
        """The rows the optimizer's tap wrote in this step's graph, to the monitor (one host read);
        False when none were written."""
        monitor, tap = self.monitor, self.optim_tap
        if tap is None:
            return False
        started = time.perf_counter()
        with monitor.guard("optimizer statistics"):
            rows = tap.take()
            if rows is not None:
                monitor.rows.add(monitor.step, tap.keys, rows, remember=False,
                                 seconds=time.perf_counter() - started, measured=len(tap.keys))
                if monitor.graph is not None:  # incidents are on
                    monitor.tensor_meta.update(tap.meta)
                return True
        return False

    def _compiled_forward(self) -> None:
        """Once a step, where no Cell hook fired (the forward ran compiled): begin the micro-step and
        take the rows the graph wrote."""
        self._replay_host()
        if self._forward_taken or (self.cells is not None and self.cells.fired):
            return
        self._forward_taken = True
        self.monitor.micro_step_begin()
        if self.graph is not None:
            monitor = self.monitor
            with monitor.guard("graph statistics"):
                taken = self.graph.take(monitor.active)
                if taken is not None:
                    keys, rows = taken
                    monitor.rows.add(monitor.step, keys, rows, remember=False, seconds=0.0, measured=len(keys))

    # ---- replays (`replay.MindSporeReplayHost`) -------------------------------------------------
    def _replay_host(self) -> MindSporeReplayHost | None:
        """The monitor's MindSpore replay host (None: none), which then knows this wiring."""
        host = self.monitor.replay_host
        if not isinstance(host, MindSporeReplayHost):
            return None
        if self not in host.wirings:
            host.wirings.append(self)
        return host

    @contextlib.contextmanager
    def replay_hooks(self) -> Iterator[None]:
        """While a step is replayed (eagerly): Cell hooks on the watched Cells when the net was
        attached compiled (PyNative has its own), the optimizer's step state of the real step
        set aside; at the end what was collected is measured, into the replay's rows."""
        hooks = None
        if self.cells is None and self.watched:
            hooks = CellHooks(self.monitor, self.net, self.watched, self.batch, graph=self.monitor.graph)
        try:
            with self.optim.set_aside():
                yield
        finally:
            if hooks is not None:
                hooks.remove()
            self.batch.flush()

    def replayed_step_end(self, loss: Any, grads: Any) -> None:
        """The end of a replayed step (where the monitor's step end does nothing): its loss and,
        where no optimizer hook ran (compiled wiring), its gradients, parameters and state."""
        if not self.optim.stepped:
            with self.monitor.guard("replayed step end"):
                self.optim.measure_grads(grads)
                self.optim.read_after_step()
        if is_tensor(loss):
            self.batch.add([MetricKey("train", "loss")], [loss])
