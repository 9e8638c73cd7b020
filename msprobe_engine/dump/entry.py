"""Entries of a dump.json: skeletons built on the training thread, rendered on the writer thread.

While a step runs, an entry is a skeleton: the nested lists/dicts of the call's arguments,
with a `TensorSlot` where a tensor was (its dtype, shape, the row of its statistics in the
step's packed statistics, its data_name). Non-tensor values are described at once, as the
predecessor does (``{"type": "int", "value": 3}``; unknown objects as ``{}``). After the
step's one transfer, `render` turns a skeleton into the JSON record, field for field as in
the reference: ``type, dtype, shape, Max, Min, Mean, Norm, requires_grad[, md5][, data_name]``
(PyTorch), ``type, dtype, shape, Max, Min, Mean, Norm[, md5][, data_name]`` (MindSpore): the
`DumpFormat` of the dump's framework says which.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from msprobe_engine.stats import finalize

#: nesting depth of arguments that is described; deeper values are recorded as ``{}``
MAX_DEPTH = 8
#: a leaf function returns this when the value is not one of its types
UNHANDLED = object()

Leaf = Callable[[Any, str], Any]
_PLAIN = (bool, int, float, str)


@dataclass(frozen=True, slots=True)
class DumpFormat:
    """What a framework's dump.json looks like: the tensor records' ``type``, whether they carry
    ``requires_grad``, the module prefix (``Module``/``Cell``), the tensor files' suffix and
    whether integer tensors get a Mean and Norm (the PyTorch predecessor writes null)."""
    framework: str
    tensor_type: str
    requires_grad: bool
    module_prefix: str
    tensor_suffix: str
    int_mean_norm: bool


FORMATS: dict[str, DumpFormat] = {
    "pytorch": DumpFormat("pytorch", "torch.Tensor", True, "Module", ".pt", int_mean_norm=False),
    "mindspore": DumpFormat("mindspore", "mindspore.Tensor", False, "Cell", ".npy", int_mean_norm=True),
}


class TensorSlot:
    """One tensor of an entry. ``kind``: float, int, bool or none (no statistics: empty, meta...);
    ``shape``: any sequence of ints (a torch.Size as the training thread found it), listed when rendered."""
    __slots__ = ("dtype", "shape", "requires_grad", "kind", "row", "data_name", "md5")

    def __init__(self, dtype: str, shape: Sequence[int], requires_grad: bool, kind: str, row: int,
                 data_name: str | None = None) -> None:
        self.dtype, self.shape, self.requires_grad = dtype, shape, requires_grad
        self.kind, self.row, self.data_name = kind, row, data_name
        self.md5: str | None = None


def describe(value: Any, name: str, leaf: Leaf, depth: int = 0) -> Any:
    """The skeleton of `value`; `leaf(value, name)` handles tensors and framework types
    (or returns `UNHANDLED`). `name` is the value's data_name stem (``<entry>.input.0``)."""
    kind = type(value)
    if kind in _PLAIN:
        return {"type": kind.__name__, "value": value}
    if value is None:
        return None
    if kind is list or kind is tuple:  # plain sequences first (a torch.Size is the leaf's)
        if depth >= MAX_DEPTH:
            return {}
        return [describe(v, f"{name}.{i}", leaf, depth + 1) for i, v in enumerate(value)]
    found = leaf(value, name)
    if found is not UNHANDLED:
        return found
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH:
            return {}
        return [describe(v, f"{name}.{i}", leaf, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return {}
        return {str(k): describe(v, f"{name}.{k}", leaf, depth + 1) for k, v in value.items()}
    return plain_value(value)


def plain_value(value: Any) -> dict[str, Any] | None:
    """A non-tensor argument as the predecessor records it."""
    if value is None:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, float, str)):
        return {"type": type(value).__name__, "value": value}
    if isinstance(value, slice):
        parts = [v if isinstance(v, int) or v is None else None for v in (value.start, value.stop, value.step)]
        return {"type": "slice", "value": parts}
    if value is Ellipsis:
        return {"type": "ellipsis", "value": "..."}
    return {}


#: what a non-finite float becomes in rendered records (`StatColumns`'s `special`): float -> value
Special = Callable[[float], Any]
_NONE4 = {"Max": None, "Min": None, "Mean": None, "Norm": None}


class StatColumns:
    """Max/Min/Mean/Norm per packed row, from the step's host rows (one finalize for all),
    rendered as records of the dump format `fmt` (PyTorch's by default). With `special`, every
    non-finite float rendered (statistics and plain arguments) is `special(value)` (the writer's
    JSON encoder writes NaN/Infinity through it)."""

    def __init__(self, host_rows: np.ndarray, fmt: DumpFormat = FORMATS["pytorch"],
                 special: Special | None = None) -> None:
        self.fmt, self.special = fmt, special
        stats = finalize(host_rows) if len(host_rows) else {k: np.empty(0) for k in ("max", "min", "mean", "norm")}
        self.max, self.min, self.mean, self.norm = (_column(stats[k], special) for k in ("max", "min", "mean", "norm"))

    def record(self, slot: TensorSlot) -> dict[str, Any]:
        fmt = self.fmt
        rec: dict[str, Any] = {"type": fmt.tensor_type, "dtype": slot.dtype, "shape": list(slot.shape),
                               **self._values(slot)}
        if fmt.requires_grad:
            rec["requires_grad"] = slot.requires_grad
        if slot.md5 is not None:
            rec["md5"] = slot.md5
        if slot.data_name is not None:
            rec["data_name"] = slot.data_name
        return rec

    def _values(self, slot: TensorSlot) -> dict[str, Any]:
        row, kind = slot.row, slot.kind
        if row < 0 or kind == "none":
            return _NONE4
        high, low = self.max[row], self.min[row]
        if kind == "float":
            return {"Max": high, "Min": low, "Mean": self.mean[row], "Norm": self.norm[row]}
        if kind == "bool":  # the predecessor: Max = any, Min = all, no Mean/Norm
            return {"Max": high > 0, "Min": low > 0, "Mean": None, "Norm": None}
        if type(high) is float and type(low) is float and math.isfinite(high) and math.isfinite(low):
            high, low = int(high), int(low)
        if not self.fmt.int_mean_norm:
            return {"Max": high, "Min": low, "Mean": None, "Norm": None}
        return {"Max": high, "Min": low, "Mean": self.mean[row], "Norm": self.norm[row]}


def _column(values: np.ndarray, special: Special | None) -> list[Any]:
    """`values` as a list; with `special`, its non-finite values mapped through it."""
    listed = values.tolist()
    if special is not None:
        for i in np.flatnonzero(~np.isfinite(values)).tolist():
            listed[i] = special(listed[i])
    return listed


def render(skeleton: Any, columns: StatColumns) -> Any:
    """The JSON value of a skeleton."""
    if isinstance(skeleton, TensorSlot):
        return columns.record(skeleton)
    if isinstance(skeleton, list):
        return [render(item, columns) for item in skeleton]
    if isinstance(skeleton, dict):
        return {k: render(v, columns) for k, v in skeleton.items()}
    if type(skeleton) is float and columns.special is not None and not math.isfinite(skeleton):
        return columns.special(skeleton)
    return skeleton


def render_entries(entries: dict[str, Any], host_rows: np.ndarray, framework: str = "pytorch",
                   special: Special | None = None) -> dict[str, Any]:
    """Render every entry of a step (``data`` of dump.json) in `framework`'s format, keeping their
    order; `special`: see `StatColumns`."""
    return dict(rendered_entries(entries, host_rows, framework, special))


def rendered_entries(entries: dict[str, Any], host_rows: np.ndarray, framework: str = "pytorch",
                     special: Special | None = None) -> Iterator[tuple[str, Any]]:
    """`render_entries` one entry at a time, in order: a writer that encodes each as it comes
    holds one rendered entry at a time (a step's records are not all alive at once, which keeps
    the garbage collector's young generations small)."""
    columns = StatColumns(host_rows, FORMATS[framework], special)
    for name, skeleton in entries.items():
        yield name, render(skeleton, columns)
