"""The toy framework as the core sees it: a `contract.Framework` named "toy"."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from msprobe_engine.contract import MonitorPort
from msprobe_engine.stats.table import MetricKey
from tests.plugins.toy_framework import backend
from tests.plugins.toy_framework.model import SGD, Model, Tensor


class ToyHooks:
    """The monitor's hooks on one model and its optimizer."""

    def __init__(self, monitor: MonitorPort, model: Model, optimizer: SGD | None) -> None:
        self.monitor, self.model, self.optimizer = monitor, model, optimizer
        model.pre_hooks.append(monitor.micro_step_begin)
        model.forward_hooks.append(self.forward)
        if optimizer is not None:
            optimizer.pre_hooks.append(self.pre_step)
            optimizer.post_hooks.append(self.post_step)

    def forward(self, name: str, output: Tensor) -> None:
        if self.monitor.active:
            with self.monitor.guard("toy forward hook"):
                self.monitor.add_tensors([MetricKey("actv", name, "output")], [output])

    def pre_step(self, grads: dict[str, Tensor]) -> bool:
        monitor = self.monitor
        if monitor.active:
            with monitor.guard("toy pre-step"):
                monitor.add_tensors([MetricKey("grad", f"{n}.weight") for n in grads], list(grads.values()))
        return monitor.before_optimizer_step().skip

    def post_step(self) -> None:
        monitor = self.monitor
        if monitor.active and monitor.config.watch.params:
            with monitor.guard("toy post-step"):
                weights = self.model.weights
                monitor.add_tensors([MetricKey("param", f"{n}.weight") for n in weights], list(weights.values()))
        monitor.after_optimizer_step()

    def remove(self) -> None:
        self.model.pre_hooks.remove(self.monitor.micro_step_begin)
        self.model.forward_hooks.remove(self.forward)
        if self.optimizer is not None:
            self.optimizer.pre_hooks.remove(self.pre_step)
            self.optimizer.post_hooks.remove(self.post_step)


class ToyFramework:
    name = "toy"
    dump_format = "mindspore"
    backend = backend

    def attach(self, monitor: MonitorPort, model: Any, optimizer: Any) -> list[ToyHooks]:
        return [ToyHooks(monitor, model, optimizer)]

    def replay_host(self) -> None:
        return None

    def dump_session(self) -> type:
        raise TypeError("the toy framework has no tensor dump")

    def load_tensor_file(self, file: Path, mapped: bool = False) -> Any:
        return np.load(file, mmap_mode="r" if mapped else None, allow_pickle=False)

    def numpy_copier(self, buffer: np.ndarray) -> Callable[[int, Any], None]:
        def copy(i: int, tensor: Tensor) -> None:
            np.copyto(buffer[i, :tensor.data.size], tensor.data.ravel(), casting="unsafe")
        return copy

    def precheck(self) -> None:
        return None


FRAMEWORK = ToyFramework()
