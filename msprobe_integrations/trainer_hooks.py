"""Pieces the trainer callbacks (HF Trainer, Lightning) share: the decision before an optimizer
step the trainer runs (the ranks agreeing under DDP; `skip` applied by setting the gradients
aside)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.frameworks.torch.distributed import agree_flags
from msprobe_engine.frameworks.torch.optimizer_hooks import HeldGrads, set_aside_grads
from msprobe_engine.incident.actions import TrainingStopped

if TYPE_CHECKING:
    from msprobe_engine.contract import MonitorPort


def decide(monitor: "MonitorPort", ranks: int, optimizer: Any) -> tuple[bool, HeldGrads]:
    """`monitor.before_optimizer_step()` for a trainer that has no way to skip a step:
    returns (stop, the gradients set aside). A `stop` skips the step too, and is returned
    instead of raised, for the trainer's own way of ending; `skip` sets `optimizer`'s
    gradients aside (torch.optim leaves those parameters untouched), for `restore_grads`
    after the step. Under DDP (`ranks` > 1) the ranks agree first."""
    deciding = monitor.active and monitor.decide_early
    stop = False
    try:
        skip = monitor.before_optimizer_step().skip
    except TrainingStopped:
        skip = stop = True
    if deciding and ranks > 1:  # DDP: every rank decided on its own loss and activations
        skip, stop = agree_flags(skip, stop)
    if not skip or optimizer is None:
        return stop, []
    return stop, set_aside_grads(p for group in optimizer.param_groups for p in group["params"])


def resumed_config(config: ConfigSource, resumed: bool) -> ConfigSource:
    """`config`, with `resume: true` when the trainer restores a checkpoint: the run's directory
    then holds that run, which the monitor continues instead of refusing it."""
    return dataclasses.replace(load_config(config), resume=True) if resumed else config
