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
- parameters and optimizer state: in the torch optimizer's step post-hook;
- `16-mixed` (the precision plugin's GradScaler): the step's loss scale as
  `train/loss_scale` (the activation gradients, measured in the scaled backward, divided
  by it before the rules see them), and a step the scaler skipped (an overflow) as `train/skipped` = 1;
  that step's loss-scaled rows (its inf/nan gradients) are dropped before the rules see them,
  as under the HF Trainer.

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

from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.handles import Handles
from msprobe_engine.monitor import Monitor
from msprobe_integrations.trainer_adapter import ALERTS_KEY, AlertCount, TrainerAdapter, announce, \
    optimizer_settings, quiet, record_hyperparameters, speak_through_progress_bar
from msprobe_integrations.trainer_hooks import resumed_config

__all__ = ["MonitorCallback"]

#: strategies whose parameters, gradients and optimizer state are shards this callback cannot read
SHARDED = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


class MonitorCallback(Callback):
    """A `lightning.pytorch.Callback` that monitors `trainer.fit` (module docstring).

    `config`: a path, a shipped config's name such as ``"full"``, a dict or a `MonitorConfig`
    (None: the defaults), validated here: a problem is a `ConfigError` when the callback is
    built. From `on_train_start` on, `.monitor` is the adapter (`history`, `incidents`, ...).

    Inside the Trainer: the run directory is printed once when training starts; the monitor's
    alerts and warnings are printed above the progress bar (`tqdm.write`, unless logging is
    configured); ``msprobe/alerts``, the number of alert episodes started so far, goes to the
    loggers and `trainer.callback_metrics` after every optimizer step (as `LearningRateMonitor`
    logs)."""

    def __init__(self, config: ConfigSource = None) -> None:
        if config is not None:
            load_config(config)  # a bad key, value or file: raised now
        self.config = config
        self.monitor: LightningHooks | None = None
        self._saved: dict | None = None
        self._handler = None
        self._alerts: AlertCount | None = None

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
        datamodule = getattr(trainer, "datamodule", None)
        record_hyperparameters(self.monitor, module=dict(pl_module.hparams), trainer=_trainer_settings(trainer),
                               optimizers=[optimizer_settings(o) for o in trainer.optimizers],
                               datamodule=dict(datamodule.hparams) if hasattr(datamodule, "hparams") else None)
        self._alerts = AlertCount(self.monitor)
        self._handler = speak_through_progress_bar()
        if trainer.is_global_zero:
            announce(self.monitor)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.monitor.micro_step_begin()
        self.monitor.count_batch(batch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.monitor.keep_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.monitor.before_optimizer_step(optimizer):
            trainer.should_stop = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor.batch_end(trainer.global_step):
            self._log_alerts(trainer)

    def _log_alerts(self, trainer) -> None:
        """The alert count after an optimizer step, to the loggers and `trainer.callback_metrics`
        as `LearningRateMonitor` logs its rates (a `LightningModule.log` call costs Lightning
        more than the monitor's own step on a small model: it copies its result metadata)."""
        total = float(self._alerts.total)
        trainer.callback_metrics[ALERTS_KEY] = torch.tensor(total)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({ALERTS_KEY: total}, step=trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.monitor.close()
        quiet(self._handler)
        self._handler = None


def _trainer_settings(trainer: Any) -> dict[str, Any]:
    """What of the Lightning Trainer changes the numbers (or the steps)."""
    return {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "gradient_clip_val": trainer.gradient_clip_val, "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            "precision": trainer.precision, "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size, "num_nodes": trainer.num_nodes}


class LightningHooks(TrainerAdapter):
    """A `Monitor` fed from a LightningModule and its torch optimizers (see the module docstring)."""

    def __init__(self, trainer: Any, module: Any, config: ConfigSource = None) -> None:
        from msprobe_engine.frameworks.torch import backend
        from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
        from msprobe_engine.frameworks.torch.optimizer_hooks import OptimizerHooks

        # the monitor's step is trainer.global_step once that optimizer step is done
        super().__init__(Monitor(config, rank=trainer.global_rank, backend=backend,
                                 start_step=trainer.global_step + 1), trainer.world_size)
        monitor = self.monitor
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
        self._stepped = False
        self._global_step = trainer.global_step
        self._stepping: Any = None  # the optimizer of the step being taken
        # 16-mixed: Lightning unscales the gradients before on_before_optimizer_step; its
        # GradScaler skips the optimizer's step on an overflow (global_step still advances)
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
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

    def before_optimizer_step(self, optimizer: Any) -> bool:
        """The accumulated, unclipped gradients; the decision. True: a `stop` rule fired."""
        self.report_losses(torch.sum)
        self._stepping = optimizer
        if not self.reads_model:
            return False
        self.reads.before_step()
        return self.decide_step(optimizer)

    def _after_step(self, optimizer, args, kwargs) -> None:
        """The torch optimizer's post-step hook (`TrainerAdapter.finish_step`)."""
        if self.finish_step(optimizer):
            self._stepped = True

    def batch_end(self, global_step: int) -> bool:
        """After a batch: closes the optimizer step when this batch ended one (returns whether it
        did: Lightning's global_step advanced). A step Lightning took whose torch optimizer did
        not step (its loss scaler skipped it: an fp16 overflow) is finished here, as skipped."""
        advanced = global_step != self._global_step
        if advanced and self.reads_model and not self._stepped and self._stepping is not None:
            self._stepped = self.finish_step(self._stepping, overflow=True)
        stepped = self._stepped or (not self.reads_model and advanced)
        self._stepped, self._global_step, self._stepping = False, global_step, None
        if stepped:
            self.monitor.step_end()
        return advanced
