"""overflow_check for MindSpore (PyNative, L0 Cells, L1 APIs): of each step, the calls whose outputs hold nan/inf.

Every call is recorded as for a statistics dump (`CellRecorder`: statistics batched in one
compiled graph per forward pass, one host transfer per step) and each of its tensors is held
until the step ends: Parameters as a device copy (the optimizer changes them in place before
the step ends), other tensors by reference (a copy per tensor is a MindSpore op each: it made
the step 3x slower than the statistics dump; a tensor written in place later in the step,
``x.add_(...)``, would be saved as it is then, as the statistics dump would measure it). After the transfer the framework-neutral
`dump.step_filter.overflowing` names the first ``overflow_nums`` entries, in execution order,
whose outputs (a backward entry: the input gradients; parameters_grad: the gradients) hold
nan or inf; only their tensors are copied to the host and written as ``.npy`` files, with
``overflow_summary.json``; the other copies are dropped. A clean step writes nothing.
"""
from __future__ import annotations

from typing import Any

from mindspore import Parameter, Tensor

from msprobe_engine.dump.entry import TensorSlot
from msprobe_engine.dump.step_filter import (OVERFLOW_SUMMARY_JSON, held_items, keep_entries, overflow_summary,
                                             overflowing)
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.mindspore.capture.recorder import CellRecorder, host_copy

#: the step's summary (as PyTorch's): which calls overflowed, the first one first
SUMMARY_JSON = OVERFLOW_SUMMARY_JSON


class OverflowCellRecorder(CellRecorder):
    """The MindSpore dump's recorder for ``task: overflow_check``; `overflows` lists (step, first call)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._held: list[tuple[TensorSlot, Tensor, str]] = []
        super().__init__(*args, **kwargs)
        self.copies = self.save_tensors = False  # held on the device; saved only when chosen
        self.overflows: list[tuple[int, str]] = []
        self.step_number = 0

    @property
    def results(self) -> list:
        return self.overflows

    def _reset(self) -> None:
        super()._reset()
        self._held = []

    def _slot(self, tensor: Tensor, name: str) -> TensorSlot:
        slot = super()._slot(tensor, name)
        if slot.kind != "none":
            # Parameters change in place at the optimizer step, before the step ends: a copy; other
            # tensors are held as they are (as the statistics dump holds them until it measures)
            self._held.append((slot, tensor.copy() if isinstance(tensor, Parameter) else tensor, name))
        return slot

    def finish_step(self) -> StepData:
        step, held = self.step_number, self._held
        self.step_number += 1
        data = super().finish_step()  # the one host transfer of statistics; resets the step
        limit = self.config.options.overflow_nums
        names = overflowing(data.entries, data.host_rows, limit)
        kept = keep_entries(data, names)
        if names:
            with self._guard("overflow tensors"):
                self._emit_held(data, names, held)
            self.overflows.append((step, names[0]))
            kept.extra = overflow_summary(step, names, limit)
        return kept

    def _emit_held(self, data: StepData, names: list[str], held: list) -> None:
        items = held_items(data, names, held, "npy", host_copy)
        if items:
            self.emit_tensors(items)
