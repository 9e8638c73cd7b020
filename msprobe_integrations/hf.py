"""Hugging Face Trainer: one callback, nothing else changes.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[MonitorCallback(config="configs/minimal.yaml")])
    trainer.train()

What is read, and where (plain PyTorch; see below for `--deepspeed`):
- activations: forward hooks on the model the Trainer trains (its module names);
  a micro-step is one forward of that model in training mode;
- the loss: the `loss` of the model's output, every micro-step; the record shows the step's
  loss as the Trainer logs it (the sum of the micro-batches' shares when the Trainer passes
  `num_items_in_batch` to the model, else their mean);
- parameter gradients: BEFORE clipping. The Trainer clips (`max_grad_norm`, 1.0 by
  default) before `on_pre_optimizer_step`, which would hide a gradient explosion behind a
  norm of at most 1, so they are read in one batch (as the plain loop reads them) at the end
  of the backward of the last micro-batch of the step (accelerate's `sync_gradients`), where
  they are final and not yet clipped: a tensor hook on the model's output (one Python call a
  step) queues the read as autograd's end-of-backward callback. With `torch_compile` the
  forward hook runs traced, so each gradient's own post-accumulate hook queues it instead.
  Under plain DDP (several processes without DeepSpeed) such a callback runs before DDP has
  averaged the gradients (DDP queues its own later in the backward): they are read at
  `on_pre_optimizer_step` instead, averaged and clipped, and the skip/stop decision is made
  to agree over the ranks (one all-reduce of two flags per monitored step);
- parameters and optimizer state: after the optimizer step (`on_optimizer_step`);
- fp16 AMP (accelerate's GradScaler): the step's loss scale as `train/loss_scale`; the
  gradients divided by it (its device tensor, no host sync) where they still hold it (one
  process; DDP without clipping, `max_grad_norm=0`); the activation gradients, measured in
  the scaled backward, divided by it before the rules see them; and a step the scaler
  skipped (an overflow: its scale went down) as `train/skipped` = 1. That
  step's gradients hold an inf or nan, routinely: its loss-scaled rows (gradients, activation
  gradients) are dropped before the rules see them (`steps/overflow.py`), so no `non_finite`
  alert and no skip/stop fires on it.

Actions: `stop` sets the Trainer's `control.should_training_stop` (the stopping step's
optimizer step is skipped; the Trainer ends after it as after its last step). The Trainer
has no way to skip one optimizer step: `skip` sets the gradients aside (`.grad = None`)
around `optimizer.step()`, which torch.optim then leaves untouched (weights, moments, step
count), and puts them back after it. The learning-rate scheduler still advances one step.

`--deepspeed ds_config.json`: the DeepSpeed adapter (`DeepSpeedMonitor`) does the reading
(gradients before DeepSpeed's clipping, ZeRO shards merged over the ranks); `config=None`
takes the `"msprobe"` block of the DeepSpeed config. Its `stop` is turned into
`control.should_training_stop` as well.

The monitor's state (step, rules, alert episodes, incident counters) is saved with every
Trainer checkpoint (`trainer_state.json`, as an `ExportableState`) and restored by
`trainer.train(resume_from_checkpoint=...)`, so an alert episode open at the checkpoint
stays open and a spike rule keeps its running average.

Step numbers are the Trainer's: a record's step is the `state.global_step` the Trainer logs
for that optimizer step (after its increment), so the first step is 1, with `--deepspeed`
too. (Before, the first step was 0: the monitor's step N was HF's global_step N+1.)
"""
from __future__ import annotations

import json
from functools import partial
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.contract import Integration
from msprobe_engine.frameworks.torch.compiled_hooks import RunTimeCall, is_compiled_wrapper, never_a_frame
from msprobe_engine.incident.actions import TrainingStopped
from msprobe_engine.monitor import Monitor
from msprobe_engine.handles import Handles
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.trainer_adapter import ALERTS_KEY, AlertCount, TrainerAdapter, announce, batch_sizes, \
    optimizer_settings, quiet, record_hyperparameters, speak_through_progress_bar
from msprobe_integrations.trainer_hooks import resumed_config

__all__ = ["MonitorCallback"]


class MonitorCallback(TrainerCallback, ExportableState):
    """A `transformers.TrainerCallback` that monitors the Trainer's training (module docstring).

    `config`: our config (a path, a shipped config's name such as ``"full"``, a dict or a
    `MonitorConfig`; None: the defaults, or under DeepSpeed the `"msprobe"` block of its
    config), validated here: a problem is a `ConfigError` when the callback is built, not when
    training starts. After `on_train_begin`, `.monitor` is the adapter (`history`,
    `incidents`, `alert_log`, ... of the run).

    Inside the Trainer: the run directory is printed once when training begins; the monitor's
    alerts and warnings are printed above the progress bar (`tqdm.write`, unless logging is
    configured); every entry of `state.log_history` gets ``msprobe/alerts``, the number of
    alert episodes started so far."""

    def __init__(self, config: ConfigSource = None) -> None:
        if config is not None:
            load_config(config)  # a bad key, value or file: raised now
        self.config = config
        self.monitor: Integration | None = None
        self._stopped = False
        self._handler = None
        self._alerts: AlertCount | None = None

    # ---- the Trainer's checkpoints ----------------------------------------------
    def state(self) -> dict:
        """What `trainer_state.json` keeps of this callback: the monitor's state_dict."""
        args = {"config": self.config} if _plain(self.config) else {}
        if self.monitor is None:
            return {"args": args, "attributes": {}}
        return {"args": args, "attributes": {"msprobe_state": self.monitor.state_dict()}}

    def _saved_state(self, state: Any) -> dict | None:
        """The monitor state in the checkpoint the Trainer resumes from, if any."""
        saved = state.stateful_callbacks.get(type(self).__name__)
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        return (saved or {}).get("attributes", {}).get("msprobe_state") or None

    # ---- the Trainer's events ---------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        engine = _deepspeed_engine(model) if args.deepspeed or _accelerate_uses_deepspeed() else None
        saved = self._saved_state(state)
        config = resumed_config(self.config, saved is not None)
        # the monitor's step is the Trainer's global_step once that step is done (on_log's)
        if engine is not None:
            self.monitor = _deepspeed_monitor(engine, config, self, state.global_step + 1)
        else:
            # with average_tokens_across_devices the Trainer multiplies a token share by the ranks
            self.monitor = TrainerHooks(model, optimizer, config, start_step=state.global_step + 1,
                                        ranks=args.world_size,
                                        share_scale=args.world_size if args.average_tokens_across_devices else 1,
                                        compiled=args.torch_compile)
        if saved is not None:
            self.monitor.load_state_dict(saved)
        model_config = getattr(model, "config", None)
        record_hyperparameters(self.monitor, trainer=args.to_dict(), optimizer=optimizer_settings(optimizer),
                               model=model_config.to_dict() if hasattr(model_config, "to_dict") else None)
        self._alerts = AlertCount(self.monitor)
        self._handler = speak_through_progress_bar()
        if state.is_world_process_zero:
            announce(self.monitor)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The Trainer has just added `logs` to `state.log_history`: the alert count joins it."""
        if self._alerts is not None and state.log_history:
            state.log_history[-1][ALERTS_KEY] = self._alerts.total

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if isinstance(self.monitor, TrainerHooks) and self.monitor.before_optimizer_step():
            control.should_training_stop = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        if isinstance(self.monitor, TrainerHooks):
            self.monitor.after_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        if isinstance(self.monitor, TrainerHooks) and not self.monitor.stopped:
            self.monitor.step_end()
        if self._stopped:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
        quiet(self._handler)
        self._handler = None

    def stop_after_this_step(self) -> None:
        """A `stop` rule fired under DeepSpeed: the Trainer ends after this step."""
        self._stopped = True


class TrainerHooks(TrainerAdapter):
    """The Trainer's model and optimizer (plain PyTorch, DDP) read for a `Monitor`: module
    hooks, pre-clip gradient hooks, the loss from the model's output, the optimizer's state.
    The callback calls `before_optimizer_step` / `after_optimizer_step` / `step_end`."""

    def __init__(self, model: Any, optimizer: Any, config: ConfigSource = None, *, start_step: int = 0,
                 ranks: int = 1, share_scale: int = 1, compiled: bool = False) -> None:
        from msprobe_engine.frameworks.torch import backend
        from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
        from msprobe_engine.frameworks.torch.optimizer_hooks import OptimizerHooks

        super().__init__(Monitor(config, backend=backend, start_step=start_step), ranks)
        monitor = self.monitor
        self.model = model
        self.share_scale = share_scale
        self.optimizer = _torch_optimizer(optimizer, monitor.warn)
        self.scaler = getattr(optimizer, "scaler", None)  # accelerate's optimizer holds its loss scaler
        if not isinstance(model, torch.nn.Module):
            monitor.warn(f"MonitorCallback: the Trainer's model is a {type(model).__name__}, not a torch.nn.Module: "
                         "activations, gradients and the loss are not monitored")
            return
        self.reads = OptimizerHooks(monitor, model, None, read_grads=ranks > 1)
        self._loss_is_share = False  # the model divides its loss by the step's token count
        self._keep = RunTimeCall(self._kept)
        self._grads: list[tuple[MetricKey, torch.Tensor]] = []  # final this backward, measured at its end
        #: the gradients read in one batch at the end of the step's last backward (one process)
        self._grad_params: list[tuple[MetricKey, torch.Tensor]] = []
        self._queued = False  # this backward's batched read is queued
        handles = [ModuleHooks(monitor, model),
                   Handles([model.register_forward_hook(self._loss_hook, with_kwargs=True)])]
        # DDP (`ranks` > 1): `reads` takes the averaged gradients at on_pre_optimizer_step; a read
        # queued when the backward starts would run before DDP's own end-of-backward averaging
        if monitor.config.watch.param_grads and ranks == 1:
            from accelerate.state import GradientState
            self._gradient_state = GradientState()
            params = [(MetricKey("grad", n), p) for n, p in model.named_parameters() if p.requires_grad]
            if compiled or is_compiled_wrapper(model) or getattr(model, "_compiled_call_impl", None) is not None:
                # compiled (`torch_compile`): the forward hook runs traced, where a tensor hook on the
                # output would sit on a traced copy: each gradient's own post-accumulate hook instead
                handles.append(Handles([p.register_post_accumulate_grad_hook(partial(self._grad_hook, key))
                                        for key, p in params]))
            else:
                self._grad_params = params
        monitor.add_attachment(*handles)

    # ---- hooks ------------------------------------------------------------------
    @never_a_frame
    def _loss_hook(self, module, args, kwargs, output) -> None:
        if not (self.monitor.active and module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        # traced (the model inside a larger compiled module; `never_a_frame`): what it keeps, at run time
        self._keep([loss] if isinstance(loss, torch.Tensor) else [],
                   [*batch_sizes(kwargs), kwargs.get("num_items_in_batch") is not None])
        if self._grad_params and self._gradient_state.sync_gradients and not torch.compiler.is_compiling():
            # the step's last micro-batch: its backward starts at the output (the loss, or the logits
            # a compute_loss of the user's uses), whose tensor hook queues the batched read
            for tensor in _output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._backward_started)

    def _kept(self, losses: list[torch.Tensor], values: list[int]) -> None:
        """One training forward's loss (if the output has one) and batch (`_loss_hook`)."""
        samples, tokens, share = values
        self._loss_is_share = bool(share)
        self.add_sizes(samples, tokens)
        if losses:
            self.keep_loss(losses[0])
        else:
            self.monitor.warn("MonitorCallback: the model's output has no `loss` (a compute_loss outside the "
                              "model?): train/loss is not monitored")

    def _backward_started(self, grad: torch.Tensor) -> None:
        """The backward of the step's last micro-batch reached the model's output: every gradient
        is read in one batch when this backward ends (autograd's end-of-backward callback), final
        and not yet clipped (the Trainer clips after the backward), as the plain loop reads them."""
        monitor = self.monitor
        if monitor.active and not self._queued and "gradient hook" not in monitor.disabled:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._measure_grads)

    def _grad_hook(self, key: MetricKey, param: torch.Tensor) -> None:
        """(Compiled models.) A gradient is final (the last micro-batch's backward has accumulated
        it, the Trainer has not clipped it yet): kept, and all of them measured in one batch when
        this backward ends."""
        monitor = self.monitor
        if monitor.active and self._gradient_state.sync_gradients and "gradient hook" not in monitor.disabled:
            if not self._grads:
                torch.autograd.Variable._execution_engine.queue_callback(self._measure_grads)
            self._grads.append((key, param.grad))

    def _measure_grads(self) -> None:
        """The gradients of the step, divided by the fp16 loss scale of accelerate's GradScaler
        (the scaler's device tensor: no host sync; they are unscaled only after this)."""
        grads, self._grads, self._queued = self._grads, [], False
        if self._grad_params:
            grads = [(key, p.grad) for key, p in self._grad_params if p.grad is not None]
        with self.monitor.guard("gradient hook"):
            scale = self.loss_scale()
            self.monitor.add_tensors([key for key, _ in grads], [grad for _, grad in grads],
                                     divisor=1.0 if scale is None else scale)

    # ---- lifecycle (called by the callback) ---------------------------------------
    def before_optimizer_step(self) -> bool:
        """At `on_pre_optimizer_step`: the loss, DDP's gradients, then the decision. Returns
        True when a `stop` rule fired (the step is then skipped too)."""
        self._queued = False  # (a backward that raised ran no callback)
        if self.reads is None:
            return False
        # the step's loss: the sum of shares, else the mean
        self.report_losses(lambda losses: losses.sum() * self.share_scale if self._loss_is_share else losses)
        # with DDP: the gradients too (averaged now; clipped, and so unscaled, when the Trainer clips)
        self.reads.before_step(self._scale_in_grads())
        return self.decide_step(self.optimizer)

    def _scale_in_grads(self) -> float | torch.Tensor:
        """What the gradients are still multiplied by at `on_pre_optimizer_step`: accelerate
        unscales them there only to clip (`max_grad_norm` > 0); with no clipping they still hold
        the GradScaler's loss scale (its device tensor). 1 without a scaler."""
        scale = self.loss_scale()
        if scale is None or self.optimizer is None:
            return 1.0
        from torch.amp.grad_scaler import OptState

        state = self.scaler._per_optimizer_states.get(id(self.optimizer), {})  # `get`: its defaultdict untouched
        return 1.0 if state.get("stage") is OptState.UNSCALED else scale

    def after_optimizer_step(self) -> None:
        """After the Trainer's optimizer step: the gradients back, what the step changed
        (`TrainerAdapter.finish_step`)."""
        self.finish_step(self.optimizer)


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors a model's output holds at its top level (a `ModelOutput`, a dict, a tuple)."""
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else [output]
    return [value for value in values if isinstance(value, torch.Tensor)]


def _torch_optimizer(optimizer: Any, warn) -> torch.optim.Optimizer | None:
    """The torch optimizer inside the Trainer's (accelerate's AcceleratedOptimizer wraps one)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    warn(f"MonitorCallback: the Trainer's optimizer ({type(optimizer).__name__}) is not a torch.optim.Optimizer: "
         "optimizer state and parameters after the step are not monitored, and `skip` cannot be applied")
    return None


def _accelerate_uses_deepspeed() -> bool:
    from accelerate.state import AcceleratorState, DistributedType

    return AcceleratorState._shared_state != {} and AcceleratorState().distributed_type == DistributedType.DEEPSPEED


def _deepspeed_engine(model: Any) -> Any:
    """The DeepSpeed engine that trains `model` (the Trainer gives callbacks the bare model,
    not the engine; the engine is found once, among the live objects)."""
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    def trains_model(obj: Any) -> bool:
        try:
            return isinstance(obj, DeepSpeedEngine) and obj.module is model
        except ReferenceError:  # a weak proxy whose object is gone
            return False

    engines = [o for o in gc.get_objects() if trains_model(o)]
    return engines[-1] if engines else None


def _deepspeed_monitor(engine: Any, config: ConfigSource, callback: MonitorCallback, start_step: int) -> Integration:
    """`DeepSpeedMonitor` on the Trainer's engine, its steps numbered from `start_step`; its
    `stop` ends the Trainer's run instead of raising out of `trainer.train()` (the stopping
    step's DeepSpeed step is not run)."""
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    adapter = DeepSpeedMonitor(engine, config, start_step=start_step)
    monitored_step = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            return monitored_step(*args, **kwargs)
        except TrainingStopped:
            callback.stop_after_this_step()
            return None

    engine.step = step
    adapter.add_attachment(_Restore(engine, "step", step))
    return adapter


class _Restore:
    """Removes an instance attribute set on `owner`, if it is still ours."""

    def __init__(self, owner: Any, name: str, value: Any) -> None:
        self.owner, self.name, self.value = owner, name, value

    def remove(self) -> None:
        if self.owner.__dict__.get(self.name) is self.value:
            del self.owner.__dict__[self.name]


def _plain(config: ConfigSource) -> bool:
    """Whether `config` can be written to trainer_state.json (a path or a plain dict)."""
    if isinstance(config, str) or config is None:
        return True
    try:
        json.dumps(config)
    except TypeError:
        return False
    return isinstance(config, dict)
