"""FSDP2 (`torch.distributed.fsdp.fully_shard`): this rank's shards of DTensor parameters,
gradients and optimizer state, and which replica of a shard this rank is.

FSDP2 keeps each parameter as a DTensor sharded on dim 0 over the mesh's shard dimension
(and replicated over the replicate dimension of an HSDP 2-D mesh); its gradient, after the
reduce-scatter, and its AdamW moments are DTensors with the same placements. A statistic of
the full tensor is the exact merge of the statistics of its local shards, taken once per
shard: on an HSDP mesh only the ranks at replicate coordinate 0 contribute.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor`: a DTensor's local shard (a pending reduction, e.g. a norm
    computed on shards, is completed first); any other tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    if any(p.is_partial() for p in tensor.placements):
        return tensor.full_tensor()
    return tensor.to_local()


def lead_replica(tensor: DTensor) -> bool:
    """Whether this rank holds the first copy of its shard of `tensor` (coordinate 0 on every
    mesh dimension over which `tensor` is replicated)."""
    coordinate = tensor.device_mesh.get_coordinate() or ()
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if isinstance(p, Replicate))


def shard_groups(params: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], set[str]]:
    """(names of the DTensor parameters, names of those this rank measures as a non-lead
    replica, whose rows must not be counted twice)."""
    sharded, copies = set(), set()
    for name, param in params:
        if isinstance(param, DTensor):
            sharded.add(name)
            if not lead_replica(param):
                copies.add(name)
    return sharded, copies


def shard_position(mesh: Any, rank: int) -> tuple[int, ...]:
    """The coordinates of global `rank` on the mesh's shard dimension (the last; an HSDP mesh is
    (replicate, shard)): ranks with equal positions hold the same shards (HSDP replicas)."""
    where = (mesh.mesh == rank).nonzero()
    return tuple(where[0].tolist()[-1:]) if len(where) else ()


class LocalShards:
    """A statistics backend that measures the local shard of every DTensor it is given (the
    torch backend's other functions unchanged): the monitor's backend under FSDP2."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def partial_stats(self, tensors: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return self._backend.partial_stats([local_tensor(t) for t in tensors], *args, **kwargs)

    def difference_stats(self, after: Sequence[torch.Tensor], before: Sequence[torch.Tensor], *args: Any,
                         **kwargs: Any) -> Any:
        """The rows of the local shards' differences (both sides of each pair sharded alike)."""
        return self._backend.difference_stats([local_tensor(t) for t in after], [local_tensor(t) for t in before],
                                              *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)
