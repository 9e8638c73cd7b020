"""The PyTorch framework as the core sees it (`registry.load_framework("torch")`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from msprobe_engine.frameworks.torch import backend, cpu_reduce, tensor_files
from msprobe_engine.frameworks.torch.health_hooks import attach_health
from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
from msprobe_engine.frameworks.torch.optimizer_hooks import OptimizerHooks
from msprobe_engine.frameworks.torch.replay import TorchReplayHost
from msprobe_engine.frameworks.torch.router_hooks import attach_routers

if TYPE_CHECKING:
    from msprobe_engine.contract import MonitorPort


class TorchFramework:
    """torch.nn.Module models and torch.optim optimizers."""

    name = "torch"
    #: the `framework` field of its dumps (the predecessor's name)
    dump_format = "pytorch"
    backend = backend

    def attach(self, monitor: "MonitorPort", model: Any, optimizer: Any) -> list[Any]:
        """Module hooks on `model`, pre/post-step hooks on `optimizer`; the CPU kernel built (or loaded)
        now for a model with CPU parameters, not in the first monitored step."""
        if any(p.is_cpu for p in model.parameters()):
            cpu_reduce.prepare()
        return [ModuleHooks(monitor, model), OptimizerHooks(monitor, model, optimizer), *attach_routers(monitor, model),
                *attach_health(monitor, model, optimizer)]

    def replay_host(self) -> TorchReplayHost:
        return TorchReplayHost()

    def load_tensor_file(self, file: Path, mapped: bool = False) -> Any:
        """A ``.pt`` tensor file of a dump (`tensor_files.load_tensor_file`)."""
        return tensor_files.load_tensor_file(file, mapped)

    def numpy_copier(self, buffer: np.ndarray) -> Callable[[int, Any], None]:
        return tensor_files.numpy_copier(buffer)

    def precheck(self) -> Any:
        """The API pre-check's torch side (`msprobe_engine.frameworks.torch.precheck.api`)."""
        from msprobe_engine.frameworks.torch.precheck import api
        return api

    def dump_session(self) -> type:
        from msprobe_engine.frameworks.torch.capture.session import PrecisionDebugger
        return PrecisionDebugger


FRAMEWORK = TorchFramework()
