"""Model-health signals (``watch.health``), measured on the device and summarised by the statistics.

Each signal adds rows (`MetricKey`) whose values are derived tensors; the configured statistics
(`stats:` mean, max, min, ...) summarise them like any other row, so no host sync is added and
micro-batches and ranks merge as usual. All are off by default (docs/model_health.md):

- ``attention_entropy``: for each attention module (its class name holds ``Attention``), the
  entropy (nats) of each query's distribution over the keys, ``health/<path>/attn_entropy/<stat>``,
  and its largest probability, ``health/<path>/attn_max_prob/<stat>``: of every query when the
  forward returns the probabilities as its second output (transformers' eager attention), else,
  when it calls ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), recomputed from its
  q and k for a sample (`SAMPLED_QUERIES` queries evenly spaced, of the first batch element,
  every head; its mask and ``is_causal`` applied; a query masked from every key counts as all
  zeros): a cost of ``heads x 16 x keys x head_dim``
  multiply-adds per call; other kernels (flash) are not measured;
- ``stable_rank_every: N``: every N-th monitored step, before the optimizer step, the stable rank
  ``||W||_F^2 / sigma_max(W)^2`` of each 2-D trainable weight, ``health/<param>/stable_rank/<stat>``;
  sigma_max by `stable_rank_iterations` power iterations from the previous step's vector (a warm
  start: the estimate converges over the steps; it never exceeds the true sigma_max, so the
  reported stable rank is an upper bound that tightens);
- ``mg_direction``: before the optimizer step, per parameter, the predecessor's ``mg_direction``
  ``(sum(sign(grad) * sign(exp_avg)) / numel + 1) / 2`` (exp_avg: Adam's first moment from the
  previous step, SGD's momentum buffer): the share of elements whose gradient agrees in sign with
  the momentum, zeros counting half; one number per parameter, so every statistic of
  ``optim/<param>/mg_direction/<stat>`` is it; nothing at the first step (no moment yet);
- ``micro_batch_grads``: the gradient each backward pass adds, all parameters together, per
  micro-batch ``k`` (1, 2, ... within the step, counted by the model's forward calls with
  autograd on), ``health/grad_micro_batch/<k>/norm`` (its norm; the other statistics too).
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from msprobe_engine.frameworks.torch import compiled_hooks
from msprobe_engine.frameworks.torch.module_hooks import in_backward
from msprobe_engine.frameworks.torch.optimizer_hooks import STATE_NAMES
from msprobe_engine.handles import Handles
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.contract import MonitorPort

KIND = "health"
MICRO_BATCH_PATH = "grad_micro_batch"
#: queries per SDPA call whose attention is recomputed for the entropy
SAMPLED_QUERIES = 16


def attach_health(monitor: "MonitorPort", model: torch.nn.Module, optimizer: Any) -> list["HealthHooks"]:
    """The hooks of the signals `monitor.config.watch.health` turns on (none: an empty list)."""
    health = monitor.config.watch.health
    if not (health.attention_entropy or health.stable_rank_every or health.mg_direction or health.micro_batch_grads):
        return []
    return [HealthHooks(monitor, model, optimizer)]


class HealthHooks(Handles):
    """The model-health signals of one model and optimizer (see the module docstring)."""

    def __init__(self, monitor: "MonitorPort", model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__()
        self.monitor = monitor
        self.config = monitor.config.watch.health
        self.params = [(compiled_hooks.clean_path(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self._vectors: dict[str, torch.Tensor] = {}  # power-iteration vectors, kept from step to step
        self._micro_step = (-1, 0)  # (step, micro-batches seen in it)
        if self.config.attention_entropy:
            for path, module in model.named_modules():
                if "Attention" in type(module).__name__:
                    sampler = _SdpaSample(self, path or "model")
                    self.handles += [module.register_forward_pre_hook(sampler.begin),
                                     module.register_forward_hook(sampler.end, always_call=True)]
        if self.config.micro_batch_grads:
            self.handles.append(model.register_forward_pre_hook(self._forward_begins))
            self.handles += [p.register_hook(self._micro_batch_grad) for _, p in self.params]
        if optimizer is not None and (self.config.stable_rank_every or self.config.mg_direction):
            self.handles.append(optimizer.register_step_pre_hook(self._before_step))

    # ---- attention ------------------------------------------------------------------------------
    def wants_attention(self) -> bool:
        monitor = self.monitor
        return monitor.active and not monitor.replaying and not in_backward()

    def add_attention(self, path: str, probs: torch.Tensor) -> None:
        """Rows of the entropy and the largest probability of each query of `probs` [..., keys]."""
        with self.monitor.guard("attention entropy hook"), torch.no_grad():
            p = probs.detach().float()
            entropy = -torch.special.xlogy(p, p).sum(-1)
            self.monitor.add_tensors([MetricKey(KIND, path, "attn_entropy"), MetricKey(KIND, path, "attn_max_prob")],
                                     [entropy, p.amax(-1)])

    # ---- before the optimizer step: stable rank, mg_direction -----------------------------------
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        monitor = self.monitor
        if not monitor.active or monitor.replaying:
            return
        with monitor.guard("model health pre-step hook"), torch.no_grad():
            keys: list[MetricKey] = []
            tensors: list[torch.Tensor] = []
            every = self.config.stable_rank_every
            if every and monitor.step % every == 0:
                for name, p in self.params:
                    if p.dim() == 2:
                        keys.append(MetricKey(KIND, name, "stable_rank"))
                        tensors.append(self._stable_rank(name, p.detach()))
            if self.config.mg_direction:
                for name, p in self.params:
                    moment = _moment(optimizer.state.get(p, {}))
                    if p.grad is not None and moment is not None:
                        keys.append(MetricKey("optim", name, "mg_direction"))
                        agree = (p.grad.sign() * moment.sign()).sum(dtype=torch.float32) / max(moment.numel(), 1)
                        tensors.append(agree.add_(1).mul_(0.5))
            if keys:
                monitor.add_tensors(keys, tensors)

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

    # ---- per micro-batch gradients -------------------------------------------------------------
    def _forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not in_backward():
            step, seen = self._micro_step
            self._micro_step = (self.monitor.step, (seen if step == self.monitor.step else 0) + 1)

    def _micro_batch_grad(self, grad: torch.Tensor) -> None:
        monitor = self.monitor
        if monitor.active and not monitor.replaying:
            with monitor.guard("micro-batch gradient hook"):
                monitor.add_tensors([MetricKey(KIND, MICRO_BATCH_PATH, str(max(self._micro_step[1], 1)))],
                                    [grad.detach()])


class _SdpaSample(TorchFunctionMode):
    """Around one attention module's forward: its returned probabilities, or (SDPA) a sample
    recomputed from the q and k it passes to ``scaled_dot_product_attention``."""

    def __init__(self, hooks: HealthHooks, path: str) -> None:
        super().__init__()
        self.hooks, self.path = hooks, path
        self.on = self.entered = False
        self.sampled = False
        #: the module returned its probabilities last time: no mode needed (eager attention)
        self.returns_probs = False

    def begin(self, module: torch.nn.Module, args: Any) -> None:
        if self.hooks.wants_attention() and not self.on:
            self.on, self.sampled, self.entered = True, False, not self.returns_probs
            if self.entered:
                self.__enter__()

    def end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.on:
            return
        self.on = False
        if self.entered:
            self.__exit__(None, None, None)
        probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        self.returns_probs = isinstance(probs, torch.Tensor) and probs.dim() >= 3 and probs.is_floating_point()
        if not self.sampled and self.returns_probs:
            self.hooks.add_attention(self.path, probs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.sampled:
            self.sampled = True
            with self.hooks.monitor.guard("attention entropy hook"), torch.no_grad():
                self.hooks.add_attention(self.path, _sampled_probs(*args, **kwargs))
        return func(*args, **kwargs)


def _sampled_probs(query: torch.Tensor, key: torch.Tensor, value: Any = None, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """The attention probabilities of `SAMPLED_QUERIES` queries of the first batch element, every
    head, as SDPA computes them (before dropout): [heads, sampled, keys]."""
    q, k = query.detach()[0].float(), key.detach()[0].float()  # [heads, L, d], [kv heads, S, d]
    if k.shape[0] != q.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    length, keys = q.shape[-2], k.shape[-2]
    rows = torch.linspace(0, length - 1, min(SAMPLED_QUERIES, length), device=q.device).round().long()
    scores = (q[:, rows] @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        allowed = torch.arange(keys, device=q.device)[None, :] <= rows[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    if isinstance(attn_mask, torch.Tensor):
        mask = attn_mask.detach()
        mask = mask.expand(*mask.shape[:-2], length, keys) if mask.dim() >= 2 else mask
        mask = mask.reshape(-1, length, keys)[0] if mask.dim() > 2 else mask  # first batch element (broadcast heads)
        mask = mask[rows]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a query that may see no key: zeros, not nan


def _moment(state: dict) -> torch.Tensor | None:
    """The optimizer's first moment of a parameter (Adam's exp_avg, SGD's momentum buffer)."""
    for key, ours in STATE_NAMES.items():
        value = state.get(key)
        if ours == "exp_avg" and isinstance(value, torch.Tensor):
            return value
    return None
