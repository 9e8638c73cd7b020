"""The PyTorch framework as the core sees it (`registry.load_framework("torch")`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msprobe_engine.frameworks.torch import backend
from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
from msprobe_engine.frameworks.torch.optimizer_hooks import OptimizerHooks
from msprobe_engine.frameworks.torch.replay import TorchReplayHost

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


class TorchFramework:
    """torch.nn.Module models and torch.optim optimizers."""

    name = "torch"
    backend = backend

    def attach(self, monitor: "Monitor", model: Any, optimizer: Any) -> list[Any]:
        """Module hooks on `model`, pre/post-step hooks on `optimizer`."""
        return [ModuleHooks(monitor, model), OptimizerHooks(monitor, model, optimizer)]

    def replay_host(self) -> TorchReplayHost:
        return TorchReplayHost()

    def precheck(self) -> Any:
        """The API pre-check's torch side (`msprobe_engine.frameworks.torch.precheck.api`)."""
        from msprobe_engine.frameworks.torch.precheck import api
        return api

    def dump_session(self) -> type:
        from msprobe_engine.frameworks.torch.capture.session import PrecisionDebugger
        return PrecisionDebugger


FRAMEWORK = TorchFramework()
