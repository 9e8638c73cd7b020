"""Arguments of one API call rebuilt from its dump entry: tensors loaded from the dump's files, or
generated to match the recorded statistics and shape (a statistics dump), non-tensor values as
recorded. Online cases carry the tensors themselves in place of records.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch

from msprobe_engine.dump.reader import RankDump
from msprobe_engine.dump.schema import TensorRef, is_tensor_record


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float16`` -> torch.float16; a ValueError naming the dtype if torch has none."""
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def case_generator(name: str) -> torch.Generator:
    """The generator of one case's generated inputs, seeded from its name (the same inputs every run)."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def tensor_from_stats(record: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
    """A tensor of the record's dtype and shape with values in [Min, Max], both reached (the
    predecessor's random mode: uniform between the recorded extremes)."""
    dtype, shape = torch_dtype(record["dtype"]), tuple(record["shape"])
    numel = 1
    for size in shape:
        numel *= size
    low, high = _finite(record.get("Min"), dtype, 0.0), _finite(record.get("Max"), dtype, 1.0)
    if dtype == torch.bool:
        flat = torch.full((numel,), bool(high))
        if numel and not low:
            flat[0] = False
        return flat.reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:
        flat = torch.rand(numel, generator=generator, dtype=torch.float64) * (high - low) + low
    else:
        flat = torch.randint(int(low), int(high) + 1, (numel,), generator=generator, dtype=torch.int64)
    if numel >= 2:
        flat[0], flat[-1] = low, high
    return flat.to(dtype).reshape(shape)


def _finite(value: Any, dtype: torch.dtype, default: float) -> float:
    """A recorded extreme as a finite number of `dtype`'s range (inf is clipped, nan/None -> default)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or value != value:
        return default
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype) if dtype != torch.bool else None
    return float(min(max(value, info.min), info.max)) if info is not None else float(value)


class Arguments:
    """Rebuilds the values of one entry (``entry_name``) of `source` (None: tensors are inline)."""

    def __init__(self, entry_name: str, source: RankDump | None, generator: torch.Generator) -> None:
        self.entry_name, self.source, self.generator = entry_name, source, generator

    def value(self, item: Any, role: str, path: tuple = ()) -> Any:
        """The Python value of a recorded item (lists become lists, tensor records tensors)."""
        if item is None or isinstance(item, torch.Tensor):
            return item
        if isinstance(item, list):
            return [self.value(sub, role, path + (i,)) for i, sub in enumerate(item)]
        if not isinstance(item, dict):
            raise ValueError(f"{self.entry_name}.{role}: unexpected item {item!r}")
        if is_tensor_record(item):
            return self.tensor(TensorRef(self.entry_name, role, path, item))
        if "type" not in item:
            return {k: self.value(sub, role, path + (k,)) for k, sub in item.items()}
        return plain(item)

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        if self.source is not None and ref.record.get("data_name"):
            loaded = self.source.open_tensor(ref)
            return loaded.clone() if isinstance(loaded, torch.Tensor) else torch.from_numpy(loaded.copy())
        return tensor_from_stats(ref.record, self.generator)


def plain(item: dict[str, Any]) -> Any:
    """A non-tensor value as the dump records it (``{"type": "int", "value": 3}``)."""
    kind, value = item["type"], item.get("value")
    if kind == "slice":
        return slice(*value)
    if kind == "ellipsis":
        return Ellipsis
    if kind == "torch.dtype":
        return torch_dtype(value)
    if kind == "torch.device":
        return torch.device(value)
    if kind == "torch.Size":
        return torch.Size(value)
    return value
