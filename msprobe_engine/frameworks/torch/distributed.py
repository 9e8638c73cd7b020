"""Merge partial-statistics rows across the ranks of a torch.distributed group: one policy for
every integration (DeepSpeed, Megatron-core, DDP/FSDP).

One collective per group and transfer: every rank contributes its packed rows (the same keys
in the same order) plus one marker row holding a checksum of the key layout; they are
all-gathered into ``[world, k + 1, n_columns()]`` and each row is combined as its policy says:

- `MERGE`: the ranks hold different pieces (shards, other data): the exact merge of
  `stats.columns` (min of mins, max of maxes, sums add);
- `ONCE`: the ranks hold copies (a replicated parameter): the first rank's row;
- `LOCAL`: rank-local data kept as it is (per-rank records): this rank's own row;
- `AUTO`: `ONCE` where every rank measured the very same bits, `MERGE` otherwise.

The marker is checked (one small host read) the first time a layout is seen: ranks that
measured different tensors fail loudly instead of merging unrelated rows. No full tensor is
ever gathered.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from msprobe_engine.stats.columns import merge_indices
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.incident.actions import StepDecision

MERGE, ONCE, LOCAL, AUTO = "merge", "once", "local", "auto"

Policy = Callable[[MetricKey], str]


class GroupMerge:
    """Merges packed rows over one process group (`what` names it in errors: "data", "tensor")."""

    def __init__(self, group: object = None, what: str = "data") -> None:
        self.group = group
        self.what = what
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._checked: set[int] = set()
        self._masks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = {}

    def __call__(self, keys: Sequence[MetricKey], rows: torch.Tensor, policy: Policy,
                 checksum: int | None = None) -> torch.Tensor:
        """`rows` merged over the group, row `i` as `policy(keys[i])` says."""
        if self.world == 1:
            return rows
        checksum = layout_checksum(keys) if checksum is None else checksum
        marker = torch.full((1, rows.shape[1]), float(checksum), dtype=rows.dtype, device=rows.device)
        stacked = gather_rows(torch.cat([rows, marker]), self.group)
        if checksum not in self._checked:
            if bool((stacked[:, -1] != float(checksum)).any()):
                raise RuntimeError(
                    f"msprobe: the ranks of the {self.what}-parallel group measured different tensors this "
                    "step (the module calls differ between ranks, e.g. data-dependent branches, or not every "
                    "rank reported a loss); their statistics cannot be merged. Every rank must run the same "
                    "modules and report alike; or watch fewer modules (config `modules`).")
            self._checked.add(checksum)
        stacked = stacked[:, :-1]
        once, local, auto, any_auto = self._policy_masks(checksum, keys, policy, rows.device)
        if any_auto:
            bits = stacked.view(torch.int64)
            once = once | (auto & (bits == bits[:1]).all(dim=2).all(dim=0))
        merged = torch.where(once[:, None], stacked[0], merge_stacked(stacked))
        return torch.where(local[:, None], rows, merged)

    def _policy_masks(self, checksum: int, keys: Sequence[MetricKey], policy: Policy,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(once, local, auto) row masks of a layout, built once per layout."""
        masks = self._masks.get(checksum)
        if masks is None:
            kinds = [policy(key) for key in keys]
            once, local, auto = ([k == p for k in kinds] for p in (ONCE, LOCAL, AUTO))
            masks = self._masks[checksum] = (torch.tensor(once, dtype=torch.bool, device=device),
                                            torch.tensor(local, dtype=torch.bool, device=device),
                                            torch.tensor(auto, dtype=torch.bool, device=device), any(auto))
        return masks


def agree(decision: "StepDecision", group: object, device: torch.device) -> "StepDecision":
    """A skip/stop decision taken on rank-local rows (`per_rank`), made the same on every rank of
    `group`: one all-reduce (MAX) of (skip, stop), so any rank's skip or stop applies to all
    (`StepDecision.joined`). Call it on every rank of the group; a reducer's `agree` (called by
    `Monitor.before_optimizer_step`)."""
    return decision.joined(*agree_flags(decision.skip, decision.stop, group, device))


def agree_flags(skip: bool, stop: bool, group: object = None, device: torch.device | str = "cpu") -> tuple[bool, bool]:
    """The collective skip/stop decision: one all-reduce (MAX) of the two flags over `group`
    (None: the default group), so every rank takes the most cautious one; (skip, stop)."""
    flags = torch.tensor([float(skip or stop), float(stop)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    skip, stop = (bool(f) for f in flags.tolist())
    return skip, stop


def gather_rows(rows: torch.Tensor, group: object = None) -> torch.Tensor:
    """All-gather every rank's ``[k, n_columns()]`` rows into ``[world, k, n_columns()]`` (one collective)."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
    _all_gather(gathered, rows.contiguous(), group=group)
    return gathered.view(world, *rows.shape)


def layout_checksum(keys: Sequence[MetricKey]) -> int:
    """A checksum of a key list that is the same in every process (unlike `hash`): ranks
    send it along with their rows to prove they measured the same tensors in the same order."""
    return zlib.crc32("\n".join("\t".join(k) for k in keys).encode())


def merge_stacked(stacked: torch.Tensor) -> torch.Tensor:
    """Merge ``[n, k, n_columns()]`` partial rows along the first axis (`stats.columns`' merge)."""
    merged = stacked.sum(dim=0)
    for kind, reduce in (("min", torch.amin), ("max", torch.amax)):
        at = merge_indices(kind)
        merged[:, at] = reduce(stacked[:, :, at], dim=0)
    return merged


# torch 2.13 renamed all_gather_into_tensor; keep working on both sides of the rename.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
