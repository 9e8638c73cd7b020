"""Model chunks: unwrapping Megatron's wrappers and naming with global layer and expert numbers.

A chunk is wrapped in Megatron's `DistributedDataParallel` (grad buffers, `main_grad`) or in its
`TorchFullyShardedDataParallel` (torch FSDP2's `fully_shard` on the layers and the root: the
parameters, their gradients and Adam moments are DTensors sharded over the data-parallel group),
possibly around a `Float16Module`; Megatron's own `FullyShardedDataParallel` is refused.

A pipeline stage (or a virtual-pipeline chunk) holds `decoder.layers.0 ..` with
local indices. Megatron records the global, 1-based number of every transformer
layer in its `layer_number` attribute (offset by the pipeline stage and the
virtual stage); the reported names use it, so `decoder.layers.<i>` always means
the i-th layer of the whole model, whichever stage holds it. Likewise an MoE layer's
`local_expert_indices` (the global numbers of the experts this expert-parallel rank
holds) renames `mlp.experts.local_experts.<j>` to the global expert number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from megatron.core.distributed import (DistributedDataParallel, FullyShardedDataParallel,
                                       TorchFullyShardedDataParallel)
from megatron.core.transformer.module import Float16Module, MegatronModule

#: wrappers whose `.module` is the model; Megatron's DDP also holds the grad buffers
_WRAPPERS = (DistributedDataParallel, TorchFullyShardedDataParallel, Float16Module,
             torch.nn.parallel.DistributedDataParallel)


@dataclass
class Chunk:
    """One model chunk: the innermost module (hooked), its Megatron DDP wrapper, its naming."""
    module: torch.nn.Module
    ddp: DistributedDataParallel | None
    rename: Callable[[str], str]
    #: its `TorchFullyShardedDataParallel` wrapper (torch FSDP2 over `.process_group`), if any
    fsdp: TorchFullyShardedDataParallel | None = None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trainable parameters under their reported (global) names."""
        return [(self.rename(n), p) for n, p in self.module.named_parameters() if p.requires_grad]


def is_expert(param: torch.nn.Parameter) -> bool:
    """Megatron marks expert-parallel (MoE) parameters with `allreduce=False`."""
    return getattr(param, "allreduce", True) is False


def num_experts(chunks: Sequence[Chunk]) -> int:
    """The model's number of experts per MoE layer (`config.num_moe_experts`; 0: no MoE)."""
    for chunk in chunks:
        for module in chunk.module.modules():
            if isinstance(getattr(module, "local_expert_indices", None), list):
                return int(module.config.num_moe_experts)
    return 0


def unwrap_chunks(model_chunks: Any) -> list[Chunk]:
    """Accept one model or a list of chunks (virtual pipeline); raise on anything else."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError("MegatronMonitor: model_chunks is empty; pass the model chunks Megatron built")
    out = []
    for index, obj in enumerate(chunks):
        if not isinstance(obj, torch.nn.Module):
            raise TypeError(f"MegatronMonitor: model chunk {index} is a {type(obj).__name__}, "
                            "not a torch.nn.Module (expected a GPTModel or its DistributedDataParallel)")
        if isinstance(obj, FullyShardedDataParallel):
            raise TypeError(f"MegatronMonitor: model chunk {index} is wrapped in Megatron-FSDP's "
                            "FullyShardedDataParallel, which is not supported (use TorchFullyShardedDataParallel, "
                            "or DistributedDataParallel with use_distributed_optimizer)")
        ddp, fsdp, module = None, None, obj
        while isinstance(module, _WRAPPERS):
            if isinstance(module, DistributedDataParallel) and ddp is None:
                ddp = module
            if isinstance(module, TorchFullyShardedDataParallel) and fsdp is None:
                fsdp = module
            module = module.module
        out.append(Chunk(module, ddp, global_layer_names(module), fsdp))
    return out


def describe_problems(chunks: Sequence[Chunk], tensor_parallel: int, data_parallel: int,
                      stages: int, per_expert: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """Warnings about chunks the monitor can only partly understand (never silent). `per_expert`:
    `id`s of expert parameters outside `experts.local_experts` that are reported per expert."""
    problems = []
    if tensor_parallel > 1 and not any(getattr(p, "tensor_model_parallel", False)
                                       for chunk in chunks for p in chunk.module.parameters()):
        problems.append("no parameter carries Megatron's tensor_model_parallel attribute although the "
                        f"tensor-parallel size is {tensor_parallel}: every parameter is counted as replicated")
    if stages > 1 and not any(isinstance(getattr(m, "layer_number", None), int)
                              for chunk in chunks for m in chunk.module.modules()):
        problems.append("no module carries Megatron's layer_number: names keep their local layer "
                        f"indices and may repeat across the {stages} pipeline stages")
    for index, chunk in enumerate(chunks):
        kind = type(chunk.module).__name__
        if not isinstance(chunk.module, MegatronModule):
            problems.append(f"model chunk {index} ({kind}) is not a Megatron module: its parameters "
                            "carry no tensor-parallel attributes and are treated as replicated")
        grouped = [n for n, p in chunk.module.named_parameters()
                   if is_expert(p) and ".local_experts." not in n and id(p) not in per_expert]
        if grouped:
            problems.append(f"model chunk {index} ({kind}) has expert parameters outside "
                            f"experts.local_experts (grouped GEMM experts, e.g. {grouped[0]}): they are "
                            "named by local position, not by global expert number")
        if chunk.ddp is None and chunk.fsdp is None and data_parallel > 1:
            problems.append(f"model chunk {index} ({kind}) is not wrapped in Megatron's "
                            "DistributedDataParallel although data-parallel size is "
                            f"{data_parallel}: gradients are read from .grad as they are")
    return problems


def global_layer_names(module: torch.nn.Module) -> Callable[[str], str]:
    """Return a function mapping a local module or parameter path to its global name.

    Every submodule at `<list>.<i>` with an int `layer_number` (Megatron's global,
    1-based layer number) is renamed `<list>.<layer_number - 1>`; the j-th of an MoE
    layer's `experts.local_experts` is renamed after `local_expert_indices[j]` (its global
    expert number); other paths keep their name.
    """
    renames: dict[str, str] = {}

    def rename(path: str) -> str:
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            hit = renames.get(".".join(parts[:end]))
            if hit is not None:
                return ".".join([hit, *parts[end:]])
        return path

    for name, sub in module.named_modules():  # parents first: a layer is renamed before its experts
        head, _, index = name.rpartition(".")
        number = getattr(sub, "layer_number", None)
        if head and index.isdigit() and isinstance(number, int):
            renames[name] = f"{rename(head)}.{number - 1}"
        experts = getattr(getattr(sub, "experts", None), "local_experts", None)
        indices = getattr(sub, "local_expert_indices", None)
        if isinstance(experts, torch.nn.ModuleList) and isinstance(indices, list) and len(indices) == len(experts):
            inner = f"{name}.experts.local_experts" if name else "experts.local_experts"
            for j, number in enumerate(indices):
                renames[f"{inner}.{j}"] = f"{rename(inner)}.{number}"
    return rename


def prefix_if_clashing(chunks: list[Chunk]) -> list[str]:
    """Virtual-pipeline chunks must not share a name; if they do, prefix `chunk<i>.` to all of them.

    Returns the warning when names were prefixed.
    """
    seen: dict[str, int] = {}
    clash = None
    for index, chunk in enumerate(chunks):
        for name, _ in chunk.module.named_modules():
            owner = seen.setdefault(chunk.rename(name), index) if name else index
            if owner != index:
                clash = chunk.rename(name)
    if clash is None:
        return []
    for index, chunk in enumerate(chunks):
        chunk.rename = _prefixed(f"chunk{index}.", chunk.rename)
    return [f"model chunks share the name '{clash}' even with global layer numbers; "
            "every name is prefixed with chunk<i>."]


def _prefixed(prefix: str, rename: Callable[[str], str]) -> Callable[[str], str]:
    return lambda path: f"{prefix}{rename(path)}"
