"""``micro_batch_grads``: the gradient each backward pass adds, all parameters together, per
micro-batch ``k`` (1, 2, ... within the step, counted by the model's forward calls with
autograd on), ``health/grad_micro_batch/<k>/norm`` (its norm; the other statistics too)."""
from __future__ import annotations

from typing import Any

import torch

from msprobe_engine.frameworks.torch.health_hooks import KIND, Signal, register_signal, trainable_params
from msprobe_engine.frameworks.torch.module_hooks import in_backward
from msprobe_engine.stats.table import MetricKey

MICRO_BATCH_PATH = "grad_micro_batch"


@register_signal("micro_batch_grads")
class MicroBatchGrads(Signal):
    """A forward pre-hook on the model (counts micro-batches) and a hook on each parameter's gradient."""

    key = "micro_batch_grads"

    def __init__(self, monitor: Any, model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__(monitor, model, optimizer)
        self._micro_step = (-1, 0)  # (step, micro-batches seen in it)
        self.handles.append(model.register_forward_pre_hook(self._forward_begins))
        self.handles += [p.register_hook(self._grad) for _, p in trainable_params(model)]

    def _forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not in_backward():
            step, seen = self._micro_step
            self._micro_step = (self.monitor.step, (seen if step == self.monitor.step else 0) + 1)

    def _grad(self, grad: torch.Tensor) -> None:
        if self.measuring():
            with self.monitor.guard("micro-batch gradient hook"):
                self.monitor.add_tensors([MetricKey(KIND, MICRO_BATCH_PATH, str(max(self._micro_step[1], 1)))],
                                         [grad.detach()])
