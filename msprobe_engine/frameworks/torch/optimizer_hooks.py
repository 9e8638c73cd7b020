"""Parameters, gradients and optimizer state of a torch model and torch.optim optimizer.

Gradients are read once per optimizer step, in the optimizer's pre-step
hook, which is the gradient-accumulation boundary of a plain PyTorch loop.
Parameters and optimizer state (exp_avg, exp_avg_sq of Adam/AdamW; the
momentum buffer of SGD reported as exp_avg) are read in the post-step hook.
The update and the update/parameter ratio need a copy of the parameters
taken just before the step (only when the config asks for them; on CPU kept from
step to step, see `OptimizerHooks._copy_params`).

When the monitor's decision says skip (a `skip`/`stop` rule fired, or the step is a
replay), the pre-step hook sets the gradients aside: torch.optim leaves a parameter
whose `.grad` is None untouched (weights, moments, step count), so `optimizer.step()`
changes nothing; the post-step hook puts the gradients back. No method is replaced.

A compiled optimizer step runs the hooks eagerly (`torch._dynamo.disable`): a graph break at
its start and one at its end; with `fullgraph=True` Dynamo refuses them (docs/compile.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from msprobe_engine.frameworks.torch import compiled_hooks
from msprobe_engine.handles import Handles
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

#: optimizer-state key in torch.optim -> the name we report
STATE_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum_buffer": "exp_avg"}

SKIPPED = MetricKey("train", "skipped")  # 1 when the monitor's decision skipped the step, else 0

HeldGrads = list[tuple[torch.Tensor, torch.Tensor]]


def set_aside_grads(params: Iterable[torch.Tensor]) -> HeldGrads:
    """Take the gradients off `params` (their `.grad` becomes None); `restore_grads` puts them back."""
    held = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in held:
        p.grad = None
    return held


def restore_grads(held: HeldGrads) -> None:
    for p, grad in held:
        p.grad = grad


class OptimizerHooks(Handles):
    """Reads grads before and params/state after each `optimizer.step()`."""

    def __init__(self, monitor: "Monitor", model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, *, read_grads: bool = True) -> None:
        """`read_grads=False`: an integration measures the gradients itself (e.g. before the
        trainer clips them); `optimizer=None`: no hooks, the integration calls `before_step`
        and `after_step` from its own."""
        self.monitor = monitor
        self.read_grads = read_grads
        watch = monitor.config.watch
        self.params = [(compiled_hooks.clean_path(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.states = [s for s in watch.optimizer_state if s in ("exp_avg", "exp_avg_sq")]
        self.update = any(s in ("update", "ratio") for s in watch.optimizer_state)
        self._before: list[torch.Tensor] | None = None
        self._kept: list[torch.Tensor] | None = None  # CPU: the parameter copy for `update`, reused
        self._held: HeldGrads = []
        self._skipped = False
        self.handles: list = []
        if optimizer is None:
            return
        owned = {id(p) for _, p in self.params}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
        if foreign:
            monitor.warn(f"{foreign} optimizer parameters are not in the model; they are not monitored")
        # never traced: in a compiled optimizer step (`torch.compile(optimizer.step)`) the hooks run
        # eagerly at its start and end (a graph break each), the step's own math stays compiled
        self.handles = [optimizer.register_step_pre_hook(torch._dynamo.disable(self._pre_step)),
                        optimizer.register_step_post_hook(torch._dynamo.disable(self._post_step))]
        self.optimizer = optimizer

    def _pre_step(self, optimizer, args, kwargs) -> None:
        monitor = self.monitor
        self.before_step()
        self._skipped = monitor.before_optimizer_step().skip
        if self._skipped:
            self._held = set_aside_grads(p for group in optimizer.param_groups for p in group["params"])

    def _post_step(self, optimizer, args, kwargs) -> None:
        monitor = self.monitor
        restore_grads(self._held)
        self._held = []
        if monitor.replaying:
            return
        if monitor.active:
            with monitor.guard("optimizer post-step hook"):
                monitor.add_tensors([SKIPPED], [monitor.backend.scalar(1.0 if self._skipped else 0.0)])
        self.after_step(optimizer)
        monitor.after_optimizer_step()

    def before_step(self, divisor: float | torch.Tensor = 1.0) -> None:
        """What is read just before the optimizer step: the rows compiled code wrote in this step
        (`compiled_hooks.harvest`), the gradients (unless `read_grads` is off; divided by
        `divisor`, e.g. a loss scale still in them) and, for `update`/`ratio`, a copy of the
        parameters."""
        monitor = self.monitor
        if monitor.active:
            with monitor.guard("optimizer pre-step hook"):
                if not monitor.replaying:
                    compiled_hooks.harvest(monitor)
                if monitor.config.watch.param_grads and self.read_grads:
                    grads = [(n, p.grad) for n, p in self.params if p.grad is not None]
                    monitor.add_tensors([MetricKey("grad", n) for n, _ in grads], [g for _, g in grads], divisor)
                if self.update and not monitor.replaying:
                    self._before = self._copy_params()

    def after_step(self, optimizer) -> None:
        """What is read just after `optimizer`'s step: parameters and optimizer state."""
        if self.monitor.active and not self.monitor.replaying:
            with self.monitor.guard("optimizer post-step hook"):
                self._read_after_step(optimizer)

    def _read_after_step(self, optimizer) -> None:
        keys: list[MetricKey] = []
        tensors: list[torch.Tensor] = []
        if self.monitor.config.watch.params or self.update:
            keys += [MetricKey("param", n) for n, _ in self.params]
            tensors += [p.detach() for _, p in self.params]
        for name, p in self.params:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                ours = STATE_NAMES.get(key)
                if ours in self.states and isinstance(value, torch.Tensor):
                    keys.append(MetricKey("optim", name, ours))
                    tensors.append(value)
        self.monitor.add_tensors(keys, tensors)
        if self._before is not None:  # each parameter after the step minus before (on CPU never written)
            self.monitor.add_differences([MetricKey("optim", n, "update") for n, _ in self.params],
                                         [p.detach() for _, p in self.params], self._before)
            self._before = None

    def _copy_params(self) -> list[torch.Tensor]:
        """The parameters just before the step, for `update`. CPU parameters are copied into
        buffers kept from step to step: a fresh copy of every parameter each step costs its page
        faults (20M float32 parameters here: 41 ms against 9 ms into kept buffers). Elsewhere a
        fresh copy: a caching allocator reuses the memory, and a kept copy would hold one more
        copy of the parameters between steps."""
        params = [p.detach() for _, p in self.params]
        if not params or not params[0].is_cpu:
            return torch._foreach_mul(params, 1.0)
        kept = self._kept
        if kept is None or any(k.shape != p.shape or k.dtype != p.dtype for k, p in zip(kept, params)):
            kept = self._kept = [torch.empty_like(p) for p in params]
        for k, p in zip(kept, params):  # one by one: a DTensor has no `_foreach_copy_` sharding rule
            k.copy_(p)
        return kept
