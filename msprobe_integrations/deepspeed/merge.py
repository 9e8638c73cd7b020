"""The monitor's reducer under DeepSpeed: one all-gather of the step's packed rows.

Every data-parallel rank packs the same keys in the same order (activations of
its own micro-batches, its shard pieces of gradients, parameters and optimizer
state); the merge policy of `frameworks.torch.distributed` merges them exactly, so every
rank ends with the statistics of the whole batch and the full tensors. With `per_rank`,
the rows of the data each rank sees alone (activations, activation gradients, loss)
stay that rank's own, while model-state rows are always the merged ones. The layout
check (ranks measuring different things fail loudly) is the policy's own.
"""
from __future__ import annotations

from typing import Sequence

import torch

from msprobe_engine.frameworks.torch.distributed import LOCAL, MERGE, GroupMerge
from msprobe_engine.stats.table import MetricKey

#: kinds whose tensors differ from rank to rank (each rank's own data)
RANK_LOCAL_KINDS = frozenset({"actv", "actv_grad", "train"})


class RankMerge:
    """`monitor.reducer`: merges packed rows over the data-parallel group in one collective."""

    def __init__(self, group=None, per_rank: bool = False) -> None:
        self.group = group
        self.merge = GroupMerge(group, "data")
        self.per_rank = per_rank
        self.world = self.merge.world

    def policy(self, key: MetricKey) -> str:
        return LOCAL if self.per_rank and key.kind in RANK_LOCAL_KINDS else MERGE

    def __call__(self, keys: Sequence[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        return self.merge(keys, rows, self.policy)
