"""Pieces the trainer callbacks (HF Trainer, Lightning) share: hook handles as one
attachment, and the ranks' agreement on a skip/stop decision."""
from __future__ import annotations

import torch


class Handles:
    """torch hook handles, removed together (a `Monitor` attachment)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def agree(skip: bool, stop: bool) -> tuple[bool, bool]:
    """DDP: every rank decides on its own loss and activations; all take the most cautious
    decision (one all-reduce of two flags over the default group)."""
    import torch.distributed as dist

    flags = torch.tensor([float(skip or stop), float(stop)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])
