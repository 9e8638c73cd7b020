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
    is kept alive): `get` answers only for the same object at the same version. The weak
    references sit apart from the (version, value) pairs, so that a pair of plain values is not
    tracked by the garbage collector (a step records thousands of tensors)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[int, Any]] = {}
        self._refs: dict[int, weakref.ref] = {}

    def get(self, tensor: torch.Tensor, now: int) -> Any:
        key = id(tensor)
        known = self._items.get(key)
        if known is not None and known[0] == now and self._refs[key]() is tensor:
            return known[1]
        return None

    def put(self, tensor: torch.Tensor, now: int, value: Any) -> None:
        key = id(tensor)
        self._items[key] = (now, value)
        self._refs[key] = weakref.ref(tensor)

    def forget(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._items.pop(key, None)
        self._refs.pop(key, None)
