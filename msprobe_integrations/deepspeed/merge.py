"""The monitor's reducer under DeepSpeed: the step's packed rows merged in two all-reduces.

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

from msprobe_engine.frameworks.torch.distributed import LOCAL, MERGE, GroupMerge, agree
from msprobe_engine.incident.actions import StepDecision
from msprobe_engine.reducer import Reducer
from msprobe_engine.stats.table import MetricKey

#: kinds whose tensors differ from rank to rank (each rank's own data)
RANK_LOCAL_KINDS = frozenset({"actv", "actv_grad", "train"})


class RankMerge(Reducer):
    """`monitor.reducer`: merges packed rows over the data-parallel group (`GroupMerge`)."""

    def __init__(self, group=None, per_rank: bool = False) -> None:
        self.group = group
        self.data = GroupMerge(group, "data")
        self.per_rank = per_rank
        self.world = self.data.world
        self._device = torch.device("cpu")  # where the rows live (the collectives' device)

    def policy(self, key: MetricKey) -> str:
        return LOCAL if self.per_rank and key.kind in RANK_LOCAL_KINDS else MERGE

    def agree(self, decision: StepDecision) -> StepDecision:
        """`Monitor.before_optimizer_step`, with a skip/stop rule: with `per_rank` (rank-local loss
        and activation rows) one all-reduce of the decision makes every rank take any rank's
        skip/stop (`distributed.agree`); otherwise the rules saw merged rows alike on every rank."""
        if not self.per_rank or self.world == 1:
            return decision
        return agree(decision, self.group, self._device)

    def spread(self) -> torch.Tensor | None:
        return self.data.spread_rows()

    def merge(self, keys: Sequence[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        self._device = rows.device
        return self.data(keys, rows, self.policy)
