"""``attention_entropy``: for each attention module (its class name holds ``Attention``), the
entropy (nats) of each query's distribution over the keys, ``health/<path>/attn_entropy/<stat>``,
and its largest probability, ``health/<path>/attn_max_prob/<stat>``: of every query when the
forward returns the probabilities as its second output (transformers' eager attention), else,
when it calls ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), recomputed from its
q and k for a sample (`SAMPLED_QUERIES` queries evenly spaced, of the first batch element,
every head; its mask and ``is_causal`` applied; a query masked from every key counts as all
zeros): a cost of ``heads x 16 x keys x head_dim`` multiply-adds per call; other kernels
(flash) are not measured."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from msprobe_engine.frameworks.torch.health_hooks import KIND, Signal, register_signal
from msprobe_engine.frameworks.torch.module_hooks import in_backward
from msprobe_engine.stats.table import MetricKey

#: queries per SDPA call whose attention is recomputed for the entropy
SAMPLED_QUERIES = 16


@register_signal("attention_entropy")
class AttentionEntropy(Signal):
    """A forward pre-hook and hook on every attention module (see the module docstring)."""

    key = "attention_entropy"

    def __init__(self, monitor: Any, model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__(monitor, model, optimizer)
        for path, module in model.named_modules():
            if "Attention" in type(module).__name__:
                sampler = _SdpaSample(self, path or "model")
                self.handles += [module.register_forward_pre_hook(sampler.begin),
                                 module.register_forward_hook(sampler.end, always_call=True)]

    def wants_attention(self) -> bool:
        return self.measuring() and not in_backward()

    def add_attention(self, path: str, probs: torch.Tensor) -> None:
        """Rows of the entropy and the largest probability of each query of `probs` [..., keys]."""
        with self.monitor.guard("attention entropy hook"), torch.no_grad():
            p = probs.detach().float()
            entropy = -torch.special.xlogy(p, p).sum(-1)
            self.monitor.add_tensors([MetricKey(KIND, path, "attn_entropy"), MetricKey(KIND, path, "attn_max_prob")],
                                     [entropy, p.amax(-1)])


class _SdpaSample(TorchFunctionMode):
    """Around one attention module's forward: its returned probabilities, or (SDPA) a sample
    recomputed from the q and k it passes to ``scaled_dot_product_attention``."""

    def __init__(self, signal: AttentionEntropy, path: str) -> None:
        super().__init__()
        self.signal, self.path = signal, path
        self.on = self.entered = False
        self.sampled = False
        #: the module returned its probabilities last time: no mode needed (eager attention)
        self.returns_probs = False

    def begin(self, module: torch.nn.Module, args: Any) -> None:
        if self.signal.wants_attention() and not self.on:
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
            self.signal.add_attention(self.path, probs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.sampled:
            self.sampled = True
            with self.signal.monitor.guard("attention entropy hook"), torch.no_grad():
                self.signal.add_attention(self.path, _sampled_probs(*args, **kwargs))
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
