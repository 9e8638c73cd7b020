"""Where a DeepSpeed engine keeps this rank's pieces of gradients, fp32 parameters and optimizer state.

A reader lists, for every trainable parameter (the same names in the same order
on every data-parallel rank), the piece of the tensor this rank measures: its
ZeRO shard, or, for tensors every rank holds whole (ZeRO-0), the whole tensor
on the one rank that owns it and an empty tensor elsewhere. Merging the
pieces' partial statistics across the ranks (min of mins, max of maxes, sums
add) gives exactly the statistics of the full tensors, without gathering them.

Gradients are read at the accumulation boundary before `engine.step()`, still
multiplied by the fp16 loss scale; parameters and optimizer state after it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from msprobe_integrations.deepspeed.experts import ExpertLayer, expert_groups, global_names


class ShardReader(ABC):
    """The pieces of one engine's tensors that this rank measures, in `names` order."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], inner_optimizer,
                 device: torch.device) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self._inner = inner_optimizer
        #: what this rank measures of a tensor it holds no piece of (statistics: the merge identity)
        self.empty = torch.empty(0, device=device)

    @abstractmethod
    def grads(self) -> list[torch.Tensor]:
        """Gradient pieces (at the accumulation boundary, before the step)."""

    @abstractmethod
    def masters(self) -> list[torch.Tensor]:
        """fp32 (master) parameter pieces, as the optimizer updates them."""

    @abstractmethod
    def state(self, key: str) -> list[torch.Tensor]:
        """Pieces of the optimizer state `key` (a torch.optim state name, e.g. exp_avg)."""

    def state_keys(self) -> set[str]:
        """Per-element optimizer states that exist now (none before the first applied step).

        Read from the wrapped torch optimizer, whose state every rank holds for its
        own partition, so the answer is the same on every rank."""
        return {key for values in self._inner.state.values() for key, value in values.items()
                if isinstance(value, torch.Tensor) and value.dim() > 0}


class ReplicatedReader(ShardReader):
    """ZeRO-0: every rank holds whole tensors; each parameter is measured by one owner rank.

    `masters` maps a model parameter to the fp32 tensor the optimizer steps (itself for
    an fp32 torch optimizer, the fp32 copy for DeepSpeed's fp16/bf16 wrapper)."""

    def __init__(self, named_params, inner_optimizer, device, masters: dict[int, torch.Tensor],
                 rank: int, world: int, groups: Sequence[tuple[int, int] | None] = ()) -> None:
        super().__init__(named_params, inner_optimizer, device)
        # owners are chosen within the ranks holding a copy: the data-parallel group, or an expert's
        # expert-data-parallel group (`groups`, None for a dense parameter)
        groups = list(groups) or [None] * len(self.params)
        self._mine = [False] * len(self.params)
        for group in set(groups):
            at = [i for i, g in enumerate(groups) if g == group]
            mine, size = group or (rank, world)
            owners = balanced_owners([self.params[i].numel() for i in at], size)
            for i, owner in zip(at, owners):
                self._mine[i] = owner == mine
        self._masters = [masters.get(id(p)) for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad if mine and p.grad is not None else self.empty for p, mine in zip(self.params, self._mine)]

    def masters(self) -> list[torch.Tensor]:
        return [m.detach() if mine and m is not None else self.empty for m, mine in zip(self._masters, self._mine)]

    def state(self, key: str) -> list[torch.Tensor]:
        state = self._inner.state
        return [state[m].get(key, self.empty) if mine and m is not None and m in state else self.empty
                for m, mine in zip(self._masters, self._mine)]


class FragmentReader(ShardReader):
    """ZeRO-1/2 (`DeepSpeedZeroOptimizer`) and `BF16_Optimizer`: each rank owns a contiguous
    fragment of the flat fp32 partition; `param._hp_mapping` (None when this rank holds
    nothing of the parameter) links a parameter to its fragment, as DeepSpeed's own
    `safe_get_full_*` helpers do, minus their all-reduce."""

    def grads(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            mapping = p._hp_mapping
            if mapping is None:
                out.append(self.empty)
                continue
            fragment = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
            if fragment.numel() == p.numel():  # a full-size accumulation buffer (BF16_Optimizer)
                address = mapping.lp_fragment_address
                fragment = fragment.narrow(0, address.start, address.numel)
            out.append(fragment)
        return out

    def masters(self) -> list[torch.Tensor]:
        return [self.empty if p._hp_mapping is None else p._hp_mapping.get_hp_fragment() for p in self.params]

    def state(self, key: str) -> list[torch.Tensor]:
        return [self.empty if p._hp_mapping is None else self._state_fragment(p._hp_mapping, key) for p in self.params]

    def _state_fragment(self, mapping, key: str) -> torch.Tensor:
        """DeepSpeed (0.19.8) links the fragments to the optimizer state once, after stepping
        the first param group: a later group's (e.g. the Trainer's no-weight-decay group) stay
        unlinked. Those are cut from their flat partition's state as the link would."""
        if mapping.optim_fragment and key in mapping.optim_fragment:
            return mapping.optim_fragment[key]
        flat = self._inner.param_groups[mapping.param_group_index]["params"][0]
        value = self._inner.state.get(flat, {}).get(key)
        address = mapping.hp_fragment_address
        return self.empty if value is None else value.narrow(0, address.start, address.numel)


class Stage3Reader(ShardReader):
    """ZeRO-3: DeepSpeed's public local accessors, cut to the parameter's real elements
    (the last ranks' partitions are padded)."""

    def __init__(self, named_params, inner_optimizer, device) -> None:
        super().__init__(named_params, inner_optimizer, device)
        self._valid = [_valid_numel(p) for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        from deepspeed.utils import safe_get_local_grad
        return self._cut(safe_get_local_grad(p) for p in self.params)

    def masters(self) -> list[torch.Tensor]:
        from deepspeed.utils import safe_get_local_fp32_param
        return self._cut(safe_get_local_fp32_param(p) for p in self.params)

    def state(self, key: str) -> list[torch.Tensor]:
        from deepspeed.utils import safe_get_local_optimizer_state
        return self._cut(safe_get_local_optimizer_state(p, key) for p in self.params)

    def _cut(self, pieces: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
        return [self.empty if t is None else t.reshape(-1)[:n] for t, n in zip(pieces, self._valid)]


class Placed(ShardReader):
    """Another reader's pieces under other `names`, `index[i]` the position of name i's piece in
    it, None for an empty piece (a tensor another rank measures): every expert of each
    expert-parallel MoE layer under its global name (`experts.global_names`), or a pipeline's
    tied layers measured on one stage only (`pipeline.tied_copies`)."""

    def __init__(self, reader: ShardReader, names: Sequence[str], index: Sequence[int | None]) -> None:
        self.reader = reader
        self.names = list(names)
        self.empty = reader.empty
        self._index = list(index)

    def _place(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.empty if i is None else pieces[i] for i in self._index]

    def grads(self) -> list[torch.Tensor]:
        return self._place(self.reader.grads())

    def masters(self) -> list[torch.Tensor]:
        return self._place(self.reader.masters())

    def state(self, key: str) -> list[torch.Tensor]:
        return self._place(self.reader.state(key))

    def state_keys(self) -> set[str]:
        return self.reader.state_keys()


def _valid_numel(param: torch.nn.Parameter) -> int:
    """How many of this rank's partition elements belong to the ZeRO-3 parameter."""
    size = param.partition_numel()
    start = dist.get_rank(group=param.ds_process_group) * size
    return max(0, min(size, param.ds_numel - start))


def balanced_owners(numels: Sequence[int], world: int) -> list[int]:
    """Assign each tensor to a rank, largest first to the least loaded rank (deterministic)."""
    load = [0] * world
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def shard_reader(engine, rank: int, world: int, warn: Callable[[str], None],
                 layers: Sequence[ExpertLayer] = ()) -> ShardReader | None:
    """The reader for this engine's optimizer, or None (with a warning saying what is lost); with
    expert-parallel MoE `layers`, under global expert names (`Placed`)."""
    reader = _local_reader(engine, rank, world, warn, layers)
    if reader is None or not layers:
        return reader
    return Placed(reader, *global_names(reader.names, layers))


def _local_reader(engine, rank: int, world: int, warn: Callable[[str], None],
                  layers: Sequence[ExpertLayer]) -> ShardReader | None:
    """The reader for this engine's optimizer under this rank's own parameter names."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    stage = engine.zero_optimization_stage()
    lost = "parameter gradients, parameters and optimizer state are not monitored (activations and loss are)"
    if optimizer is None:
        warn(f"the DeepSpeed engine has no optimizer: {lost}")
        return None
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    inner = getattr(optimizer, "optimizer", optimizer)
    device = engine.device
    groups = expert_groups([n for n, _ in named], layers)
    if stage == 3 and isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return Stage3Reader(named, inner, device)
    if isinstance(optimizer, BF16_Optimizer) or (stage in (1, 2)
                                                  and isinstance(optimizer, DeepSpeedZeroOptimizer)):
        return FragmentReader(named, inner, device)
    if stage == 0 and isinstance(optimizer, FP16_UnfusedOptimizer):
        masters = {id(lp): hp for lps, hps in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                   for lp, hp in zip(lps, hps)}
        return ReplicatedReader(named, inner, device, masters, rank, world, groups)
    if stage == 0 and isinstance(optimizer, torch.optim.Optimizer):
        return ReplicatedReader(named, inner, device, {id(p): p for _, p in named}, rank, world, groups)
    warn(f"ZeRO stage {stage} with optimizer {type(optimizer).__name__} is not understood by the "
         f"DeepSpeed integration: {lost}")
    return None
