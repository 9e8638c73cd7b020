"""`PrecisionDebugger.save(variable, name, save_backward)`: the predecessor's level ``debug``.

Each call records `variable` (a tensor, or lists/tuples/dicts of them and of plain values) as
``<name>.<n>.debug`` in the step's ``debug.json`` (``n`` counts the calls with that name in the
step), and, with `save_backward`, the gradients that later flow into its tensors as
``<name>_grad.<n>.debug`` (the same nesting; null where no gradient came). The records are
those of dump.json (``type, dtype, shape, Max, Min, Mean, Norm, requires_grad[, data_name]``);
task ``tensor`` also saves each tensor as ``dump_tensor_data/<name>.<n>.debug.<i>.pt``.

Statistics stay on the device until `finish_step` (one host transfer); the file is written by
the writer thread into ``dump_path/step<N>/<rank dir>/debug.json``.
"""
from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from msprobe_engine.dump.entry import UNHANDLED, TensorSlot, describe, render_entries
from msprobe_engine.dump.reader import TENSOR_DIR
from msprobe_engine.dump.writer import rank_dir_name, write_file
from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.frameworks.torch.capture.recorder import dtype_name, tensor_kind
from msprobe_engine.frameworks.torch.capture.stat_buffer import StatBuffer
from msprobe_engine.sinks.writer import BackgroundWriter

DEBUG_JSON = "debug.json"


class _Grad:
    """Where the gradient of one saved tensor goes when it arrives."""
    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.slot: TensorSlot | None = None


class DebugSave:
    """The records of `save` calls of one step, written at `finish_step`."""

    def __init__(self, dump_path: Path, task: str, legacy: bool, writer: BackgroundWriter) -> None:
        self.dump_path = Path(dump_path)
        self.task = task
        self.legacy = legacy
        self.writer = writer
        self.stats = StatBuffer(torch_backend)
        self.entries: dict[str, Any] = {}
        self.counts: dict[str, int] = {}
        self.copies: list[tuple[str, torch.Tensor]] = []

    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        """Record `variable` now (and its gradients when they come)."""
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        stem = f"{name}.{n}.debug"
        self.entries[stem] = describe(variable, stem, self._leaf)
        if save_backward:
            grad_stem = f"{name}_grad.{n}.debug"
            self.entries[grad_stem] = self._grads(variable, grad_stem)

    def finish_step(self, step: int, rank: int | None) -> None:
        """Hand the step's debug.json to the writer (nothing when nothing was saved)."""
        if not self.entries:
            return
        host = self.stats.to_host()
        entries = {name: _resolve(skeleton) for name, skeleton in self.entries.items()}
        target = self.dump_path / f"step{step}" / rank_dir_name(rank, self.legacy)
        self.writer.submit(partial(_write, target, self.task, entries, host, self.copies), "debug.json", wait=True)
        self.stats.reset()
        self.entries, self.counts, self.copies = {}, {}, []

    def _leaf(self, value: Any, name: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return UNHANDLED
        return self._slot(value, name)

    def _slot(self, tensor: torch.Tensor, name: str) -> TensorSlot:
        kind = tensor_kind(tensor)
        row = self.stats.row(tensor.detach().abs() if tensor.is_complex() else tensor.detach()) if kind != "none" else -1
        saved = self.task == "tensor" and not tensor.is_meta
        slot = TensorSlot(dtype_name(tensor.dtype), list(tensor.shape), tensor.requires_grad, kind, row,
                          f"{name}.pt" if saved else None)
        if saved:
            self.copies.append((slot.data_name, tensor.detach().to("cpu", copy=True)))
        return slot

    def _grads(self, value: Any, name: str) -> Any:
        """The nesting of `value` with a `_Grad` at each tensor that will receive a gradient."""
        if isinstance(value, torch.Tensor):
            holder = _Grad()
            if value.requires_grad:
                value.register_hook(partial(self._grad_arrived, holder, name))
            return holder
        if isinstance(value, (list, tuple)):
            return [self._grads(v, f"{name}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {str(k): self._grads(v, f"{name}.{k}") for k, v in value.items()}
        return None

    def _grad_arrived(self, holder: _Grad, name: str, grad: torch.Tensor) -> None:
        holder.slot = self._slot(grad, name)


def _resolve(skeleton: Any) -> Any:
    if isinstance(skeleton, _Grad):
        return skeleton.slot
    if isinstance(skeleton, list):
        return [_resolve(item) for item in skeleton]
    if isinstance(skeleton, dict):
        return {k: _resolve(v) for k, v in skeleton.items()}
    return skeleton


def _write(target: Path, task: str, entries: dict[str, Any], host: Any, copies: list) -> None:
    """On the writer thread: tensor files, then debug.json (written whole, then renamed)."""
    target.mkdir(parents=True, exist_ok=True)
    data_dir = target / TENSOR_DIR
    for data_name, tensor in copies:
        data_dir.mkdir(exist_ok=True)
        torch.save(tensor, data_dir / data_name)
    document = {"task": task, "level": "debug", "framework": "pytorch",
                "dump_data_dir": str(data_dir.resolve()) if copies else None,
                "data": render_entries(entries, host)}
    partial_file = target / f".{DEBUG_JSON}.partial"
    write_file(partial_file, json.dumps(document, indent=1))
    os.replace(partial_file, target / DEBUG_JSON)
