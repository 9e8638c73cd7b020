"""``mg_direction``: before the optimizer step, per parameter, the predecessor's ``mg_direction``
``(sum(sign(grad) * sign(exp_avg)) / numel + 1) / 2`` (exp_avg: Adam's first moment from the
previous step, SGD's momentum buffer): the share of elements whose gradient agrees in sign with
the momentum, zeros counting half; one number per parameter, so every statistic of
``optim/<param>/mg_direction/<stat>`` is it; nothing at the first step (no moment yet)."""
from __future__ import annotations

from typing import Any

import torch

from msprobe_engine.frameworks.torch.health_hooks import Signal, register_signal, trainable_params
from msprobe_engine.frameworks.torch.optimizer_hooks import STATE_NAMES
from msprobe_engine.stats.table import MetricKey


@register_signal("mg_direction")
class MgDirection(Signal):
    """An optimizer step pre-hook reading each parameter's gradient and first moment."""

    key = "mg_direction"
    needs_optimizer = True

    def __init__(self, monitor: Any, model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__(monitor, model, optimizer)
        self.params = trainable_params(model)
        self.handles.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.measuring():
            return
        with self.monitor.guard("mg_direction pre-step hook"), torch.no_grad():
            keys: list[MetricKey] = []
            tensors: list[torch.Tensor] = []
            for name, p in self.params:
                moment = _moment(optimizer.state.get(p, {}))
                if p.grad is not None and moment is not None:
                    keys.append(MetricKey("optim", name, "mg_direction"))
                    agree = (p.grad.sign() * moment.sign()).sum(dtype=torch.float32) / max(moment.numel(), 1)
                    tensors.append(agree.add_(1).mul_(0.5))
            if keys:
                self.monitor.add_tensors(keys, tensors)


def _moment(state: dict) -> torch.Tensor | None:
    """The optimizer's first moment of a parameter (Adam's exp_avg, SGD's momentum buffer)."""
    for key, ours in STATE_NAMES.items():
        value = state.get(key)
        if ours == "exp_avg" and isinstance(value, torch.Tensor):
            return value
    return None
