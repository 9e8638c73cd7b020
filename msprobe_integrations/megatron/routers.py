"""Megatron-core's MoE routers (`TopKRouter`): their health from each routing.

`TopKRouter.forward` computes the logits (`gating`) and hands them to `routing(logits, ...)`,
which returns `(probs, routing_map)` (the map after any capacity drop: a dropped token is no
load, and with `moe_expert_capacity_factor` set the router has a capacity: `dropped`). The
monitor wraps `routing` on each router instance and measures the logits and the map
(`frameworks.torch.router_hooks.router_rows`) under the router's global name
(`decoder.layers.<i>.mlp.router`). Inside `routing`, Megatron hands each load-balancing loss it
computes to the router's `attach_and_log_load_balancing_loss(activation, coeff, aux_loss, name,
...)`; that is wrapped too: `aux_loss / coeff` (the value Megatron logs) of the per-micro-batch
kinds (`load_balancing_loss`, `seq_load_balancing_loss`; not the global-batch one) is the
router's `aux_loss` row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from megatron.core.transformer.moe.router import TopKRouter

from msprobe_engine.frameworks.torch.module_hooks import in_backward
from msprobe_engine.frameworks.torch.router_hooks import RouterSite, router_rows
from msprobe_integrations.megatron.model import Chunk
from msprobe_integrations.megatron.wrapping import MethodWrap

#: the router method Megatron gives each load-balancing loss to (0.16 and 0.19), its leading parameters,
#: and the loss kinds computed per micro-batch
AUX_METHOD = "attach_and_log_load_balancing_loss"
AUX_PARAMETERS = ("activation", "aux_loss_coeff", "aux_loss", "aux_loss_name")
AUX_KINDS = ("load_balancing_loss", "seq_load_balancing_loss")

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


def watch_routers(monitor: "Monitor", chunks: Sequence[Chunk]) -> list[MethodWrap]:
    """Wrap `routing` of every `TopKRouter` of the chunks (none when `watch.routers` is off)."""
    if not monitor.config.watch.routers:
        return []
    wraps = []
    for chunk in chunks:
        for name, module in chunk.module.named_modules():
            if isinstance(module, TopKRouter):
                config = module.config
                site = RouterSite(chunk.rename(name), module, int(config.num_moe_experts), int(module.topk),
                                  score=getattr(config, "moe_router_score_function", "softmax"),
                                  capacity=getattr(config, "moe_expert_capacity_factor", None) is not None)
                wraps.append(MethodWrap(module, "routing", after_call=_measure(monitor, site)))
                if callable(getattr(module, AUX_METHOD, None)):
                    wraps.append(MethodWrap(module, AUX_METHOD, after_call=_measure_aux(monitor, site)))
    return wraps


def _measure_aux(monitor: "Monitor", site: RouterSite):
    where = f"aux loss hook of {site.path}"

    def after(args: tuple, kwargs: dict, result: Any) -> Any:
        if monitor.active and where not in monitor.disabled and not in_backward():
            try:
                values = dict(zip(AUX_PARAMETERS, args), **kwargs)
                if values["aux_loss_name"] in AUX_KINDS and values["aux_loss_coeff"]:
                    loss = values["aux_loss"].detach().float() / float(values["aux_loss_coeff"])
                    monitor.add_tensors([site.aux_key], [loss])
            except Exception as exc:
                monitor.hook_failed(where, exc)
        return result

    return after


def _measure(monitor: "Monitor", site: RouterSite):
    where = f"router hook of {site.path}"

    def after(args: tuple, kwargs: dict, result: Any) -> Any:
        if monitor.active and where not in monitor.disabled and not in_backward():
            try:
                logits = args[0] if args else kwargs["logits"]
                monitor.add_tensors(site.keys, router_rows(site, logits, result[1]))
            except Exception as exc:
                monitor.hook_failed(where, exc)
        return result

    return after
