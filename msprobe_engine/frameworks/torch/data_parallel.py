"""PyTorch's own data parallelism (DDP, FSDP2, HSDP): what a model's wrapping means for the
statistics, and the reducer that merges them over the ranks in one collective.

- `DistributedDataParallel`: every rank holds the whole model; after backward the gradients
  are already averaged, so gradients, parameters and optimizer state are copies (taken once),
  while activations, their gradients and the loss are each rank's own data (merged).
- FSDP2 (`fully_shard`, also on an HSDP 2-D mesh): DTensor parameters, gradients and moments
  are measured on this rank's shard (`fsdp.LocalShards`) and merged exactly; the rows of
  a non-lead HSDP replica are replaced by the empty row (the merge's identity) first, so that
  every shard counts once in the same single all-gather.
- Anything else on more than one rank (FSDP1, a custom wrapper): nothing is merged, and a
  warning says so; no local number is passed off as a global one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from msprobe_engine.frameworks.torch.distributed import LOCAL, MERGE, ONCE, GroupMerge, layout_checksum
from msprobe_engine.frameworks.torch.fsdp import shard_groups
from msprobe_engine.stats.columns import EMPTY_ROW
from msprobe_engine.stats.table import MetricKey

#: row kinds measured on parameters (gradient, weight, optimizer state)
PARAM_KINDS = frozenset({"grad", "param", "optim"})


@dataclass
class Wrapping:
    """How a model is parallelised: `kind` "single" (one process), "ddp", "fsdp2" or "unknown";
    `inner` the module to hook (DDP's `.module`, so names match the unwrapped model); `group`
    the process group the statistics merge over; `mesh` FSDP2's device mesh; `problem` what
    is not understood (for the warning)."""
    kind: str
    inner: torch.nn.Module
    group: Any = None
    mesh: Any = None
    problem: str = ""
    world: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        if self.kind != "single":
            self.world = dist.get_world_size(self.group)


def wrapping_of(model: torch.nn.Module) -> Wrapping:
    """Recognise DDP and FSDP2; on more than one rank, anything else is "unknown"."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Wrapping("single", _unwrap_ddp(model))
    if isinstance(model, DistributedDataParallel):
        return Wrapping("ddp", model.module, group=model.process_group)
    fsdp1 = _fsdp1_modules(model)
    if fsdp1:
        return Wrapping("unknown", model, problem=f"FullyShardedDataParallel (FSDP1) at {fsdp1} (use FSDP2's "
                        "fully_shard)")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        mesh = next(iter(meshes.values()), None)
        if len(meshes) > 1 or mesh is None or mesh.size() != dist.get_world_size():
            return Wrapping("unknown", model, problem="fully_shard over a device mesh that is not the whole "
                            "world (or over several meshes)")
        return Wrapping("fsdp2", model, mesh=mesh)
    return Wrapping("unknown", model, problem=f"{type(model).__module__}.{type(model).__name__}, which is "
                    "neither DistributedDataParallel nor fully_shard (FSDP2)")


def not_merged_warning(wrapping: Wrapping, rank: int) -> str:
    return (f"{wrapping.problem}: the monitor does not know how this model is split over the "
            f"{wrapping.world} ranks, so NOTHING is merged across ranks: gradients, parameters, optimizer "
            f"state, activations, the loss and grad/global/norm are rank {rank}'s own local numbers, not "
            "global ones (rank 0 writes its own; with `per_rank: true` every rank does)")


def _unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


def _fsdp1_modules(model: torch.nn.Module) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel
    names = [name or "the root" for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


class DataParallelMerge:
    """`monitor.reducer` under DDP/FSDP2: one all-gather of the step's packed rows over the
    group (`GroupMerge`), model-state rows taken once (DDP copies) or merged from shards (FSDP2),
    data rows merged (or kept per rank with `per_rank`)."""

    def __init__(self, wrapping: Wrapping, params: Sequence[tuple[str, torch.Tensor]], per_rank: bool) -> None:
        self.merge = GroupMerge(wrapping.group, "data")
        self.world = self.merge.world
        self.per_rank = per_rank
        self.sharded, self.copies = shard_groups(params) if wrapping.kind == "fsdp2" else (set(), set())
        self._blank: dict[int, torch.Tensor | None] = {}
        #: a step replay's rows are merged too (`Monitor.replay_statistics`): the rules fire on merged
        #: rows, so every rank replays the same step (its forward and backward are collective anyway)
        self.replays_together = not per_rank

    def policy(self, key: MetricKey) -> str:
        if key.kind in PARAM_KINDS:
            return MERGE if key.path in self.sharded else ONCE
        return LOCAL if self.per_rank else MERGE

    def __call__(self, keys: list[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        checksum = layout_checksum(keys)
        blank = self._blank_mask(checksum, keys, rows.device)
        if blank is not None:
            rows = torch.where(blank[:, None], _empty_row(rows), rows)
        return self.merge(keys, rows, self.policy, checksum)

    def _blank_mask(self, checksum: int, keys: Sequence[MetricKey], device: torch.device) -> torch.Tensor | None:
        """Rows this rank holds as a second copy of a shard (HSDP), once per layout."""
        if checksum not in self._blank:
            mask = [k.kind in PARAM_KINDS and k.path in self.copies for k in keys]
            self._blank[checksum] = torch.tensor(mask, device=device) if any(mask) else None
        return self._blank[checksum]


def _empty_row(rows: torch.Tensor) -> torch.Tensor:
    return torch.tensor(EMPTY_ROW, dtype=rows.dtype, device=rows.device)
