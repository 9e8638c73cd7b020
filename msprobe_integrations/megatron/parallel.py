"""Megatron's process groups and the reducer that merges statistics over them.

The monitor hands its packed rows to `StatReducer` once per transfer. The rows
are merged over the tensor-parallel group, then over the context-parallel group (CP > 1), then
over the data-parallel group, as if one after the other, in two all-reduces over the stage's
TP x CP x DP group of a size independent of the groups' (`frameworks.torch.distributed.NestedMerge`),
never the tensors themselves.
Per row, the merge is exact:

- a parameter's gradient, weight or optimizer state: merged over TP when the
  parameter is partitioned (`tensor_model_parallel`), taken once when it is
  replicated (layer norms, biases of row-parallel layers); merged over DP when
  the distributed optimizer or torch FSDP2 (`TorchFullyShardedDataParallel`: DTensors,
  measured on this rank's shard) shards it, taken once when DP ranks hold copies;
- an activation, activation gradient or the loss: merged over DP (each rank saw
  other data); over TP it is taken once when every rank measured the very same
  bits (a replicated tensor) and merged otherwise (a partitioned one: the output
  of a column-parallel layer, or of any layer under sequence parallelism). Over CP likewise:
  each CP rank holds its part of the sequence (merged), while a tensor that is not cut along
  it, e.g. a bias a linear layer returns apart (`skip_bias_add`), is the same on every CP rank
  (taken once). Parameters are over CP what they are over DP (Megatron's data-parallel group
  with context parallel holds both).

Under expert parallelism (EP > 1) the data-parallel group is the grid of the
expert-data-parallel group (ranks holding the same experts) and the expert-parallel group
(ranks holding different experts), and the data-parallel merge is done over the first and then the second: an expert parameter's rows are taken once over its
replicas (merged when the distributed optimizer shards it) and merged over the
expert-parallel group (where only the rank holding the expert has a non-empty row, see
`experts.complete_experts`); every other row merges as over the whole data-parallel group.

Pipeline stages hold different layers: nothing is merged across them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from msprobe_engine.frameworks.torch.distributed import AUTO, MERGE, ONCE, NestedMerge, layout_checksum
from msprobe_engine.reducer import Reducer
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.megatron.experts import is_expert_path
from msprobe_integrations.megatron.model import Chunk

#: row kinds measured on parameters (gradient, weight, optimizer state)
PARAM_KINDS = frozenset({"grad", "param", "optim"})


@dataclass(frozen=True)
class Layout:
    """This rank's tensor- and data-parallel (with context-parallel) groups, the number of
    pipeline stages, and the expert-parallel and expert-data-parallel groups."""
    tp_group: object
    dp_group: object
    pp_size: int = 1
    ep_group: object = None
    edp_group: object = None
    #: the group of this stage's TP x DP (with CP) ranks, where the merge over them all is one pair of
    #: all-reduces (None: group by group)
    stage_group: object = None
    #: with context parallel (CP > 1): the context-parallel group, and the data-parallel group without it
    cp_group: object = None
    data_group: object = None

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> "Layout":
        """The groups of the first DDP-wrapped chunk, else those of `parallel_state` (with the
        data-parallel group a `TorchFullyShardedDataParallel` shards over)."""
        ddp = next((c.ddp for c in chunks if c.ddp is not None), None)
        fsdp = next((c.fsdp for c in chunks if c.fsdp is not None), None)
        initialized = dist.is_initialized() and parallel_state.model_parallel_is_initialized()
        # (checked against the groups it must hold by the merge: `NestedMerge`)
        stage = parallel_state.get_tensor_and_data_parallel_group(
            check_initialized=False, with_context_parallel=True) if initialized else None
        context = {}
        if initialized and parallel_state.get_context_parallel_world_size() > 1:
            context = {"cp_group": parallel_state.get_context_parallel_group(),
                       "data_group": parallel_state.get_data_parallel_group(with_context_parallel=False)}
        if ddp is not None:
            return cls(ddp.tp_group, ddp.dp_cp_group, dist.get_world_size(ddp.pp_group),
                       getattr(ddp, "ep_group", None), getattr(ddp, "expt_dp_group", None), stage, **context)
        if not initialized:
            return cls(None, None)
        return cls(parallel_state.get_tensor_model_parallel_group(),
                   fsdp.process_group if fsdp is not None else
                   parallel_state.get_data_parallel_group(with_context_parallel=True),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_group(check_initialized=False),
                   parallel_state.get_expert_data_parallel_group(check_initialized=False), stage, **context)

    @property
    def ep_size(self) -> int:
        return self.size(self.ep_group)

    def check_experts(self) -> None:
        """Expert parallelism is merged over the expert-data-parallel x expert-parallel grid of the
        data-parallel group; raise on a layout that is not that grid, or with context parallel
        (whose merge takes a tensor that is not cut along the sequence once: it would need the
        context-parallel group inside that grid)."""
        if self.ep_size > 1 and self.size(self.cp_group) > 1:
            raise ValueError(f"MegatronMonitor: expert parallelism ({self.ep_size}) with context parallelism "
                             f"({self.size(self.cp_group)}): not supported")
        if self.ep_size > 1 and self.size(self.dp_group) != self.size(self.edp_group) * self.ep_size:
            raise ValueError(f"MegatronMonitor: expert-parallel size {self.ep_size} x expert-data-parallel size "
                             f"{self.size(self.edp_group)} is not the data-parallel size {self.size(self.dp_group)} "
                             "(context parallel or an expert tensor-parallel size other than the tensor-parallel "
                             "size with expert parallelism): not supported")

    def size(self, group: object) -> int:
        return dist.get_world_size(group) if group is not None else 1

    def rank(self, group: object) -> int:
        return dist.get_rank(group) if group is not None else 0

    @property
    def stage_leader(self) -> bool:
        """The first rank of this pipeline stage's TP x DP grid (writes the stage's records)."""
        return self.rank(self.tp_group) == 0 and self.rank(self.dp_group) == 0


class StatReducer(Reducer):
    """`monitor.reducer` for Megatron: exact merge over TP, then over DP (see module doc)."""

    def __init__(self, layout: Layout, tp_partitioned: set[str], dp_sharded: set[str]) -> None:
        self.layout = layout
        self.tp_partitioned = tp_partitioned
        self.dp_sharded = dp_sharded
        parts = [(layout.tp_group, "tensor", self.tp_policy)]
        if layout.ep_size > 1:  # data parallel = expert data parallel x expert parallel
            layout.check_experts()
            parts += [(layout.edp_group, "expert data", self.dp_policy), (layout.ep_group, "expert", self.ep_policy)]
        elif layout.size(layout.cp_group) > 1:  # data parallel with CP = context parallel x data parallel
            parts += [(layout.cp_group, "context", self.cp_policy), (layout.data_group, "data", self.dp_policy)]
        else:
            parts.append((layout.dp_group, "data", self.dp_policy))
        self.merges = NestedMerge([part for part in parts if layout.size(part[0]) > 1], stage=layout.stage_group)
        #: the tensor-parallel group's merge (`tp_split.ReplicaSplit` watches it for one step: then the
        #: merge goes group by group, through it)
        self.tp = self.merges.chain[0] if layout.size(layout.tp_group) > 1 else None

    def tp_policy(self, key: MetricKey) -> str:
        if key.kind in PARAM_KINDS:
            return MERGE if key.path in self.tp_partitioned else ONCE
        return AUTO  # replicated activations are taken once, partitioned ones merged

    def dp_policy(self, key: MetricKey) -> str:
        return ONCE if key.kind in PARAM_KINDS and key.path not in self.dp_sharded else MERGE

    def cp_policy(self, key: MetricKey) -> str:
        """Over the context-parallel group: parameters as over DP, activations and the loss
        merged where each rank holds its part of the sequence, taken once where all are alike."""
        return self.dp_policy(key) if key.kind in PARAM_KINDS else AUTO

    def ep_policy(self, key: MetricKey) -> str:
        """Over the expert-parallel group: an expert's rows come from the rank holding it."""
        return MERGE if key.kind in PARAM_KINDS and is_expert_path(key.path) else self.dp_policy(key)

    def merge(self, keys: Sequence[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        checksum = layout_checksum(keys)
        if self.tp is not None and self.tp is not self.merges.chain[0]:  # watched
            return self.merges.by_group(keys, rows, checksum, first=self.tp)
        return self.merges(keys, rows, checksum)

    def spread(self) -> torch.Tensor | None:
        """The spread of the per-rank scalars over this pipeline stage's ranks."""
        return self.merges.spread_rows()
