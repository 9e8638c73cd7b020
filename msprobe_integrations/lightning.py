"""Lightning: one callback, nothing else changes.

    trainer = lightning.pytorch.Trainer(..., callbacks=[MonitorCallback(config="configs/minimal.yaml")])
    trainer.fit(module, data)

What is read, and where (automatic optimization; single device and DDP):
- activations: forward hooks on the LightningModule's submodules; a micro-step is one
  training batch (`on_train_batch_start`);
- the loss: the loss of every backward (`on_before_backward`, which Lightning has divided
  by the accumulation count), summed per optimizer step: the mean over its micro-batches;
- parameter gradients: `on_before_optimizer_step`, after the last backward of the step (and
  after DDP's all-reduce) and BEFORE Lightning clips them (`gradient_clip_val`);
- parameters and optimizer state: in the torch optimizer's step post-hook.

Actions: `stop` sets `trainer.should_stop` (the stopping step's optimizer step is skipped).
Lightning has no way to skip one optimizer step: `skip` sets the gradients aside
(`.grad = None`), which torch.optim leaves untouched (weights, moments, step count); they
are put back right after the step. Under DDP each rank decides on its own loss and
activations; one all-reduce of two flags per monitored step makes the ranks agree.

The monitor's state travels in Lightning's checkpoints (`Callback.state_dict` /
`load_state_dict`): `trainer.fit(..., ckpt_path=...)` resumes with the same rule state and
alert episodes.

Not read (a warning names it): sharded strategies (FSDP, ModelParallel, DeepSpeed) keep
gradients and optimizer state as flat or DTensor shards this callback does not read yet:
only activations and the loss are monitored there. Manual optimization
(`automatic_optimization = False`): gradients and actions are not monitored.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

from msprobe_engine.config import ConfigSource
from msprobe_engine.contract import Integration
from msprobe_engine.handles import Handles
from msprobe_engine.monitor import Monitor
from msprobe_integrations.trainer_hooks import decide, resumed_config

__all__ = ["MonitorCallback"]

#: strategies whose parameters, gradients and optimizer state are shards this callback cannot read
SHARDED = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


class MonitorCallback(Callback):
    """A `lightning.pytorch.Callback` that monitors `trainer.fit` (module docstring).

    `config`: a path, a dict or a `MonitorConfig` (None: the defaults). From
    `on_train_start` on, `.monitor` is the adapter (`history`, `incidents`, ...)."""

    def __init__(self, config: ConfigSource = None) -> None:
        self.config = config
        self.monitor: LightningHooks | None = None
        self._saved: dict | None = None

    # ---- checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict() if self.monitor is not None else dict(self._saved or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores callbacks before training starts: kept until the monitor exists."""
        self._saved = dict(state_dict) or None
        if self.monitor is not None and self._saved:
            self.monitor.load_state_dict(self._saved)

    # ---- Lightning's hooks --------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.monitor = LightningHooks(trainer, pl_module, resumed_config(self.config, bool(self._saved)))
        if self._saved:
            self.monitor.load_state_dict(self._saved)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.monitor.micro_step_begin()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.monitor.keep_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.monitor.before_optimizer_step(optimizer):
            trainer.should_stop = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.monitor.batch_end(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.monitor.close()


class LightningHooks(Integration):
    """A `Monitor` fed from a LightningModule and its torch optimizers (see the module docstring)."""

    def __init__(self, trainer: Any, module: Any, config: ConfigSource = None) -> None:
        from msprobe_engine.frameworks.torch import backend
        from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
        from msprobe_engine.frameworks.torch.optimizer_hooks import OptimizerHooks

        super().__init__(Monitor(config, rank=trainer.global_rank, backend=backend, start_step=trainer.global_step))
        monitor = self.monitor
        self.ranks = trainer.world_size
        strategy = type(trainer.strategy).__name__
        self.reads_model = strategy not in SHARDED and module.automatic_optimization
        if strategy in SHARDED:
            monitor.warn(f"MonitorCallback: {strategy} shards the parameters: gradients, parameters and optimizer "
                         "state are not monitored (activations and the loss are)")
        elif not module.automatic_optimization:
            monitor.warn("MonitorCallback: manual optimization (automatic_optimization = False): gradients, "
                         "optimizer state and actions are not monitored (activations are)")
        self.module = module
        self._modules = ModuleHooks(monitor, module, counts_micro_steps=False)
        self.reads = OptimizerHooks(monitor, module, None, read_grads=True)
        self._losses: list[torch.Tensor] = []
        self._held: list = []
        self._stepped = False
        #: a `stop` rule fired: Lightning ends after this batch
        self.stopped = False
        self._global_step = trainer.global_step
        handles = []
        if self.reads_model:
            for optimizer in trainer.optimizers:
                if isinstance(optimizer, torch.optim.Optimizer):
                    handles.append(optimizer.register_step_post_hook(self._after_step))
                else:
                    monitor.warn(f"MonitorCallback: the optimizer {type(optimizer).__name__} is not a "
                                 "torch.optim.Optimizer: its state is not monitored and `skip` cannot be applied")
        monitor.add_attachment(self._modules, Handles(handles))

    def micro_step_begin(self) -> None:
        """A training batch starts: a new micro-step (and the module hooks' call counts restart)."""
        # the module hooks' call counts restart, as when the root module's forward starts
        # (a training_step need not call the LightningModule's own forward)
        self._modules._root_pre_hook(self.module, ())
        self.monitor.micro_step_begin()

    def keep_loss(self, loss: torch.Tensor) -> None:
        if self.monitor.active and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().reshape(()))

    def before_optimizer_step(self, optimizer: Any) -> bool:
        """The accumulated, unclipped gradients; the decision. True: a `stop` rule fired."""
        monitor = self.monitor
        losses, self._losses = self._losses, []
        if monitor.active and losses:
            with monitor.guard("loss"):
                monitor.report_loss(torch.stack(losses).sum())
        if not self.reads_model:
            return False
        self.reads.before_step()
        stop, self._held = decide(monitor, self.ranks, optimizer)
        self.stopped = self.stopped or stop
        return stop

    def _after_step(self, optimizer, args, kwargs) -> None:
        """The torch optimizer's post-step hook. After a `stop`, nothing more is measured or
        closed (as when `TrainingStopped` propagates): `close` writes the stopping step."""
        from msprobe_engine.frameworks.torch.optimizer_hooks import restore_grads

        restore_grads(self._held)
        self._held = []
        if self.stopped:
            return
        self.reads.after_step(optimizer)
        self.monitor.after_optimizer_step()
        self._stepped = True

    def batch_end(self, global_step: int) -> None:
        """After a batch: closes the optimizer step when this batch ended one."""
        stepped = self._stepped or (not self.reads_model and global_step != self._global_step)
        self._stepped, self._global_step = False, global_step
        if stepped:
            self.monitor.step_end()
