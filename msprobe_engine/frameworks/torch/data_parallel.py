"""PyTorch's own data parallelism (DDP, FSDP2, HSDP): what a model's wrapping means for the
statistics, and the reducer that merges them over the ranks (two all-reduces whose size does not grow with the world).

- `DistributedDataParallel`: every rank holds the whole model; after backward the gradients
  are already averaged, so gradients, parameters and optimizer state are copies (taken once),
  while activations, their gradients and the loss are each rank's own data (merged).
- FSDP2 (`fully_shard`, also on an HSDP 2-D mesh): DTensor parameters, gradients and moments
  are measured on this rank's shard (`fsdp.LocalShards`) and merged exactly; the rows of
  a non-lead HSDP replica are replaced by the empty row (the merge's identity) first, so that
  every shard counts once in the same merge.
- FSDP2 with tensor parallelism (`parallelize_module` on the "tp" dimension of a 2-D
  (data, tensor) mesh, `fully_shard` on its data dimension): one merge over the
  tensor-parallel group first (a parameter's rows merged where the parameter is sharded over
  it, taken once where it is replicated; activations and the loss taken once where every rank
  measured the very same bits, a replicated tensor, and merged otherwise, as under
  Megatron), then the FSDP2 merge over the data-parallel group.
- Anything else on more than one rank (FSDP1, a custom wrapper): nothing is merged, and a
  warning says so; no local number is passed off as a global one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from msprobe_engine.frameworks.torch.distributed import (AUTO, LOCAL, MERGE, ONCE, NestedMerge, agree,
                                                         layout_checksum)
from msprobe_engine.frameworks.torch.fsdp import shard_groups
from msprobe_engine.incident.actions import StepDecision
from msprobe_engine.reducer import Reducer
from msprobe_engine.stats.columns import empty_row
from msprobe_engine.stats.table import MetricKey

#: row kinds measured on parameters (gradient, weight, optimizer state)
PARAM_KINDS = frozenset({"grad", "param", "optim"})


@dataclass
class Wrapping:
    """How a model is parallelised: `kind` "single" (one process), "ddp", "fsdp2" or "unknown";
    `inner` the module to hook (DDP's `.module`, so names match the unwrapped model); `group`
    the process group the statistics merge over (data parallel); `mesh` the device mesh of
    FSDP2's DTensor parameters; `tp_group`/`tp_dim` the tensor-parallel group and mesh dimension
    of FSDP2 + TP (else None); `problem` what is not understood (for the warning)."""
    kind: str
    inner: torch.nn.Module
    group: Any = None
    mesh: Any = None
    problem: str = ""
    tp_group: Any = None
    tp_dim: int | None = None
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
        meshes: list[Any] = []  # (equal meshes may be distinct objects)
        for p in model.parameters():
            if isinstance(p, DTensor) and p.device_mesh not in meshes:
                meshes.append(p.device_mesh)
        mesh = meshes[0] if meshes else None
        if len(meshes) > 1 or mesh is None or mesh.size() != dist.get_world_size():
            return Wrapping("unknown", model, problem="fully_shard over a device mesh that is not the whole "
                            "world (or over several meshes)")
        return _fsdp2_wrapping(model, mesh)
    return Wrapping("unknown", model, problem=f"{type(model).__module__}.{type(model).__name__}, which is "
                    "neither DistributedDataParallel nor fully_shard (FSDP2)")


def _fsdp2_wrapping(model: torch.nn.Module, mesh: Any) -> Wrapping:
    """FSDP2 on the parameters' whole mesh (1-D, HSDP), or on its data dimension with tensor
    parallelism on the other (a 2-D (data, tensor) mesh)."""
    dp_mesh = _fully_shard_mesh(model)
    if dp_mesh is not None and dp_mesh.ndim == mesh.ndim:
        return Wrapping("fsdp2", model, mesh=mesh)
    names = mesh.mesh_dim_names or ()
    dp_names = (dp_mesh.mesh_dim_names or ()) if dp_mesh is not None else ()
    others = [i for i, name in enumerate(names) if name not in dp_names]
    if dp_mesh is None or mesh.ndim != 2 or dp_mesh.ndim != 1 or not dp_names or len(others) != 1:
        where = "of unknown dimensions" if dp_mesh is None else f"{dp_mesh.ndim}-D inside a {mesh.ndim}-D mesh"
        return Wrapping("unknown", model, problem=f"fully_shard on a mesh {where} {tuple(names)} (FSDP2 with "
                        "other parallelism; only a 2-D (data, tensor) mesh with fully_shard on its data "
                        "dimension is merged)")
    tp_dim = others[0]
    return Wrapping("fsdp2", model, group=dp_mesh.get_group(), mesh=mesh, tp_group=mesh.get_group(tp_dim),
                    tp_dim=tp_dim)


def _fully_shard_mesh(model: torch.nn.Module) -> Any:
    """The mesh `fully_shard` was given (its data-parallel dimensions), from FSDP2's state (not a
    public API in torch 2.13: None when it is not found)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            try:
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    return group.mesh_info.mesh
            except AttributeError:
                return None
    return None


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


class DataParallelMerge(Reducer):
    """`monitor.reducer` under DDP/FSDP2: the step's packed rows merged over the group in two
    all-reduces (`GroupMerge`), model-state rows taken once (DDP copies) or merged from shards (FSDP2),
    data rows merged (or kept per rank with `per_rank`). With tensor parallelism, a merge
    over the tensor-parallel group comes first (see the module docstring)."""

    def __init__(self, wrapping: Wrapping, params: Sequence[tuple[str, torch.Tensor]], per_rank: bool) -> None:
        self.group = wrapping.group
        self.world = wrapping.world
        self.per_rank = per_rank
        self.sharded, self.copies = shard_groups(params) if wrapping.kind == "fsdp2" else (set(), set())
        parts = [(wrapping.group, "data", self.policy)]
        if wrapping.tp_group is not None:  # a tensor-parallel copy is taken once over TP, not blanked
            self.copies = set()
            self.tp_sharded = {n for n, p in params
                               if getattr(p, "placements", None) and p.placements[wrapping.tp_dim].is_shard()}
            parts.insert(0, (wrapping.tp_group, "tensor", self.tp_policy))
        # the mesh is the whole world (`wrapping_of`): the stage of both merges
        self.merges = NestedMerge(parts, stage=dist.group.WORLD)
        self._blank: dict[int, torch.Tensor | None] = {}
        self._device = torch.device("cpu")  # where the rows live (the collectives' device)
        #: a step replay's rows are merged too (`Monitor.replay_statistics`): the rules fire on merged
        #: rows, so every rank replays the same step (its forward and backward are collective anyway)
        self.replays_together = not per_rank

    def policy(self, key: MetricKey) -> str:
        if key.kind in PARAM_KINDS:
            return MERGE if key.path in self.sharded else ONCE
        return LOCAL if self.per_rank else MERGE

    def agree(self, decision: StepDecision) -> StepDecision:
        """`Monitor.before_optimizer_step`, on every rank, when a rule can skip or stop: with
        `per_rank` the rules see each rank's own activations and loss and may decide differently,
        and replicas that step differently diverge (or a stopping rank leaves the others waiting in
        a collective): one all-reduce of the decision (`distributed.agree`) makes any rank's
        skip/stop apply to all. Without `per_rank` every rank's rules see the same merged rows:
        nothing to agree on, no collective."""
        if not self.per_rank or self.world == 1:
            return decision
        return agree(decision, self.group, self._device)

    def tp_policy(self, key: MetricKey) -> str:
        if key.kind in PARAM_KINDS:
            return MERGE if key.path in self.tp_sharded else ONCE
        return AUTO  # replicated activations (a row-parallel output, the loss) once, sharded ones merged

    def merge(self, keys: Sequence[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        self._device = rows.device
        checksum = layout_checksum(keys)
        blank = self._blank_mask(checksum, keys, rows.device)
        if blank is not None:
            rows = torch.where(blank[:, None], _empty_row(rows), rows)
        return self.merges(keys, rows, checksum)

    def spread(self) -> torch.Tensor | None:
        """The spread over every rank (both groups' under tensor parallelism)."""
        return self.merges.spread_rows()

    def _blank_mask(self, checksum: int, keys: Sequence[MetricKey], device: torch.device) -> torch.Tensor | None:
        """Rows this rank holds as a second copy of a shard (HSDP), once per layout."""
        if checksum not in self._blank:
            mask = [k.kind in PARAM_KINDS and k.path in self.copies for k in keys]
            self._blank[checksum] = torch.tensor(mask, device=device) if any(mask) else None
        return self._blank[checksum]


def _empty_row(rows: torch.Tensor) -> torch.Tensor:
    return torch.tensor(empty_row(), dtype=rows.dtype, device=rows.device)
