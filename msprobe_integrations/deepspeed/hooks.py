"""`engine.backward` and `engine.step` wrapped on the engine instance (not on the class).

    engine.backward(loss)  the loss is kept (every micro-step; the record shows their mean)
    engine.step()          at the accumulation boundary, before DeepSpeed's step: the losses
                           and parameter gradients (divided by the fp16 loss scale), then
                           `monitor.before_optimizer_step()`; after it: whether DeepSpeed
                           applied the step, parameters and optimizer state, `step_end`.

A step DeepSpeed skips (fp16 overflow) is recorded as `train/skipped` = 1 with its
gradients dropped: they were thrown away, not applied, and are no model anomaly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from msprobe_engine.collect.torch_optim import STATE_NAMES
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.deepspeed.shards import ShardReader

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

SKIPPED = MetricKey("train", "skipped")


class EngineHooks:
    """Reads one DeepSpeed engine's gradients, parameters and optimizer state per optimizer step."""

    def __init__(self, monitor: "Monitor", engine: Any, reader: ShardReader | None) -> None:
        self.monitor = monitor
        self.engine = engine
        self.reader = reader
        watch = monitor.config.watch
        names = reader.names if reader is not None else []
        # With managed_gradient_accumulation=false every step() is a boundary and DeepSpeed
        # reduces the gradients inside it, so they are not final before it.
        self.managed = engine.managed_gradient_accumulation()
        self.grad_keys = [MetricKey("grad", n) for n in names] if watch.param_grads and self.managed else []
        if watch.param_grads and names and not self.managed:
            monitor.warn("DeepSpeed managed_gradient_accumulation=false: gradients are reduced inside "
                         "engine.step(), so parameter gradients are not monitored")
        self.update = any(s in ("update", "ratio") for s in watch.optimizer_state)
        self.param_keys = [MetricKey("param", n) for n in names] if watch.params or self.update else []
        self.states = [s for s in watch.optimizer_state if s in ("exp_avg", "exp_avg_sq")]
        if any(rule.action == "skip" for rule in monitor.config.alerts):
            monitor.warn("alert action 'skip' is not applied under DeepSpeed yet: the alert is reported "
                         "and DeepSpeed's optimizer step runs")
        self._before: list[torch.Tensor] | None = None
        self._losses: list[torch.Tensor] = []
        self._backward, self._step = engine.backward, engine.step
        engine.backward, engine.step = self.backward, self.step

    def remove(self) -> None:
        """Give the engine its own methods back."""
        for name in ("backward", "step"):
            if self.engine.__dict__.get(name) == getattr(self, name):
                del self.engine.__dict__[name]

    # ---- the wrappers ---------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.monitor.active:
            with self.monitor.guard("DeepSpeed loss"):
                self._losses.append(loss.detach())
        return self._backward(loss, *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        boundary = not self.managed or self.engine.is_gradient_accumulation_boundary()
        if boundary:
            self._before_step()
        result = self._step(*args, **kwargs)
        if boundary:
            self._after_step()
        return result

    # ---- one optimizer step -----------------------------------------------------------
    def _before_step(self) -> None:
        monitor, reader = self.monitor, self.reader
        losses, self._losses = self._losses, []
        if monitor.active and losses:  # the step's micro-batch losses, measured at once
            with monitor.guard("DeepSpeed loss"):
                monitor.report_loss(torch.stack(losses))
        if monitor.active and reader is not None:
            if self.grad_keys:
                self._add(self.grad_keys, reader.grads, "DeepSpeed gradients", divisor=self._loss_scale())
            if self.update:
                with monitor.guard("DeepSpeed parameters before the step"), torch.no_grad():
                    self._before = [t.clone() for t in reader.masters()]
        # The rules whose action needs a decision fire here, before DeepSpeed updates the weights.
        monitor.before_optimizer_step()

    def _after_step(self) -> None:
        monitor = self.monitor
        if monitor.active:
            applied = self.engine.was_step_applied()
            monitor.add_tensors([SKIPPED], [monitor.backend.scalar(0.0 if applied else 1.0)])
            if not applied:
                monitor.discard("grad")
            elif self.reader is not None:
                self._read_after_step(self.reader)
        self._before = None
        monitor.after_optimizer_step()
        monitor.step_end()

    def _read_after_step(self, reader: ShardReader) -> None:
        if self.param_keys:
            self._add(self.param_keys, reader.masters, "DeepSpeed parameters")
        if self.states:
            present = {STATE_NAMES[k]: k for k in reader.state_keys() if STATE_NAMES.get(k) in self.states}
            if not present:
                self.monitor.warn(f"optimizer {type(self.engine.optimizer).__name__} keeps none of "
                                  f"{', '.join(self.states)}: optimizer state is not monitored")
            for ours, theirs in sorted(present.items()):
                self._add([MetricKey("optim", n, ours) for n in reader.names],
                          lambda: reader.state(theirs), f"DeepSpeed optimizer state {theirs}")
        if self._before is not None:
            before = self._before
            with torch.no_grad():
                self._add([MetricKey("optim", n, "update") for n in reader.names],
                          lambda: [a - b for a, b in zip(reader.masters(), before)], "DeepSpeed update")

    def _add(self, keys: Sequence[MetricKey], read: Callable[[], list[torch.Tensor]], where: str,
             divisor: float = 1.0) -> None:
        """Measure what `read` returns; on an error, empty rows keep the key layout equal on all ranks."""
        added = False
        with self.monitor.guard(where):
            self.monitor.add_tensors(keys, read(), divisor=divisor)
            added = True
        if not added:
            self.monitor.add_tensors(keys, [self.reader.empty] * len(keys))

    def _loss_scale(self) -> float:
        """The factor `engine.backward` multiplied the loss by. DeepSpeed 0.19.8 applies the fp16
        loss scale there for ZeRO optimizers only: the ZeRO-0 fp16 wrapper's gradients arrive
        unscaled (and its step divides them by the scale once more)."""
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        optimizer = self.engine.optimizer
        if not (self.engine.fp16_enabled() and isinstance(optimizer, ZeROOptimizer)):
            return 1.0
        return float(optimizer.loss_scale)
