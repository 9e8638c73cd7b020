"""`engine.backward` and `engine.step` wrapped on the engine instance (not on the class).

    engine.backward(loss)  the loss is kept (every micro-step; the record shows their mean)
    engine.step()          at the accumulation boundary, before DeepSpeed's step: the losses
                           and parameter gradients (divided by the fp16 loss scale), then
                           `monitor.before_optimizer_step()`; after it: whether the step was
                           applied, parameters and optimizer state, DeepSpeed's own global
                           grad norm (`report_grad_norm`), `step_end`.

A `PipelineEngine` runs its schedule inside `train_batch`: its optimizer step
`_take_model_step` is wrapped in place of `engine.step` (the same before/after), `backward` is not,
and the losses are the last stage's micro-batch losses the engine keeps (`pipeline.last_stage_losses`).

The monitor's decision is applied here. `skip`: DeepSpeed's step runs with the wrapped torch
optimizer's `step` and the lr scheduler's `step` made no-ops for that one call (instance
attributes, removed right after), so every ZeRO stage copies its unchanged fp32 masters back
to the model and clears the gradients as usual; nothing else is replaced. `stop`:
`TrainingStopped` propagates out of `engine.step()` before DeepSpeed's step, with the step's
record and incident on disk. The decision is made on statistics merged over the
data-parallel ranks, so all ranks take the same one; with `per_rank: true` (whose loss and
activation rows are each rank's own) one extra all-reduce of two flags makes them agree
(`RankMerge.agree`, called by `monitor.before_optimizer_step`).

With fp16, a step DeepSpeed skips (loss-scale overflow) is recorded as `train/skipped` = 1
with its gradients dropped: they were thrown away, not applied, and are no model anomaly.
DeepSpeed skips exactly the steps whose gradients hold an inf or nan, which the merged
gradient statistics show before the step: such a step's gradient rows are screened out
before the rules see them (`before_optimizer_step(screen=...)`), so no skip/stop rule fires
on a routine overflow.
"""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from msprobe_engine.frameworks.torch.optimizer_hooks import STATE_NAMES
from msprobe_engine.health import LOSS_SCALE
from msprobe_engine.incident.actions import TrainingStopped
from msprobe_engine.stats.table import MetricKey, StatTable
from msprobe_engine.steps.overflow import SCALED_KINDS, overflowed, without_scaled
from msprobe_integrations.deepspeed.pipeline import last_stage_losses
from msprobe_integrations.deepspeed.shards import ShardReader

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

SKIPPED = MetricKey("train", "skipped")


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def norm_not_comparable(engine: Any) -> str | None:
    """Why `engine.get_global_grad_norm()` is not the norm of the gradients the monitor merges
    (None: it is). With model parallelism (`engine.mpu`) it covers the model-parallel ranks, the
    merge the data-parallel group only; a PipelineEngine's `mpu` is its grid, and both cover every
    stage. DeepSpeed 0.19.8's ZeRO-0 fp16/bf16 wrapper (`FP16_UnfusedOptimizer`) leaves the MoE
    experts' gradients out of it (its `_global_grad_norm` is the non-expert groups' norm), whatever
    the expert-parallel size; ZeRO-1/2 and `BF16_Optimizer` include them."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if engine.mpu is not None and not isinstance(engine, PipelineEngine):
        return "DeepSpeed's grad norm covers the model-parallel ranks, the monitor's only this rank's part"
    if isinstance(engine.optimizer, FP16_UnfusedOptimizer) and any(map(is_moe_param, engine.module.parameters())):
        return "DeepSpeed's ZeRO-0 fp16/bf16 grad norm leaves out the MoE experts' gradients"
    return None


class EngineHooks:
    """Reads one DeepSpeed engine's gradients, parameters and optimizer state per optimizer step."""

    def __init__(self, monitor: "Monitor", engine: Any, reader: ShardReader | None) -> None:
        from deepspeed.runtime.pipe.engine import PipelineEngine

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
        self.fp16 = engine.fp16_enabled()
        self._other_norm = norm_not_comparable(engine)
        self._overflow = False
        self._before: list[torch.Tensor] | None = None
        self._losses: list[torch.Tensor] = []
        # a PipelineEngine runs its schedule inside train_batch, where `_take_model_step` is the
        # optimizer step and the last stage's losses are kept (`pipeline.last_stage_losses`)
        self.pipeline = isinstance(engine, PipelineEngine)
        step = "_take_model_step" if self.pipeline else "step"
        self._backward, self._step = engine.backward, getattr(engine, step)
        #: the engine's methods replaced on the instance, by name
        self._wrapped = {step: self.step} if self.pipeline else {"backward": self.backward, step: self.step}
        for name, wrapper in self._wrapped.items():
            setattr(engine, name, wrapper)

    def remove(self) -> None:
        """Give the engine its own methods back."""
        for name, wrapper in self._wrapped.items():
            if self.engine.__dict__.get(name) == wrapper:
                del self.engine.__dict__[name]

    # ---- the wrappers ---------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.monitor.active:
            with self.monitor.guard("DeepSpeed loss"):
                self._losses.append(loss.detach())
        return self._backward(loss, *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        boundary = not self.managed or self.engine.is_gradient_accumulation_boundary()
        skip = boundary and self._before_step()  # TrainingStopped propagates from here
        if skip:
            with self._no_update():
                result = self._step(*args, **kwargs)
        else:
            result = self._step(*args, **kwargs)
        if boundary:
            self._after_step(skip)
        return result

    # ---- one optimizer step -----------------------------------------------------------
    def _before_step(self) -> bool:
        """Measure what is final before the step, then decide: True to skip the step."""
        monitor, reader = self.monitor, self.reader
        losses, self._losses = self._losses, []
        if self.pipeline:
            losses = last_stage_losses(self.engine)
        self._overflow = False
        if monitor.active and losses:  # the step's micro-batch losses, measured at once
            with monitor.guard("DeepSpeed loss"):
                monitor.report_loss(torch.stack(losses))
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.fp16 else None
        if monitor.active and isinstance(scale, (int, float)):  # the step's fp16 loss scale (Health/loss_scale)
            monitor.add_tensors([LOSS_SCALE], [monitor.backend.scalar(float(scale))])
        if monitor.active and reader is not None:
            if self.grad_keys:
                self._add(self.grad_keys, reader.grads, "DeepSpeed gradients", divisor=self._loss_scale())
            if self.update:
                with monitor.guard("DeepSpeed parameters before the step"), torch.no_grad():
                    self._before = [t.clone() for t in reader.masters()]
        # The rules whose action needs a decision fire here, before DeepSpeed updates the weights
        # (with per_rank, made the same on every rank by the reducer: RankMerge.agree).
        skip, stopped = False, None
        try:
            skip = monitor.before_optimizer_step(screen=self._screen_overflow if self.fp16 else None).skip
        except TrainingStopped as exc:
            stopped = exc
        if stopped is not None:
            with monitor.guard("DeepSpeed stop"):  # the stopping step's own record goes to disk too
                monitor.drain()
            monitor.flush()
            raise stopped
        return skip

    def _screen_overflow(self, table: StatTable) -> StatTable:
        """fp16: DeepSpeed skips a step whose gradients hold an inf or nan (a loss-scale overflow,
        or a real one: it cannot tell them apart). The merged gradient rows show it before the
        step, on every rank alike: drop the loss-scaled rows, whose non-finite values are routine."""
        if not overflowed(table):
            return table
        self._overflow = True
        return without_scaled(table)

    @contextlib.contextmanager
    def _no_update(self) -> Iterator[None]:
        """DeepSpeed's step with the torch optimizer's and the lr scheduler's `step` as no-ops:
        instance attributes, the previous ones (e.g. a torch lr scheduler's wrapper) put back."""
        engine = self.engine
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO-0 fp32: the torch one
        patched = []
        # ZeRO-3 with optimizer offload steps some sub-groups with its `backup_optimizer`
        for owner in (inner, getattr(engine.optimizer, "backup_optimizer", None), engine.lr_scheduler):
            if owner is None or not hasattr(owner, "step"):
                continue
            patched.append((owner, owner.__dict__.get("step"), "step" in owner.__dict__))
            owner.step = _no_op
        try:
            yield
        finally:
            for owner, previous, had in reversed(patched):
                if had:
                    owner.step = previous
                else:
                    del owner.step

    def _after_step(self, skipped: bool) -> None:
        monitor = self.monitor
        if monitor.active:
            applied = self.engine.was_step_applied()
            if self._overflow and applied:
                monitor.warn("DeepSpeed applied an fp16 step whose gradients held inf/nan; its gradient "
                             "statistics were dropped as an overflow's")
            monitor.add_tensors([SKIPPED], [monitor.backend.scalar(0.0 if applied and not skipped else 1.0)])
            if not applied and self.fp16:  # an overflow: the scaled gradients were thrown away
                for kind in SCALED_KINDS:
                    monitor.discard(kind)
            elif self.reader is not None:
                self._read_after_step(self.reader, applied and not skipped)
                self._report_norm()
        self._before = None
        self._overflow = False
        monitor.after_optimizer_step()
        monitor.step_end()

    def _report_norm(self) -> None:
        """DeepSpeed's own global gradient norm of this step, for the `misreported_grad_norm` rule.
        `engine.get_global_grad_norm()` is set inside `engine.step()`, before clipping and divided
        by the fp16 loss scale (ZeRO 1/2/3, the bf16/fp16 wrappers): the very gradients read before
        the step. None (nothing reported): ZeRO-0 fp32 (a plain torch optimizer keeps none) and
        `zero_optimization.compute_grad_norm: false`. A float inf is DeepSpeed's overflow marker,
        not a norm: it is not reported either (the gradient rows show the inf/nan themselves).
        Not reported either where DeepSpeed's norm covers other gradients than the monitor's merged
        one (`norm_not_comparable`)."""
        if not self.grad_keys or self._other_norm:
            return
        with self.monitor.guard("DeepSpeed global grad norm"):
            norm = self.engine.get_global_grad_norm()
            if isinstance(norm, torch.Tensor) or (norm is not None and math.isfinite(norm)):
                self.monitor.report_grad_norm(norm)

    def _read_after_step(self, reader: ShardReader, applied: bool) -> None:
        if self.param_keys:
            self._add(self.param_keys, reader.masters, "DeepSpeed parameters")
        if self.states:
            present = {STATE_NAMES[k]: k for k in reader.state_keys() if STATE_NAMES.get(k) in self.states}
            if not present and applied:  # (before a first applied step there is no state yet)
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
