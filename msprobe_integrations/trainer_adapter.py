"""What the HF Trainer's and Lightning's adapters share: the step's losses, the decision before
the trainer's optimizer step (`skip` sets the gradients aside, `stop` is returned for the
trainer's own way of ending), what follows the step (`train/skipped`, parameters and optimizer
state), and the run's voice inside the trainer: alerts printed above the progress bar, the run
directory said once, the count of alerts so far for the trainer's own logs."""
from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any, Callable

import torch

import numpy as np

from msprobe_engine.contract import Integration
from msprobe_engine.frameworks.torch.optimizer_hooks import SKIPPED, restore_grads
from msprobe_engine.health import LOSS_SCALE
from msprobe_engine.incident.graph import INPUT_GRAD_KIND
from msprobe_engine.monitor import Monitor
from msprobe_engine.stats import P_MAX, divide
from msprobe_engine.stats.table import MetricKey, StatTable
from msprobe_engine.steps.overflow import screen_scaler_overflow
from msprobe_integrations.trainer_hooks import decide

#: the key under which the trainers' own logs get the number of alerts so far
ALERTS_KEY = "msprobe/alerts"
#: the learning rate of the step (the first parameter group's), also shown as Health/lr
LR = MetricKey("train", "lr")
#: the step's throughput (since the previous step's end) and the memory at its end (Health/ shows them)
TOKENS_PER_S, SAMPLES_PER_S = MetricKey("train", "tokens_per_s"), MetricKey("train", "samples_per_s")
CPU_RSS_MB, DEVICE_MB = MetricKey("train", "cpu_rss_mb"), MetricKey("train", "device_mem_mb")
#: rows a loss-scaled backward measures scaled (the parameter gradients are read unscaled)
ACTIVATION_GRAD_KINDS = frozenset({"actv_grad", INPUT_GRAD_KIND})


class TrainerAdapter(Integration):
    """A `Monitor` driven by a trainer's callback (HF Trainer, Lightning). Subclasses set
    `reads` (the `OptimizerHooks` of the model, or None) and call `keep_loss`,
    `decide_step` and `finish_step`."""

    def __init__(self, monitor: Monitor, ranks: int) -> None:
        super().__init__(monitor)
        self.ranks = ranks
        self.reads: Any = None
        #: the trainer's loss scaler (a torch `GradScaler`: fp16 AMP), or None
        self.scaler: Any = None
        #: a `stop` rule fired: the trainer ends after this step
        self.stopped = False
        self._losses: list[torch.Tensor] = []
        self._held: list = []
        self._samples = self._tokens = 0  # counted since the previous step's end
        self._step_ended: float | None = None  # perf_counter at the previous step's end
        self._skipped: bool | None = None  # the finished step's skip (None: none finished)
        self._scale_before: torch.Tensor | None = None  # the loss scale the step began with
        monitor.add_step_closer(self)
        # under a loss scaler: activation gradients as unscaled, and a step the scaler skips (an
        # fp16 overflow) shows its non-finite scaled gradients: routine, not an alert (its skip
        # is train/skipped)
        monitor.screen = screen_loss_scaled

    def keep_loss(self, loss: Any) -> None:
        """One micro-batch's loss (a tensor), kept on the device until the decision."""
        if self.monitor.active and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().reshape(()))

    def count_batch(self, batch: Any) -> None:
        """A micro-batch's size (`batch_sizes`)."""
        self.add_sizes(*batch_sizes(batch))

    def add_sizes(self, samples: int, tokens: int) -> None:
        """A micro-batch of `samples` samples and `tokens` tokens."""
        self._samples += samples
        self._tokens += tokens

    def report_losses(self, combine: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The step's loss: `combine` of the kept micro-batch losses (stacked)."""
        losses, self._losses = self._losses, []
        if self.monitor.active and losses:
            with self.monitor.guard("loss"):
                self.monitor.report_loss(combine(torch.stack(losses)))

    def decide_step(self, optimizer: Any) -> bool:
        """The decision before the trainer's optimizer step (the gradients are read by then).
        True: a `stop` rule fired (the step is then skipped too)."""
        scale = self.loss_scale()
        if scale is not None and self.monitor.active:
            with self.monitor.guard("loss scale"):
                self._scale_before = scale.clone()
                self.monitor.add_tensors([LOSS_SCALE], [scale])
        stop, self._held = decide(self.monitor, self.ranks, optimizer)
        self.stopped = self.stopped or stop
        return stop

    def loss_scale(self) -> torch.Tensor | None:
        """The scale this step's backward multiplied the loss by: the scaler's own device tensor
        (read without a host sync; the scaler updates it after the optimizer step). None
        without a scaler, or before its first use."""
        scale = getattr(self.scaler, "_scale", None)  # GradScaler keeps it there (get_scale() syncs)
        return scale.reshape(()) if isinstance(scale, torch.Tensor) else None

    def finish_step(self, optimizer: Any, overflow: bool = False) -> bool:
        """After the trainer's optimizer step: the gradients back, what the step changed, the
        learning rate (`train/lr`), the throughput and memory; `train/skipped` follows at the
        step's end (`close_step`). `overflow`: the trainer's loss scaler skipped the step. After
        a `stop`, nothing more is measured or closed (as when `TrainingStopped` propagates:
        `close` writes the stopping step); returns False then."""
        self._skipped = bool(self._held) or overflow
        restore_grads(self._held)
        self._held = []
        if self.stopped:
            self._skipped = None
            return False
        monitor = self.monitor
        if monitor.active:
            with monitor.guard("optimizer post-step"):
                measured = {LR: _learning_rate(optimizer), **self._throughput(), **_memory()}
                keys = [key for key, value in measured.items() if value is not None]
                monitor.add_tensors(keys, [monitor.backend.scalar(measured[key]) for key in keys])
        self._step_ended = time.perf_counter()
        self._samples = self._tokens = 0
        if self.reads is not None and optimizer is not None:
            self.reads.after_step(optimizer)
        monitor.after_optimizer_step()
        return True

    def close_step(self, loss: Any) -> Any:
        """At the step's end (a step closer; the loss scaler has updated by then): `train/skipped`,
        1 after a `skip`, or when the loss scaler skipped the step: its scale went down (a device
        comparison, no host sync; GradScaler backs off only on an inf/nan gradient)."""
        skipped, before, self._skipped, self._scale_before = self._skipped, self._scale_before, None, None
        monitor = self.monitor
        if skipped is None or not monitor.active:
            return loss
        with monitor.guard("skipped step"):
            flag = monitor.backend.scalar(1.0 if skipped else 0.0)
            now = self.loss_scale()
            if not skipped and before is not None and now is not None:
                flag = (now < before).to(torch.float32)
            monitor.add_tensors([SKIPPED], [flag])
        return loss

    def step_closed(self) -> None:
        """(A step closer's second call: nothing to do.)"""

    def _throughput(self) -> dict[MetricKey, float | None]:
        """Samples and tokens per second since the previous step's end (none for the first step)."""
        if self._step_ended is None:
            return {}
        seconds = max(time.perf_counter() - self._step_ended, 1e-9)
        return {SAMPLES_PER_S: self._samples / seconds if self._samples else None,
                TOKENS_PER_S: self._tokens / seconds if self._tokens else None}


def unscale_activation_grads(table: StatTable) -> StatTable:
    """`table` with its activation-gradient rows (`ACTIVATION_GRAD_KINDS`) divided by the loss
    scale the step's backward ran with (its `LOSS_SCALE` row, in the same table: both are
    measured before the optimizer step): min, max and sum by s, the sum of squares by s².
    Counts are unchanged, registered columns are left as measured. Without a loss scale: `table`."""
    if LOSS_SCALE not in table.keys:
        return table
    scale = float(table.partials[table.keys.index(LOSS_SCALE), P_MAX])
    rows = np.fromiter((key.kind in ACTIVATION_GRAD_KINDS for key in table.keys), dtype=bool, count=len(table.keys))
    if not (rows.any() and np.isfinite(scale) and scale > 0):
        return table
    partials = table.partials.copy()
    partials[rows] = divide(partials[rows], scale)
    return StatTable(table.keys, partials, ranks=table.ranks)


def screen_loss_scaled(table: StatTable) -> StatTable:
    """A step's table as the rules see it under a loss scaler (GradScaler): activation gradients
    unscaled (`unscale_activation_grads`), an overflow step's loss-scaled rows dropped
    (`steps.overflow.screen_scaler_overflow`)."""
    return screen_scaler_overflow(unscale_activation_grads(table))


def batch_sizes(batch: Any) -> tuple[int, int]:
    """A micro-batch's size, from shapes only (no sync): samples, the first dimension of its
    `input_ids` (else of its first tensor); tokens, the elements of its `input_ids`."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    first = ids if isinstance(ids, torch.Tensor) else _first_tensor(batch)
    samples = first.shape[0] if first is not None and first.dim() > 0 else 0
    return samples, ids.numel() if isinstance(ids, torch.Tensor) else 0


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((item for item in items if isinstance(item, torch.Tensor)), None)


def _memory() -> dict[MetricKey, float | None]:
    """The process's peak resident memory and the device memory torch holds, in MiB: counters
    read on the host (no sync)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    device = torch.cuda.memory_allocated() / 2 ** 20 if torch.cuda.is_initialized() else None
    return {CPU_RSS_MB: rss, DEVICE_MB: device}


def _learning_rate(optimizer: Any) -> float | None:
    """The first parameter group's learning rate (the schedulers' value for this step), or None."""
    groups = getattr(optimizer, "param_groups", None)
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, (int, float)) or (isinstance(lr, torch.Tensor) and lr.numel() == 1) else None


class AlertCount:
    """The number of alert episodes a monitor has started so far (for the trainer's logs,
    under `ALERTS_KEY`): the cumulative count behind `Health/alerts`, so a one-step alert
    stays visible and a resumed run goes on from its saved count."""

    def __init__(self, monitor: Any) -> None:
        self._health = monitor.pipeline.emitter.health  # counts as each step's record is built

    @property
    def total(self) -> int:
        return self._health.started


class ProgressBarHandler(logging.Handler):
    """Writes the monitor's messages with `tqdm.write`, above the trainer's progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a logging handler never raises into the training
            self.handleError(record)


def speak_through_progress_bar() -> ProgressBarHandler | None:
    """While a trainer runs: the monitor's warnings and alerts go through `tqdm.write` (not
    into the middle of the progress bar) when nothing else handles them (logging's last
    resort would print them raw). Returns the handler to remove, or None."""
    logger = logging.getLogger("msprobe_engine")
    if logger.hasHandlers():  # the user configured logging: theirs
        return None
    handler = ProgressBarHandler(logging.WARNING)
    logger.addHandler(handler)
    return handler


def quiet(handler: ProgressBarHandler | None) -> None:
    """Remove the handler `speak_through_progress_bar` added."""
    if handler is not None:
        logging.getLogger("msprobe_engine").removeHandler(handler)


#: settings that name this run's place, not its numerics (config-check would report them all)
RUN_PLACES = ("output_dir", "logging_dir", "run_name", "default_root_dir", "hub_model_id")


def record_hyperparameters(monitor: Any, **sections: Any) -> None:
    """The trainer's hyper-parameters (`sections`: e.g. trainer=..., model=..., optimizer=...)
    into the run's environment.json, where `msprobe-engine config-check` compares them; the
    run's paths and name left out. On the writer thread; nothing on a rank that writes no run."""
    with monitor.guard("hyper-parameters"):
        monitor.record_environment(hyperparameters={
            name: {k: v for k, v in values.items() if k not in RUN_PLACES} if isinstance(values, dict) else values
            for name, values in sections.items() if values is not None})


def optimizer_settings(optimizer: Any) -> dict[str, Any] | None:
    """The torch optimizer's type and defaults (lr, betas, eps, weight_decay, ...), or None."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's and Lightning's wrappers
    defaults = getattr(inner, "defaults", None)
    return {"type": type(inner).__name__, **defaults} if isinstance(defaults, dict) else None


def announce(monitor: Monitor) -> None:
    """Say once, on the writing rank (its run directory exists), where the run is written and
    the command that shows it."""
    if monitor.run_dir.is_dir():
        message = (f"msprobe: writing the run to {monitor.run.root} "
                   f"(view it: msprobe-engine tensorboard --logdir {monitor.config.output_dir})")
        try:
            from tqdm.auto import tqdm

            tqdm.write(message, file=sys.stderr)
        except ImportError:
            print(message, file=sys.stderr)
