"""DeepSpeed's `PipelineEngine`: every stage's rows merged over all the pipeline's ranks.

A `PipelineModule` names its layers by their global index (`<idx>.weight`, `tied_modules.<key>`),
so a stage's parameter and module names are already global: stage 1 of `[Linear, Tanh, Linear]`
holds `2.weight`. The stages measure different layers, so their rows differ: `PipelineMerge.complete`
lists, on every rank, the union of every rank's rows (in rank order), with an empty row (the merge's
identity) where this rank measured nothing. One all-gather of a layout checksum per transfer tells
the ranks whether a layout is new; only then are the keys themselves gathered (once per layout).
The rows are then merged over every rank of the pipeline (stages x data parallel, `RankMerge`):
each stage's pieces come from its own data-parallel ranks (ZeRO shards, ZeRO-0 owners), the others
give the identity, so every rank ends with the whole model's statistics; the loss comes from the
last stage. The per-rank spread (`stats.ranks`) is not reported: the ranks hold different layers.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from msprobe_engine.frameworks.torch.distributed import gather_rows, layout_checksum
from msprobe_engine.stats.columns import empty_row
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.deepspeed.merge import RankMerge

#: one row of a transfer: (its step relative to the transfer's last, its key, its occurrence of that pair)
Item = tuple[int, MetricKey, int]


def items_of(keys: Sequence[MetricKey], steps: np.ndarray) -> list[Item]:
    """The rows of a transfer as `Item`s, unique and the same on every rank for the same rows."""
    last = int(steps.max()) if len(steps) else 0
    seen: dict[tuple[int, MetricKey], int] = {}
    out = []
    for step, key in zip(steps.tolist(), keys):
        at = (int(step) - last, key)
        seen[at] = n = seen.get(at, -1) + 1
        out.append((at[0], key, n))
    return out


def union(per_rank: Sequence[Sequence[Item]]) -> list[Item]:
    """Every rank's items, each once, in rank order (rank 0's first)."""
    return list(dict.fromkeys(item for items in per_rank for item in items))


class PipelineMerge(RankMerge):
    """`RankMerge` over all the ranks of a pipeline, each rank's rows completed with placeholders."""

    def __init__(self, group=None, per_rank: bool = False) -> None:
        super().__init__(group, per_rank)
        #: gathered layout checksums -> (the union's keys, their steps relative to the last, where this
        #: rank's rows go in it)
        self._plans: dict[tuple[int, ...], tuple[list[MetricKey], np.ndarray, torch.Tensor]] = {}

    def complete(self, keys: list[MetricKey], steps: np.ndarray,
                 rows: torch.Tensor) -> tuple[list[MetricKey], np.ndarray, torch.Tensor]:
        if self.world == 1:
            return keys, steps, rows
        last = int(steps.max()) if len(steps) else 0
        checksum = zlib.crc32((steps - last).astype(np.int64).tobytes(), layout_checksum(keys))
        mine = torch.tensor([[checksum]], dtype=torch.int64, device=rows.device)
        layouts = tuple(gather_rows(mine, self.group).reshape(-1).tolist())  # one small host read
        plan = self._plans.get(layouts)
        if plan is None:  # a new layout somewhere: the keys themselves, once
            items = items_of(keys, steps)
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, items, group=self.group)
            full = union(gathered)
            at = {item: i for i, item in enumerate(full)}
            plan = self._plans[layouts] = ([key for _, key, _ in full], np.array([rel for rel, _, _ in full]),
                                           torch.tensor([at[i] for i in items], dtype=torch.long, device=rows.device))
        full, rel, where = plan
        out = torch.tensor(empty_row()[:rows.shape[1]], dtype=rows.dtype, device=rows.device).repeat(len(full), 1)
        out[where] = rows
        return list(full), (rel + last).astype(steps.dtype), out

    def spread(self) -> torch.Tensor | None:
        return None


def tied_copies(engine, names: Sequence[str]) -> list[int | None]:
    """For each parameter name, its position, or None where it is a tied layer's copy
    (`TiedLayerSpec`, `tied_modules.<key>.*`) that an earlier stage holds too: DeepSpeed keeps the
    copies equal (their gradients summed, `_exec_reduce_tied_grads`), so the first stage's is the
    one measured."""
    comms = engine.module.tied_comms
    me = dist.get_rank()

    def elsewhere(name: str) -> bool:
        key = name.split(".")[1] if name.startswith("tied_modules.") else None
        return key in comms and comms[key]["ranks"][0] != me

    return [None if elsewhere(name) else at for at, name in enumerate(names)]


def last_stage_losses(engine) -> list[torch.Tensor]:
    """The micro-batches' detached losses of this `train_batch` (the last stage's; none elsewhere)."""
    if not engine.is_last_stage():
        return []
    return [loss for loss in engine.fwd_outputs if isinstance(loss, torch.Tensor)]
