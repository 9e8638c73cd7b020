"""Recognising a tensor seen earlier in a step: same object, same in-place version."""
from __future__ import annotations

import weakref
from typing import Any

import torch


def version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (-1 for inference tensors, which have none)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


class KnownTensors:
    """Values attached to tensors by identity and version (a weak reference, so no tensor
    is kept alive): `get` answers only for the same object at the same version."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, int, Any]] = {}

    def get(self, tensor: torch.Tensor, now: int) -> Any:
        known = self._items.get(id(tensor))
        if known is not None and known[1] == now and known[0]() is tensor:
            return known[2]
        return None

    def put(self, tensor: torch.Tensor, now: int, value: Any) -> None:
        self._items[id(tensor)] = (weakref.ref(tensor), now, value)

    def forget(self, tensor: torch.Tensor) -> None:
        self._items.pop(id(tensor), None)
