"""Megatron's process groups and the reducer that merges statistics over them.

The monitor hands its packed rows to `StatReducer` once per transfer. The rows
travel in one all-gather over the tensor-parallel group and then one over the
data-parallel group (with context parallel), never the tensors themselves.
Per row, the merge is exact:

- a parameter's gradient, weight or optimizer state: merged over TP when the
  parameter is partitioned (`tensor_model_parallel`), taken once when it is
  replicated (layer norms, biases of row-parallel layers); merged over DP when
  the distributed optimizer shards it, taken once when DP ranks hold copies;
- an activation, activation gradient or the loss: merged over DP (each rank saw
  other data); over TP it is taken once when every rank measured the very same
  bits (a replicated tensor) and merged otherwise (a partitioned one: the output
  of a column-parallel layer, or of any layer under sequence parallelism).

Pipeline stages hold different layers: nothing is merged across them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from msprobe_engine.frameworks.torch.distributed import AUTO, MERGE, ONCE, GroupMerge, layout_checksum
from msprobe_engine.reducer import Reducer
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.megatron.model import Chunk

#: row kinds measured on parameters (gradient, weight, optimizer state)
PARAM_KINDS = frozenset({"grad", "param", "optim"})


@dataclass(frozen=True)
class Layout:
    """This rank's tensor- and data-parallel (with context-parallel) groups, and the
    number of pipeline stages."""
    tp_group: object
    dp_group: object
    pp_size: int = 1

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> "Layout":
        """The groups of the first DDP-wrapped chunk, else those of `parallel_state`."""
        ddp = next((c.ddp for c in chunks if c.ddp is not None), None)
        if ddp is not None:
            return cls(ddp.tp_group, ddp.dp_cp_group, dist.get_world_size(ddp.pp_group))
        if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
            return cls(None, None)
        return cls(parallel_state.get_tensor_model_parallel_group(),
                   parallel_state.get_data_parallel_group(with_context_parallel=True),
                   parallel_state.get_pipeline_model_parallel_world_size())

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
        self.tp = GroupMerge(layout.tp_group, "tensor") if layout.size(layout.tp_group) > 1 else None
        self.dp = GroupMerge(layout.dp_group, "data") if layout.size(layout.dp_group) > 1 else None

    def tp_policy(self, key: MetricKey) -> str:
        if key.kind in PARAM_KINDS:
            return MERGE if key.path in self.tp_partitioned else ONCE
        return AUTO  # replicated activations are taken once, partitioned ones merged

    def dp_policy(self, key: MetricKey) -> str:
        return ONCE if key.kind in PARAM_KINDS and key.path not in self.dp_sharded else MERGE

    def merge(self, keys: Sequence[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        checksum = layout_checksum(keys)
        if self.tp is not None:
            rows = self.tp(keys, rows, self.tp_policy, checksum)
        if self.dp is not None:
            rows = self.dp(keys, rows, self.dp_policy, checksum)
        return rows
