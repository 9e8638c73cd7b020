"""``stable_rank_every: N``: every N-th monitored step, before the optimizer step, the stable rank
``||W||_F^2 / sigma_max(W)^2`` of each 2-D trainable weight, ``health/<param>/stable_rank/<stat>``;
sigma_max by `stable_rank_iterations` power iterations from the previous step's vector (a warm
start: the estimate converges over the steps; it never exceeds the true sigma_max, so the
reported stable rank is an upper bound that tightens)."""
from __future__ import annotations

from typing import Any

import torch

from msprobe_engine.frameworks.torch.health_hooks import KIND, Signal, register_signal, trainable_params
from msprobe_engine.stats.table import MetricKey


@register_signal("stable_rank")
class StableRank(Signal):
    """An optimizer step pre-hook; power-iteration vectors kept from one measurement to the next."""

    key = "stable_rank_every"
    options = ("stable_rank_iterations",)
    needs_optimizer = True

    def __init__(self, monitor: Any, model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__(monitor, model, optimizer)
        self.weights = [(name, p) for name, p in trainable_params(model) if p.dim() == 2]
        self._vectors: dict[str, torch.Tensor] = {}
        self.handles.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not (self.measuring() and self.monitor.step % self.config.stable_rank_every == 0 and self.weights):
            return
        with self.monitor.guard("stable rank pre-step hook"), torch.no_grad():
            self.monitor.add_tensors([MetricKey(KIND, name, "stable_rank") for name, _ in self.weights],
                                     [self._stable_rank(name, p.detach()) for name, p in self.weights])

    def _stable_rank(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        w = weight.float()
        v = self._vectors.get(name)
        if v is None or v.shape[0] != w.shape[1] or v.device != w.device:
            generator = torch.Generator(device=w.device).manual_seed(len(self._vectors))
            v = torch.randn(w.shape[1], device=w.device, generator=generator)
        sigma = torch.zeros((), device=w.device)
        for _ in range(self.config.stable_rank_iterations):
            u = w @ v
            u = u / u.norm().clamp_min(1e-30)
            v = w.t() @ u
            sigma = v.norm()
            v = v / sigma.clamp_min(1e-30)
        self._vectors[name] = v
        return w.square().sum() / sigma.square().clamp_min(1e-30)
