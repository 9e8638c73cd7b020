"""The monitor's reducer under DeepSpeed: one all-gather of the step's packed rows.

Every data-parallel rank packs the same keys in the same order (activations of
its own micro-batches, its shard pieces of gradients, parameters and optimizer
state); `gather_merge` merges them exactly, so every rank ends with the
statistics of the whole batch and the full tensors. With `per_rank`, the rows
of the data each rank sees alone (activations, activation gradients, loss)
stay that rank's own, while model-state rows are always the merged ones.

The rows travel with one marker row holding a checksum of the key layout; on
the first monitored step and whenever the layout changes, the merged marker
is checked, so ranks measuring different things fail loudly instead of
merging unrelated rows.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from msprobe_engine.frameworks.torch.distributed import gather_merge
from msprobe_engine.stats import P_MAX, P_MIN
from msprobe_engine.stats.table import MetricKey

#: kinds whose tensors differ from rank to rank (each rank's own data)
RANK_LOCAL_KINDS = frozenset({"actv", "actv_grad", "train"})


class RankMerge:
    """`monitor.reducer`: merges packed rows over a torch.distributed group in one collective."""

    def __init__(self, group=None, per_rank: bool = False) -> None:
        self.group = group
        self.per_rank = per_rank
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._checked_layout: int | None = None
        self._last: tuple[list[MetricKey], int] = ([], layout_checksum([]))

    def __call__(self, keys: Sequence[MetricKey], rows: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return rows
        if keys != self._last[0]:  # the layout rarely changes: checksum it only when it does
            self._last = (list(keys), layout_checksum(keys))
        layout = self._last[1]
        marker = torch.zeros((1, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        marker[0, P_MIN] = marker[0, P_MAX] = layout
        merged = gather_merge(torch.cat([rows, marker]), self.group)
        if layout != self._checked_layout:
            if bool(merged[-1, P_MIN] != merged[-1, P_MAX]):
                raise RuntimeError(
                    "msprobe: the data-parallel ranks measured different tensors this step (the module "
                    "calls differ between ranks, e.g. data-dependent branches); statistics cannot be "
                    "merged across ranks. Watch fewer modules (config `modules`) or turn off "
                    "`watch.module_outputs`.")
            self._checked_layout = layout
        merged = merged[:-1]
        if self.per_rank:
            local = torch.tensor([k.kind in RANK_LOCAL_KINDS for k in keys], device=rows.device)
            merged[local] = rows[local]
        return merged


def layout_checksum(keys: Sequence[MetricKey]) -> int:
    """A checksum of the key list that is the same in every process (unlike `hash`)."""
    return zlib.crc32("\n".join("\t".join(k) for k in keys).encode())
