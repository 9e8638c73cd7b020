"""DeepSpeed MoE under expert parallelism: every rank lists every expert's parameters, in one order.

With `MoE(num_experts=E, ep_size=P)` each rank of an expert-parallel group holds E / P experts of
the layer, `<layer>.deepspeed_moe.experts.deepspeed_experts.<j>`. They are named here by their global
number, `ep_rank * num_local_experts + j`, as DeepSpeed's own MoE checkpoints name them
(`DeepSpeedEngine._save_moe_checkpoint`). The step's rows are merged with one pair of all-reduces over
the data-parallel group, which needs the same rows on every rank: `shards.Placed` puts an empty
tensor (the merge's identity) in place of each expert another rank holds. The data-parallel group
is the grid of the expert-data-parallel group (ranks holding the same experts) and the
expert-parallel group, and every piece a rank measures is its own (a ZeRO fragment of the expert,
partitioned over the expert-data-parallel group, or on ZeRO-0 the whole expert on one owner rank of
that group: `expert_groups`), so merging every row over the data-parallel group is the merge over
the expert-data-parallel group followed by the one over the expert-parallel group.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

#: `<layer>.deepspeed_moe.experts.deepspeed_experts.<j>.<parameter>`
EXPERT_NAME = re.compile(r"^(?P<head>(?:.*\.)?experts\.deepspeed_experts\.)(?P<expert>\d+)(?P<tail>\..+)$")
#: the experts' own modules, whose activations are not measured under EP > 1 (each rank runs other
#: experts on other ranks' tokens)
EXPERT_MODULES = r"(^|\.)deepspeed_experts\.\d+(\.|$)"


@dataclass(frozen=True)
class ExpertLayer:
    """One DeepSpeed `MOELayer` with expert parallelism: its experts' path, how many it holds, its
    rank in the expert-parallel group and its expert-data-parallel group."""
    head: str
    local: int
    ep_rank: int
    ep_size: int
    edp_group: object

    @property
    def experts(self) -> int:
        return self.local * self.ep_size


def expert_layers(model: torch.nn.Module, dp_world: int) -> list[ExpertLayer]:
    """The MoE layers of `model` with `ep_size > 1`; a ValueError where the data-parallel group is
    not the expert-data-parallel x expert-parallel grid."""
    from deepspeed.moe.sharded_moe import MOELayer
    from deepspeed.utils import groups

    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, MOELayer) or int(module.ep_size) <= 1:
            continue
        edp = groups._get_expert_data_parallel_group(module.ep_group_name)
        if dist.get_world_size(edp) * int(module.ep_size) != dp_world:
            raise ValueError(f"DeepSpeedMonitor: {name}: expert-parallel size {module.ep_size} x expert-data-"
                             f"parallel size {dist.get_world_size(edp)} is not the data-parallel size {dp_world}")
        layers.append(ExpertLayer(f"{name}.experts.deepspeed_experts." if name else "experts.deepspeed_experts.",
                                  int(module.num_local_experts), dist.get_rank(module.ep_group),
                                  int(module.ep_size), edp))
    return layers


def _expert_of(name: str, by_head: dict[str, ExpertLayer]) -> tuple[ExpertLayer, re.Match] | None:
    """The expert-parallel layer a parameter name belongs to, with the name's parts; None: dense."""
    match = EXPERT_NAME.match(name)
    layer = by_head.get(match["head"]) if match else None
    return None if layer is None else (layer, match)


def global_names(names: Sequence[str], layers: Sequence[ExpertLayer]) -> tuple[list[str], list[int | None]]:
    """Every parameter name with each expert layer's parameters listed for its global experts 0 ..
    E - 1 (at the place of its first expert parameter), and for each the position of this rank's
    own parameter in `names` (None: another rank holds that expert)."""
    by_head = {layer.head: layer for layer in layers}
    experts = [_expert_of(name, by_head) for name in names]
    tails: dict[str, list[str]] = {}
    own: dict[str, int] = {}
    for at, expert in enumerate(experts):
        if expert is None:
            continue
        layer, match = expert
        local = int(match["expert"])
        if local == 0:
            tails.setdefault(layer.head, []).append(match["tail"])
        own[f"{layer.head}{layer.ep_rank * layer.local + local}{match['tail']}"] = at
    out: list[str] = []
    index: list[int | None] = []
    for at, (name, expert) in enumerate(zip(names, experts)):
        if expert is None:
            out.append(name)
            index.append(at)
            continue
        layer, match = expert
        if int(match["expert"]) == 0 and match["tail"] == tails[layer.head][0]:
            full = [f"{layer.head}{e}{tail}" for e in range(layer.experts) for tail in tails[layer.head]]
            out += full
            index += [own.get(n) for n in full]
    return out, index


def expert_groups(names: Sequence[str], layers: Sequence[ExpertLayer]) -> list[tuple[int, int] | None]:
    """For each parameter name: (this rank's rank, the size) of the expert-data-parallel group its
    expert is replicated over, None for a dense parameter (ZeRO-0's owners are chosen within it)."""
    by_head = {layer.head: layer for layer in layers}
    out: list[tuple[int, int] | None] = []
    for name in names:
        expert = _expert_of(name, by_head)
        if expert is None:
            out.append(None)
            continue
        group = expert[0].edp_group
        out.append((dist.get_rank(group), dist.get_world_size(group)))
    return out
