"""Megatron optimizers: where each parameter's gradient, main weight and state live.

Every trainable parameter is mapped to the tensor its optimizer updates on this
rank (its *main* tensor): the parameter itself (`FP32Optimizer`, a torch
optimizer), its fp32 copy `param.main_param` (`Float16OptimizerWithFloat16Params`),
or this data-parallel rank's shard of that copy (`DistributedOptimizer`; none
when the rank holds no piece of it). `ChainedOptimizer` is looked through.

Gradients are read once per optimizer step, right after the optimizer's
`prepare_grads()` (which its `step()` calls first): the DDP buffers are reduced
by then, copied to the main tensors and, with fp16, unscaled; this is the
gradient Megatron clips and steps with. Then the monitor decides: when its
decision says skip, `prepare_grads()` answers True ("found inf"), Megatron's own
way to skip the update. Weights and optimizer state are read right after
`step()`, with `train/skipped` (1 when the step changed nothing). A step Megatron
skips on an fp16 overflow has its gradients dropped, as with DeepSpeed: they were
thrown away, not applied. A torch optimizer is read in its step pre/post hooks,
with the gradient taken from `main_grad` when Megatron's DDP keeps one.
A parameter without a main tensor on this rank is measured as an empty tensor,
so that every rank reports the same rows and the merge fills them in.

The global gradient norm `step()` returns (Megatron's own, before clipping) is passed to
`monitor.report_grad_norm` on one pipeline stage (the monitor's norm is that of its stage's
parameters, Megatron's that of all stages): the `misreported_grad_norm` rule checks it against
the merged `grad/global/norm` after the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from msprobe_engine.frameworks.torch.optimizer_hooks import STATE_NAMES, HeldGrads, restore_grads, set_aside_grads
from msprobe_engine.handles import Handles
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.megatron.wrapping import MethodWrap

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

SKIPPED = MetricKey("train", "skipped")
SUPPORTED = ("FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer, a "
             "ChainedOptimizer of these, or a torch.optim.Optimizer")


@dataclass
class Slot:
    """One trainable parameter as its optimizer sees it on this rank; with `part` = (j, n), the
    j-th of n equal flat pieces of it (one expert of a grouped-GEMM weight, `experts.split_grouped`)."""
    name: str
    param: torch.nn.Parameter
    main: torch.Tensor | None = None
    inner: Any = None  # the torch optimizer holding `main`'s state
    part: tuple[int, int] | None = None

    def placeholder(self) -> torch.Tensor:
        return self.param.new_empty(0)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the main tensor, its gradient or state) as this slot sees it: its part."""
        if self.part is None:
            return tensor
        index, count = self.part
        return tensor.reshape(count, -1)[index]


def check_optimizer(optimizer: Any) -> None:
    """Raise on an object that is no optimizer the monitor can read."""
    if optimizer is not None and not isinstance(optimizer, (MegatronOptimizer, torch.optim.Optimizer)):
        raise TypeError(f"MegatronMonitor: optimizer is a {type(optimizer).__name__}; expected "
                        f"{SUPPORTED} (or None to monitor activations and the loss only)")


def find_slots(optimizer: Any, named: list[tuple[str, torch.nn.Parameter]]
               ) -> tuple[list[Slot], set[str], list[str]]:
    """Map the model's parameters to their main tensors.

    Returns the slots of the parameters an optimizer updates, the names of those
    sharded over data-parallel ranks, and warnings naming what is not monitored.
    """
    if optimizer is None:
        return [], set(), ["no optimizer: parameter gradients, weights and optimizer state are not monitored"]
    slots = {id(p): Slot(name, p) for name, p in named}
    sharded: set[str] = set()
    problems: list[str] = []
    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for sub in subs:
        instances = getattr(getattr(sub, "ddp_config", None), "num_distributed_optimizer_instances", 1)
        if isinstance(sub, DistributedOptimizer) and instances > 1:
            problems.append(f"DistributedOptimizer with num_distributed_optimizer_instances={instances} "
                            "is not supported: the gradients, weights and state of its parameters are "
                            "not monitored")
        elif isinstance(sub, DistributedOptimizer):
            problems += _slots_sharded(sub, slots, sharded)
        elif isinstance(sub, (FP32Optimizer, Float16OptimizerWithFloat16Params, torch.optim.Optimizer)):
            _slots_replicated(sub, slots)
        else:
            problems.append(f"optimizer {type(sub).__name__} is not supported ({SUPPORTED}): the "
                            "gradients, weights and state of its parameters are not monitored")
    missing = [s.name for s in slots.values() if s.inner is None]
    if missing:
        problems.append(f"{len(missing)} trainable parameters are not updated by the optimizer; their "
                        f"gradients, weights and state are not monitored: {', '.join(missing[:5])}"
                        + (", ..." if len(missing) > 5 else ""))
    return [s for s in slots.values() if s.inner is not None], sharded, problems


def _slots_sharded(sub: DistributedOptimizer, slots: dict[int, Slot], sharded: set[str]) -> list[str]:
    if getattr(sub, "is_stub_optimizer", False):  # no trainable parameters on this rank
        return []
    if not (hasattr(sub, "model_param_group_index_map") and hasattr(sub, "buffers")):
        return ["DistributedOptimizer has no model_param_group_index_map or buffers (a Megatron-core "
                "version this monitor does not know): the gradients, weights and state of its "
                "parameters are not monitored"]
    inner = sub.optimizer
    where = sub.model_param_group_index_map  # the params with a shard on this rank
    for param in (p for buffer in sub.buffers for p in buffer.params):  # every param, on any rank
        slot = slots.get(id(param))
        if slot is None:
            continue
        slot.inner = inner
        sharded.add(slot.name)
        if param in where:
            group, index = where[param]
            slot.main = inner.param_groups[group]["params"][index]
    return []


def _slots_replicated(sub: Any, slots: dict[int, Slot]) -> None:
    inner = sub if isinstance(sub, torch.optim.Optimizer) else sub.optimizer
    updated = {id(t) for group in getattr(inner, "param_groups", []) for t in group["params"]}
    for slot in slots.values():
        main = getattr(slot.param, "main_param", None)
        main = slot.param if main is None else main
        if id(main) in updated:
            slot.main, slot.inner = main, inner


def computes_grad_norm(optimizer: Any) -> bool:
    """Whether the second value `optimizer.step()` returns is a computed norm: always for a
    `ChainedOptimizer` (megatron-core 0.16), only with `clip_grad > 0` otherwise (without
    clipping `FP32Optimizer` returns None and the mixed-precision and distributed optimizers
    return 0.0, no norm). A torch optimizer returns none."""
    if isinstance(optimizer, ChainedOptimizer):
        return True
    return isinstance(optimizer, MegatronOptimizer) and getattr(optimizer.config, "clip_grad", 0.0) > 0.0


def grad_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """Where Megatron keeps a tensor's gradient: DDP's `main_grad`, else `.grad`, else the
    precision-aware optimizer's `decoupled_grad`."""
    for attr in ("main_grad", "grad", "decoupled_grad"):
        grad = getattr(tensor, attr, None)
        if grad is not None:
            return grad
    return None


class OptimizerTap(Handles):
    """Reads gradients before, and weights and state after, each optimizer step; and tells
    the monitor (`before_optimizer_step` once the gradients are final, before any weight
    changes; `after_optimizer_step`)."""

    def __init__(self, monitor: "Monitor", optimizer: Any, slots: list[Slot], reports_norm: bool = False) -> None:
        """`reports_norm`: pass the norm `optimizer.step()` returns to `monitor.report_grad_norm`
        (see `computes_grad_norm`)."""
        self.monitor = monitor
        self.slots = slots
        self.reports_norm = reports_norm and computes_grad_norm(optimizer)
        watch = monitor.config.watch
        self.states = [s for s in watch.optimizer_state if s in ("exp_avg", "exp_avg_sq")]
        self.update = any(s in ("update", "ratio") for s in watch.optimizer_state)
        self.weights = watch.params or self.update
        self._before: list[torch.Tensor] | None = None
        self._held: HeldGrads = []
        self.handles: list = []
        if isinstance(optimizer, torch.optim.Optimizer):
            self.handles = [optimizer.register_step_pre_hook(self._torch_pre_step),
                             optimizer.register_step_post_hook(self._torch_post_step)]
        elif optimizer is not None:
            self.handles = [MethodWrap(optimizer, "prepare_grads", after=self._grads_ready),
                             MethodWrap(optimizer, "step", after=self._step_done)]

    def _grads_ready(self, found_inf: bool) -> bool:
        """After Megatron's `prepare_grads()`; returns whether the update must be skipped."""
        monitor = self.monitor
        if monitor.active and not found_inf:
            with monitor.guard("reading gradients after prepare_grads"):
                self._read_grads()
        return bool(found_inf) or monitor.before_optimizer_step().skip  # no weight has changed yet

    def _step_done(self, result: Any) -> Any:
        """After Megatron's `step()`, which returned (update_successful, grad_norm, num_zeros)."""
        self._after_step(skipped=not result[0])
        if self.reports_norm and result[0]:
            self._report_norm(result[1])
        return result

    def _report_norm(self, norm: Any) -> None:
        """Megatron's own global gradient norm, for the `misreported_grad_norm` rule: taken in
        `step()` after `prepare_grads()` and before clipping, over the main gradients the monitor
        read (its tensor-parallel duplicates and shared parameters left out, reduced over the
        model-parallel group, or over every rank with the distributed optimizer). A non-finite
        norm is not reported: the gradient rows show the inf/nan themselves."""
        monitor = self.monitor
        if monitor.active and monitor.config.watch.param_grads and norm is not None:
            with monitor.guard("Megatron grad norm"):
                if isinstance(norm, torch.Tensor) or math.isfinite(norm):
                    monitor.report_grad_norm(norm)

    def _torch_pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._grads_ready(False):  # torch.optim leaves a parameter without .grad untouched
            self._held = set_aside_grads(p for group in optimizer.param_groups for p in group["params"])

    def _torch_post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        skipped = bool(self._held)
        restore_grads(self._held)
        self._held = []
        self._after_step(skipped)

    def _after_step(self, skipped: bool) -> None:
        monitor = self.monitor
        if monitor.active:
            with monitor.guard("reading weights and optimizer state after step"):
                monitor.add_tensors([SKIPPED], [monitor.backend.scalar(float(skipped))])
                self._read_after_step()
        monitor.after_optimizer_step()

    def _read_grads(self) -> None:
        watch = self.monitor.config.watch
        if watch.param_grads:
            grads = [grad_of(s.main) if s.main is not None else None for s in self.slots]
            self.monitor.add_tensors([MetricKey("grad", s.name) for s in self.slots],
                                     [s.view(g) if g is not None else s.placeholder() for s, g in zip(self.slots, grads)])
        if self.update:
            mains = self._mains()
            self._before = torch._foreach_mul(mains, 1.0) if mains else []

    def _read_after_step(self) -> None:
        keys: list[MetricKey] = []
        tensors: list[torch.Tensor] = []
        if self.weights:
            keys += [MetricKey("param", s.name) for s in self.slots]
            tensors += [s.view(s.main.detach()) if s.main is not None else s.placeholder() for s in self.slots]
        for state in self.states:
            keys += [MetricKey("optim", s.name, state) for s in self.slots]
            tensors += [self._state(s, state) for s in self.slots]
        if self._before is not None:
            mains = self._mains()
            updates = iter(torch._foreach_sub(mains, self._before) if mains else [])
            keys += [MetricKey("optim", s.name, "update") for s in self.slots]
            tensors += [next(updates) if s.main is not None else s.placeholder() for s in self.slots]
            self._before = None
        self.monitor.add_tensors(keys, tensors)

    def _mains(self) -> list[torch.Tensor]:
        return [s.view(s.main.detach()) for s in self.slots if s.main is not None]

    def _state(self, slot: Slot, name: str) -> torch.Tensor:
        if slot.main is not None:
            for key, value in slot.inner.state.get(slot.main, {}).items():
                if STATE_NAMES.get(key) == name and isinstance(value, torch.Tensor):
                    return slot.view(value)
        return slot.placeholder()
