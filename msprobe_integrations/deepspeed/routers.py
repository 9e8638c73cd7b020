"""DeepSpeed MoE's gates (`deepspeed.moe.sharded_moe.TopKGate`, inside `deepspeed.moe.layer.MoE`):
their health from each routing.

`TopKGate.forward(input, ...)` computes its logits inside (`input @ wg.weight.T`, in float32)
and returns the routing: `(l_aux, capacity, experts, indices, locations, gates, exp_counts)`
with sparse routes (what `MOELayer` asks for: `indices` [k, tokens], -1 where the capacity
dropped the route), else `(l_aux, combine_weights, dispatch_mask, exp_counts)` (`dispatch_mask`
[tokens, experts, capacity]). A forward hook on each gate recomputes the logits from its input
and `wg` (one small matmul, tokens x model_dim x experts; with `noisy_gate_policy="Jitter"` the
jitter is left out), takes the experts each token reached from the routing, and `l_aux` as the
router's `aux_loss`; `drop_tokens` says whether the gate has a capacity (`dropped`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from msprobe_engine.frameworks.torch.router_hooks import RouterHooks, RouterSite

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


def find_gates(model: torch.nn.Module) -> list[RouterSite]:
    """A `RouterSite` for every DeepSpeed `TopKGate` in `model`, under its module path."""
    from deepspeed.moe.sharded_moe import TopKGate

    return [RouterSite(name, module, int(module.wg.out_features), int(module.k), read=_read_gate(module),
                       capacity=bool(module.drop_tokens))
            for name, module in model.named_modules() if isinstance(module, TopKGate)]


def attach_gates(monitor: "Monitor", model: torch.nn.Module) -> list[RouterHooks]:
    """The gate hooks of `model` when `watch.routers` is on and it has DeepSpeed MoE layers."""
    sites = find_gates(model) if monitor.config.watch.routers else []
    return [RouterHooks(monitor, sites)] if sites else []


def _read_gate(gate: torch.nn.Module):
    def read(args: tuple, output: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = torch.nn.functional.linear(args[0].detach().float(), gate.wg.weight.detach().float())
        return logits, _reached(output, logits.shape[-1]), output[0]

    return read


def _reached(output: tuple, experts: int) -> torch.Tensor:
    """The [tokens, experts] map of the routes the capacity kept."""
    if len(output) == 7:  # sparse routes: indices [k, tokens], -1 for a dropped route
        indices = output[3].long()
        slots = torch.where(indices >= 0, indices, experts).t()  # a dropped route goes to column `experts`
        reached = torch.zeros(slots.shape[0], experts + 1, dtype=torch.bool, device=slots.device)
        return reached.scatter_(1, slots, True)[:, :experts]
    if len(output) == 4:  # dense: dispatch_mask [tokens, experts, capacity]
        return output[2].any(dim=-1)
    raise TypeError(f"a DeepSpeed TopKGate returning 4 or 7 values was expected, got {len(output)}")
