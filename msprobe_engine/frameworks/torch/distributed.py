"""Merge partial-statistics rows across the ranks of a torch.distributed group.

One collective per call: every rank contributes its ``[k, 8]`` rows (the same
keys in the same order, e.g. the local shards of the same parameters), they
are all-gathered into one ``[world, k, 8]`` tensor and merged on the device
with the exact math of `msprobe_engine.stats.merge` (min of mins, max of
maxes, sums add). No full tensor is ever gathered.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from msprobe_engine.stats.columns import MAX_COLUMNS, MIN_COLUMNS
from msprobe_engine.stats.table import MetricKey


def gather_merge(rows: torch.Tensor, group=None) -> torch.Tensor:
    """Return the rows merged over every rank of `group` (identical on all ranks)."""
    if dist.get_world_size(group) == 1:
        return rows
    return merge_stacked(gather_rows(rows, group))


def gather_rows(rows: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather every rank's ``[k, 8]`` rows into ``[world, k, 8]`` (one collective), for
    callers that merge some rows and keep others (e.g. tensors replicated across the group)."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
    _all_gather(gathered, rows.contiguous(), group=group)
    return gathered.view(world, *rows.shape)


def layout_checksum(keys: Sequence[MetricKey]) -> int:
    """A checksum of a key list that is the same in every process (unlike `hash`): ranks
    send it along with their rows to prove they measured the same tensors in the same order."""
    return zlib.crc32("\n".join("\t".join(k) for k in keys).encode())


def merge_stacked(stacked: torch.Tensor) -> torch.Tensor:
    """Merge ``[n, k, 8]`` partial rows along the first axis."""
    merged = stacked.sum(dim=0)
    merged[:, MIN_COLUMNS] = stacked[:, :, MIN_COLUMNS].amin(dim=0)
    merged[:, MAX_COLUMNS] = stacked[:, :, MAX_COLUMNS].amax(dim=0)
    return merged


# torch 2.13 renamed all_gather_into_tensor; keep working on both sides of the rename.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
