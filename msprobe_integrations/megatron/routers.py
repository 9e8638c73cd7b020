"""Megatron-core's MoE routers (`TopKRouter`): their health from each routing.

`TopKRouter.forward` computes the logits (`gating`) and hands them to `routing(logits, ...)`,
which returns `(probs, routing_map)` (the map after any capacity drop: a dropped token is no
load). The monitor wraps `routing` on each router instance and measures the logits and the map
(`frameworks.torch.router_hooks.router_rows`) under the router's global name
(`decoder.layers.<i>.mlp.router`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from megatron.core.transformer.moe.router import TopKRouter

from msprobe_engine.frameworks.torch.module_hooks import in_backward
from msprobe_engine.frameworks.torch.router_hooks import RouterSite, router_rows
from msprobe_integrations.megatron.model import Chunk
from msprobe_integrations.megatron.wrapping import MethodWrap

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
                                  score=getattr(config, "moe_router_score_function", "softmax"))
                wraps.append(MethodWrap(module, "routing", after_call=_measure(monitor, site)))
    return wraps


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
