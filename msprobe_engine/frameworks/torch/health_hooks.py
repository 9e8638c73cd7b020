"""Model-health signals (``watch.health``): the registry of the PyTorch ones, one registered file
each under `msprobe_engine.frameworks.torch.signals` (docs/model_health.md).

A signal installs its own hooks on a model and its optimizer and adds rows (`MetricKey`) whose
values are tensors derived on the device; the configured statistics (`stats:` mean, max, min,
...) summarise them like any other row, so no host sync is added and micro-batches and ranks
merge as usual. Each is turned on by one key of ``watch.health`` (`Signal.key`); all are off by
default, and with every one off nothing is installed. A new signal is one file::

    from msprobe_engine.frameworks.torch.health_hooks import Signal, register_signal

    @register_signal("grad_sparsity")
    class GradSparsity(Signal):
        key = "grad_sparsity"          # the watch.health field that turns it on
        def __init__(self, monitor, model, optimizer):
            super().__init__(monitor, model, optimizer)
            self.handles.append(...)   # its hooks; each adds rows while `self.measuring()`
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from msprobe_engine.frameworks.torch import compiled_hooks
from msprobe_engine.handles import Handles
from msprobe_engine.registry import Registry

if TYPE_CHECKING:
    from msprobe_engine.config.schema import ModelHealth
    from msprobe_engine.contract import MonitorPort

#: the kind of the signals' rows (`health/<path>/<role>/<stat>`); mg_direction's are `optim` rows
KIND = "health"


class Signal(Handles):
    """One model-health signal of one model and optimizer: its hooks, removed with `remove()`."""

    name: ClassVar[str]
    #: the field of ``watch.health`` that turns it on (any true value)
    key: ClassVar[str]
    #: the other fields of ``watch.health`` it reads (its settings)
    options: ClassVar[tuple[str, ...]] = ()
    #: it needs an optimizer (its hooks run at the optimizer step)
    needs_optimizer: ClassVar[bool] = False

    def __init__(self, monitor: "MonitorPort", model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__()
        self.monitor = monitor
        self.config = monitor.config.watch.health

    @classmethod
    def wanted(cls, health: "ModelHealth", optimizer: Any) -> bool:
        """Whether `health` turns it on (and what it needs is there)."""
        return bool(getattr(health, cls.key)) and (optimizer is not None or not cls.needs_optimizer)

    def measuring(self) -> bool:
        """A monitored step, not a replay: the hooks add rows."""
        return self.monitor.active and not self.monitor.replaying


SIGNALS: Registry[type[Signal]] = Registry("signal", "msprobe_engine.frameworks.torch.signals")
register_signal = SIGNALS.register


def trainable_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(path as in the uncompiled model, parameter) of every parameter that requires a gradient."""
    return [(compiled_hooks.clean_path(n), p) for n, p in model.named_parameters() if p.requires_grad]


def attach_health(monitor: "MonitorPort", model: torch.nn.Module, optimizer: Any) -> list[Signal]:
    """The signals `monitor.config.watch.health` turns on, installed (none: an empty list)."""
    health = monitor.config.watch.health
    return [cls(monitor, model, optimizer) for _, cls in SIGNALS if cls.wanted(health, optimizer)]
