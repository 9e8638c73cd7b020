"""Expert parallelism: every rank reports every expert's parameters, in one order.

Under expert parallelism (EP > 1) each rank holds `num_moe_experts / EP` experts of every
MoE layer, named here by their global number (`decoder.layers.3.mlp.experts.local_experts.5`,
see `model.global_layer_names`). The statistics of a step are merged with one set of all-reduces
per group, which needs the same rows on every rank: `complete_experts` puts a placeholder
(an empty tensor, the merge's identity) in place of each expert another rank holds, so
every rank lists each MoE layer's experts 0 .. E-1 with the same parameters. The merge
(`parallel.StatReducer`) then takes an expert's rows from the rank holding it.
"""
from __future__ import annotations

import re
from typing import Sequence

from msprobe_integrations.megatron.optim import Slot

#: `<layer>.mlp.experts.local_experts.<global expert>.<parameter>`
EXPERT_NAME = re.compile(r"^(?P<head>.*\.experts\.local_experts\.)(?P<expert>\d+)(?P<tail>\..+)$")


def is_expert_path(path: str) -> bool:
    return ".experts.local_experts." in path


def complete_experts(slots: Sequence[Slot], experts: int) -> list[Slot]:
    """`slots` with each MoE layer's expert parameters listed for every global expert 0 ..
    `experts` - 1 (this rank's own ones as they are, the others as placeholders), at the place
    of the layer's first expert parameter. The parameters of an expert are those of the first
    local one, in its order (Megatron's experts of one layer are alike)."""
    layers: dict[str, dict[int, dict[str, Slot]]] = {}
    for slot in slots:
        match = EXPERT_NAME.match(slot.name)
        if match:
            layers.setdefault(match["head"], {}).setdefault(int(match["expert"]), {})[match["tail"]] = slot
    out: list[Slot] = []
    done: set[str] = set()
    for slot in slots:
        match = EXPERT_NAME.match(slot.name)
        if not match:
            out.append(slot)
            continue
        head = match["head"]
        if head in done:
            continue
        done.add(head)
        held = layers[head]
        template = held[min(held)]
        for expert in range(experts):
            own = held.get(expert, {})
            out += [own.get(tail) or Slot(f"{head}{expert}{tail}", model.param) for tail, model in template.items()]
    return out
