"""Plain PyTorch: one line after the model and optimizer exist.

    monitor = TorchMonitor(model, optimizer, config="configs/minimal.yaml")
    for batch in data:
        loss = train_step(batch)      # forward, backward, optimizer.step()
        monitor.step_end(loss)

`loss = monitor.run_step(train_step, batch)` instead makes an anomalous step
replayable (docs/incidents.md). A `skip` rule makes `optimizer.step()` a no-op
for that step; a `stop` rule raises `TrainingStopped` out of it.

Micro-steps are counted on the root module's forward; gradients are read
in the optimizer's pre-step hook (the accumulation boundary).
"""
from __future__ import annotations

from typing import Any

from msprobe_engine.config import ConfigSource
from msprobe_engine.contract import Integration
from msprobe_engine.monitor import Monitor


class TorchMonitor(Integration):
    """A `Monitor` attached to a torch model and torch.optim optimizer; the monitor's facade
    (`step_end`, `run_step`, `report_loss`, `history`, `state_dict`, ...) is reached through it."""

    def __init__(self, model: Any, optimizer: Any = None, config: ConfigSource = None, **kwargs: Any) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchMonitor: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("TorchMonitor: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}; pass None to monitor the model only")
        super().__init__(Monitor(config, **kwargs).attach(model, optimizer))
