"""Replica drift (silent data corruption): data-parallel replicas whose parameters differ.

Every `every`-th step (monitored), after the optimizer step, each rank hashes its
parameters on the device, one 8-byte checksum per bucket of about `bucket_numel`
elements (the integer sum of the values' bit patterns: any single flipped bit changes it),
and one all-gather brings every rank's checksums ([world, buckets] int64; the only host read).
Ranks holding the same shards (all ranks under DDP, the replicas of a shard under HSDP)
must agree; a rank whose bucket differs from the value most of them hold (ties: the lowest
rank's) adds the rows `train/replica_drift/rank<R>/<parameter>` for the bucket's parameters,
which the `replica_drift` rule turns into an alert.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from msprobe_engine.frameworks.torch.distributed import gather_rows
from msprobe_engine.frameworks.torch.fsdp import local_tensor, shard_position
from msprobe_engine.rules.replica_drift import PREFIX
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

#: integer views of each element size, for the bit-pattern sum
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def buckets(params: Sequence[tuple[str, torch.Tensor]], bucket_numel: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters in buckets of up to `bucket_numel` elements (a larger one alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = bucket_numel
    for name, param in params:
        numel = param.numel()  # the whole tensor's: every rank forms the same buckets
        if size + numel > bucket_numel:
            out.append([])
            size = 0
        out[-1].append((name, param))
        size += numel
    return out


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 sum of `tensor`'s elements read as integers of their size (0-dim, on its device)."""
    flat = local_tensor(tensor.detach()).contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64)


def drifting(hashes: torch.Tensor, positions: Sequence[tuple[int, ...]]) -> dict[int, list[int]]:
    """rank -> indices of its buckets that differ from their replicas', from the gathered
    ``[world, buckets]`` checksums; ranks of equal `positions` are replicas of each other."""
    replicas: dict[tuple[int, ...], list[int]] = {}
    for rank, position in enumerate(positions):
        replicas.setdefault(position, []).append(rank)
    out: dict[int, list[int]] = {}
    for ranks in replicas.values():
        if len(ranks) < 2:
            continue
        for bucket in range(hashes.shape[1]):
            values = [int(hashes[r, bucket]) for r in ranks]
            counts = Counter(values)
            best = max(counts.values())
            reference = next(v for v in values if counts[v] == best)
            for rank, value in zip(ranks, values):
                if value != reference:
                    out.setdefault(rank, []).append(bucket)
    return out


class ReplicaDriftCheck:
    """Installed by `TorchMonitor` when a `replica_drift` rule is configured: a post-step hook
    on the optimizer that compares the replicas every `every` monitored steps."""

    def __init__(self, monitor: "Monitor", optimizer: torch.optim.Optimizer,
                 params: Sequence[tuple[str, torch.Tensor]], mesh: Any, group: Any, every: int,
                 bucket_numel: int) -> None:
        self.monitor = monitor
        self.group = group
        self.every = every
        self.buckets = buckets(params, bucket_numel)
        world = dist.get_world_size(group)
        self.positions = [shard_position(mesh, r) for r in range(world)] if mesh is not None else [()] * world
        self.checks = 0
        self.handle = optimizer.register_step_post_hook(self._post_step)

    def remove(self) -> None:
        self.handle.remove()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        monitor = self.monitor
        if monitor.active and not monitor.replaying and monitor.step % self.every == 0:
            with monitor.guard("replica drift check"):
                self.check()

    def check(self) -> dict[int, list[str]]:
        """Compare the replicas now (a collective: every rank calls it); rank -> drifting parameters."""
        local = torch.stack([torch.stack([checksum(p) for _, p in bucket]).sum() for bucket in self.buckets])
        gathered = gather_rows(local.unsqueeze(0), self.group)  # [world, 1, buckets]
        self.checks += 1
        found = drifting(gathered[:, 0].cpu(), self.positions)
        drift = {rank: [name for b in bucket_ids for name, _ in self.buckets[b]] for rank, bucket_ids in found.items()}
        if drift:
            keys = [MetricKey("train", f"{PREFIX}rank{rank}/{name}") for rank, names in drift.items() for name in names]
            one = self.monitor.backend.scalar(1.0)
            self.monitor.add_tensors(keys, [one] * len(keys))
            for rank, names in drift.items():
                self.monitor.warn(f"replica drift at step {self.monitor.step}: rank {rank}'s parameters differ "
                                  f"from its replicas' in {', '.join(names)}")
        return drift
