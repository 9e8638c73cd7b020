"""Expert parallelism: every rank reports every expert's parameters, in one order.

Under expert parallelism (EP > 1) each rank holds `num_moe_experts / EP` experts of every
MoE layer, named here by their global number (`decoder.layers.3.mlp.experts.local_experts.5`,
see `model.global_layer_names`). The statistics of a step are merged with one set of all-reduces
per group, which needs the same rows on every rank: `complete_experts` puts a placeholder
(an empty tensor, the merge's identity) in place of each expert another rank holds, so
every rank lists each MoE layer's experts 0 .. E-1 with the same parameters. The merge
(`parallel.StatReducer`) then takes an expert's rows from the rank holding it.

Grouped-GEMM experts (megatron-core 0.16's `GroupedMLP`, `moe_grouped_gemm`) hold every local
expert of a layer in one `weight1` and one `weight2`, which its forward views as
`[local experts, ...]`: expert j is the j-th flat piece. `split_grouped` reports each piece as
its own parameter under the name Megatron's checkpoints give it
(`decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight` for `weight1`, `linear_fc2`
for `weight2`, in global expert numbering), so its statistics are those of that expert (a
`SequentialMLP` expert's weight transposed: the same values) and EP > 1 merges them as above.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch
from megatron.core.transformer.moe import experts as moe_experts

from msprobe_integrations.megatron.model import Chunk
from msprobe_integrations.megatron.optim import Slot

#: megatron-core's grouped-GEMM experts (0.16; gone from 0.19, where only TEGroupedMLP is left)
GROUPED_MLP = getattr(moe_experts, "GroupedMLP", None)
#: a `GroupedMLP` weight and the per-expert parameter each of its pieces is in Megatron's checkpoints
GROUPED_WEIGHTS = {"weight1": "linear_fc1.weight", "weight2": "linear_fc2.weight"}

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


def grouped_weights(chunks: Sequence[Chunk]) -> dict[int, tuple[str, list[int], str]]:
    """`id(weight)` of every `GroupedMLP` weight of the chunks -> (its experts' global path, the
    layer's `local_expert_indices`, the per-expert parameter it stands for)."""
    found: dict[int, tuple[str, list[int], str]] = {}
    if GROUPED_MLP is None:
        return found
    for chunk in chunks:
        for name, module in chunk.module.named_modules():
            experts, indices = getattr(module, "experts", None), getattr(module, "local_expert_indices", None)
            if isinstance(experts, GROUPED_MLP) and isinstance(indices, list):
                head = chunk.rename(f"{name}.experts" if name else "experts")
                for attr, tail in GROUPED_WEIGHTS.items():
                    weight = getattr(experts, attr, None)
                    if isinstance(weight, torch.nn.Parameter):
                        found[id(weight)] = (head, indices, tail)
    return found


def split_grouped(slots: Sequence[Slot], chunks: Sequence[Chunk], sharded: set[str]) -> tuple[list[Slot], list[str]]:
    """`slots` with each `GroupedMLP` weight replaced by one slot per local expert (see the module
    docstring), and warnings. A weight the distributed optimizer shards (`sharded`: its main tensor
    is a piece of the flat buffer, not of the expert layout) stays whole, under its own name."""
    grouped = grouped_weights(chunks)
    out: list[Slot] = []
    whole: list[str] = []
    for slot in slots:
        found = grouped.get(id(slot.param))
        if found is None or slot.name in sharded:
            out.append(slot)
            if found is not None:
                whole.append(slot.name)
            continue
        head, indices, tail = found
        out += [dataclasses.replace(slot, name=f"{head}.local_experts.{expert}.{tail}", part=(j, len(indices)))
                for j, expert in enumerate(indices)]
    problems = [f"grouped-GEMM expert weights sharded by the distributed optimizer are reported whole, "
                f"not per expert: {', '.join(whole[:3])}" + (", ..." if len(whole) > 3 else "")] if whole else []
    return out, problems
