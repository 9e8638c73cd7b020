"""Mixture-of-experts routers: where they are, and their health measured on the device.

`find_routers(model)` finds the routers of transformers' MoE models by what they are, not by
their class names: a module with int `top_k` and `num_experts` whose forward returns
`(router_logits, router_scores, router_indices)` (transformers 5: Mixtral, Qwen2-MoE,
Qwen3-MoE, ...), or an MoE block with int `top_k` (or `num_experts_per_tok`) and
`num_experts`, whose `gate` is an `nn.Linear` with `num_experts` outputs (the router logits;
transformers 4). Megatron-core's `TopKRouter` is found by the Megatron adapter, which feeds
`router_rows` from its routing.

Per router and micro-batch, `router_rows` makes the rows `stats.router` describes: the
load of each expert (token assignments, no host sync), the normalised entropy of the router's
distribution per token, the mean probability of the chosen experts per token and the squared
log-sum-exp of its logits (z-loss); for a router with a capacity (`RouterSite.capacity`), the
assignments it dropped (tokens x top-k less those kept: `chosen` is then the map after the
drop). The distribution is the softmax of the logits (`score="sigmoid"`: sigmoid scores,
normalised). A framework's load-balancing loss, where it computes one, is the `aux_loss` row
(`RouterSite.aux_key`).

transformers computes its MoE models' load-balancing loss once per model, over every router's
logits at once (`load_balancing_loss_func`, when `output_router_logits` is set): the output's
`aux_loss`, before `router_aux_loss_coef`. It is a model-level row, `router/<model>/aux_loss`
(`<model>`: the path of the outermost module whose config has `output_router_logits`, `model`
for the root), read by a forward hook on that module (`ModelAuxLoss`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from msprobe_engine.frameworks.torch.module_hooks import in_backward
from msprobe_engine.handles import Handles
from msprobe_engine.stats import router
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

#: the path of the model-level aux loss of a root model (`find_moe_models`)
MODEL = "model"


@dataclass
class RouterSite:
    """One router: its reported path, its module, its expert count and top-k, whether it drops
    tokens beyond a capacity, and how a forward hook reads it (`read(args, output) -> (logits,
    chosen, aux_loss or None)`; None when the router's own forward is not hooked). `keys`: the
    rows of `router_rows`, in order; `aux_key`: the row of the framework's aux loss."""
    path: str
    module: torch.nn.Module
    experts: int
    top_k: int
    score: str = "softmax"
    read: Callable[[tuple, object], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
    capacity: bool = False
    keys: list[MetricKey] = field(init=False)
    aux_key: MetricKey = field(init=False)

    def __post_init__(self) -> None:
        roles = [router.ENTROPY, router.TOPK_PROB, router.Z_LOSS] + ([router.DROPPED] if self.capacity else [])
        self.keys = [router.load_key(self.path, e) for e in range(self.experts)] + [
            MetricKey(router.KIND, self.path, role) for role in roles]
        self.aux_key = MetricKey(router.KIND, self.path, router.AUX_LOSS)


def find_routers(model: torch.nn.Module, rename: Callable[[str], str] = str) -> list[RouterSite]:
    """transformers' routers in `model` (see the module docstring), under `rename(path)`."""
    sites: list[RouterSite] = []
    taken: set[int] = set()
    for name, module in model.named_modules():
        experts = _int(module, "num_experts")
        top_k = _int(module, "top_k") or _int(module, "num_experts_per_tok")
        if not (experts and top_k) or id(module) in taken:
            continue
        gate = getattr(module, "gate", None)
        if isinstance(gate, torch.nn.Linear) and gate.out_features == experts:  # a block and its logits
            taken.add(id(gate))
            sites.append(RouterSite(rename(f"{name}.gate" if name else "gate"), gate, experts, top_k,
                                    read=_logits_only(top_k)))
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.shape[0] == experts:
            taken.add(id(module))  # a router module of its own: (logits, scores, indices)
            sites.append(RouterSite(rename(name), module, experts, top_k, read=_logits_and_indices))
    return sites


def router_rows(site: RouterSite, logits: torch.Tensor, chosen: torch.Tensor) -> list[torch.Tensor]:
    """The rows' tensors (in `site.keys` order) for one routing: `logits` [..., experts], `chosen`
    the experts each token was sent to, as indices [..., k] or as a boolean map [..., experts]
    (after the capacity's drop, for a router with one: its top-k probability is then that of
    the `top_k` most probable experts)."""
    experts = site.experts
    with torch.no_grad():
        logits = logits.detach().reshape(-1, experts).float()
        z_loss = torch.logsumexp(logits, dim=-1).square()
        if site.score == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            probs = torch.softmax(logits, dim=-1)
        entropy = torch.special.entr(probs).sum(-1) / math.log(experts) if experts > 1 else probs[:, 0] * 0
        chosen = chosen.detach()
        if chosen.dtype == torch.bool:
            routed = chosen.reshape(-1, experts)
            loads = routed.sum(0, dtype=torch.float32)
            if site.capacity:  # the map lacks the dropped choices: the router's own top-k
                top = probs.topk(site.top_k, dim=-1).values.mean(-1)
            else:
                top = (probs * routed).sum(-1) / site.top_k
        else:
            index = chosen.reshape(-1, chosen.shape[-1]).long()
            loads = torch.zeros(experts, device=probs.device).index_add_(
                0, index.flatten(), torch.ones(index.numel(), device=probs.device))
            top = probs.gather(1, index).mean(-1)
        rows = [*loads.unbind(), entropy, top, z_loss]
        if site.capacity:
            rows.append(logits.shape[0] * site.top_k - loads.sum())
    return rows


class RouterHooks(Handles):
    """Forward hooks on routers that return their logits (and chosen experts)."""

    def __init__(self, monitor: "Monitor", sites: list[RouterSite]) -> None:
        self.monitor = monitor
        self.sites = sites
        self.handles = [site.module.register_forward_hook(self._make_hook(site)) for site in sites
                        if site.read is not None]

    def _make_hook(self, site: RouterSite):
        monitor = self.monitor
        where = f"router hook of {site.path}"

        def hook(module, args, output):
            if not monitor.active or where in monitor.disabled or in_backward():  # recomputation: counted once
                return
            try:
                logits, chosen, aux_loss = site.read(args, output)
                rows = router_rows(site, logits, chosen)
                if aux_loss is None:
                    monitor.add_tensors(site.keys, rows)
                else:
                    monitor.add_tensors([*site.keys, site.aux_key], [*rows, aux_loss.detach().float()])
            except Exception as exc:
                monitor.hook_failed(where, exc)

        return hook


class ModelAuxLoss(Handles):
    """A forward hook on each transformers MoE model reading its output's `aux_loss` (a tensor when
    the model computed one) into the model-level row `router/<path>/aux_loss`."""

    def __init__(self, monitor: "Monitor", models: list[tuple[str, torch.nn.Module]]) -> None:
        self.monitor = monitor
        self.handles = [module.register_forward_hook(self._make_hook(path)) for path, module in models]

    def _make_hook(self, path: str):
        monitor = self.monitor
        key = MetricKey(router.KIND, path, router.AUX_LOSS)
        where = f"aux loss hook of {path}"

        def hook(module, args, output):
            if not monitor.active or where in monitor.disabled or in_backward():
                return
            loss = getattr(output, "aux_loss", None)
            if isinstance(loss, torch.Tensor):
                try:
                    monitor.add_tensors([key], [loss.detach().float()])
                except Exception as exc:
                    monitor.hook_failed(where, exc)

        return hook


def find_moe_models(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules of `model` whose `config` has transformers' `output_router_logits`,
    under their reported path (`model` for the root)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():  # parents first
        inside = any(not outer or name.startswith(f"{outer}.") for outer, _ in found)
        if not inside and hasattr(getattr(module, "config", None), "output_router_logits"):
            found.append((name, module))
    return [(name or MODEL, module) for name, module in found]


def _logits_and_indices(args: tuple, output) -> tuple[torch.Tensor, torch.Tensor, None]:
    if not (isinstance(output, tuple) and len(output) >= 2 and not output[-1].is_floating_point()):
        raise TypeError("a router returning (router_logits, ..., router_indices) was expected, got "
                        f"{type(output).__name__}")
    return output[0], output[-1], None


def _logits_only(top_k: int) -> Callable[[tuple, torch.Tensor], tuple[torch.Tensor, torch.Tensor, None]]:
    def read(args: tuple, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return logits, torch.topk(logits.detach(), top_k, dim=-1).indices, None  # the softmax keeps the order

    return read


def _int(module: torch.nn.Module, name: str) -> int:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def attach_routers(monitor: "Monitor", model: torch.nn.Module) -> list[RouterHooks | ModelAuxLoss]:
    """The router hooks of `model` when `watch.routers` is on and it has transformers-style routers,
    and the hook of its model-level aux loss."""
    sites = find_routers(model) if monitor.config.watch.routers else []
    if not sites:
        return []
    models = find_moe_models(model)
    return [RouterHooks(monitor, sites), *([ModelAuxLoss(monitor, models)] if models else [])]
