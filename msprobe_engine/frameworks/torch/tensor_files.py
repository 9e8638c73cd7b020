"""Tensor files of PyTorch dumps (``.pt``), for the framework-neutral readers.

Loaded with ``torch.load(weights_only=True)``: never code, only a tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


def load_tensor_file(file: Path, mapped: bool = False) -> Any:
    """A .pt file as a numpy array (bfloat16 and other types numpy lacks become float32), or with
    ``mapped`` the torch tensor itself, memory-mapped (files of the legacy, non-zip format are read
    instead)."""
    if mapped:
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "zipfile" not in str(e):  # only the legacy format cannot be mapped
                raise
            obj = torch.load(file, map_location="cpu", weights_only=True)
    else:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"holds a {type(obj).__name__}, not a tensor")
    obj = obj.detach().resolve_conj().resolve_neg()
    if mapped:
        return obj
    try:
        return obj.numpy()
    except TypeError:  # bfloat16, float8: types numpy lacks
        return obj.float().numpy()


def numpy_copier(buffer: np.ndarray) -> Callable[[int, Any], None]:
    """`copy(row, tensor)`: a 1-D torch tensor copied (and converted) into row `row` of `buffer`."""
    view = torch.from_numpy(buffer)

    def copy(row: int, tensor: Any) -> None:
        view[row, :len(tensor)].copy_(tensor)

    return copy
