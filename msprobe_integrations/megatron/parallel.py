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

from msprobe_engine.frameworks.torch.distributed import gather_rows, layout_checksum, merge_stacked
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


class StatReducer:
    """`monitor.reducer` for Megatron: exact merge over TP, then over DP (see module doc)."""

    def __init__(self, layout: Layout, tp_partitioned: set[str], dp_sharded: set[str]) -> None:
        self.layout = layout
        self.tp_partitioned = tp_partitioned
        self.dp_sharded = dp_sharded
        self._checked: set[int] = set()  # key layouts already proven equal on every rank

    def __call__(self, keys: list[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        checksum = layout_checksum(keys)
        if layout.size(layout.tp_group) > 1:
            once = [k.kind in PARAM_KINDS and k.path not in self.tp_partitioned for k in keys]
            auto = [k.kind not in PARAM_KINDS for k in keys]
            rows = self._merge(checksum, rows, layout.tp_group, "tensor", once, auto)
        if layout.size(layout.dp_group) > 1:
            once = [k.kind in PARAM_KINDS and k.path not in self.dp_sharded for k in keys]
            rows = self._merge(checksum, rows, layout.dp_group, "data", once, None)
        self._checked.add(checksum)
        return rows

    def _merge(self, checksum: int, rows: torch.Tensor, group: object, what: str,
               once: list[bool], auto: list[bool] | None) -> torch.Tensor:
        """One all-gather; rows marked `once` come from the group's first rank, rows marked
        `auto` too when all ranks hold identical bits, every other row is merged. A marker
        row carries the key checksum, checked (one small host read) when the layout is new."""
        marker = torch.full((1, rows.shape[1]), float(checksum), dtype=rows.dtype, device=rows.device)
        stacked = gather_rows(torch.cat([rows, marker]), group)
        if checksum not in self._checked and bool((stacked[:, -1, 0] != checksum).any()):
            raise RuntimeError(
                f"msprobe: the ranks of a {what}-parallel group measured different tensors this step; "
                "their statistics cannot be merged. Every rank of the group must run the same modules "
                "and report a loss alike (all or none).")
        stacked = stacked[:, :-1]
        take_first = torch.tensor(once, dtype=torch.bool, device=rows.device)
        if auto is not None and any(auto):
            bits = stacked.view(torch.int64)
            identical = (bits == bits[:1]).all(dim=2).all(dim=0)
            take_first |= identical & torch.tensor(auto, dtype=torch.bool, device=rows.device)
        return torch.where(take_first[:, None], stacked[0], merge_stacked(stacked))
