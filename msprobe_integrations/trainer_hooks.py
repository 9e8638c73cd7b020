"""Pieces the trainer callbacks (HF Trainer, Lightning) share: hook handles as one
attachment, and the decision before an optimizer step the trainer runs (the ranks agreeing
under DDP; `skip` applied by setting the gradients aside)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.frameworks.torch.optimizer_hooks import HeldGrads, set_aside_grads
from msprobe_engine.incident.actions import TrainingStopped

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


class Handles:
    """torch hook handles, removed together (a `Monitor` attachment)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def agree(skip: bool, stop: bool) -> tuple[bool, bool]:
    """DDP: every rank decides on its own loss and activations; all take the most cautious
    decision (one all-reduce of two flags over the default group)."""
    import torch.distributed as dist

    flags = torch.tensor([float(skip or stop), float(stop)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def decide(monitor: "Monitor", ranks: int, optimizer: Any) -> tuple[bool, HeldGrads]:
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
    if deciding and ranks > 1:
        skip, stop = agree(skip, stop)
    if not skip or optimizer is None:
        return stop, []
    return stop, set_aside_grads(p for group in optimizer.param_groups for p in group["params"])


def resumed_config(config: ConfigSource, resumed: bool) -> ConfigSource:
    """`config`, with `resume: true` when the trainer restores a checkpoint: the run's directory
    then holds that run, which the monitor continues instead of refusing it."""
    return dataclasses.replace(load_config(config), resume=True) if resumed else config
