"""overflow_check for PyTorch: the dump's recorder, keeping only the calls whose outputs overflow.

Every captured call is recorded as for a statistics dump (statistics batched on the device)
and a device copy of each of its tensors is held until the step ends. The step's one host
transfer of statistics then says which calls produced nan/inf; the first ``overflow_nums``
of them, in execution order, are written (dump.json entries, their tensors as .pt files and
``overflow_summary.json``); the held copies are released. A clean step writes nothing.

Cost: a device copy of every recorded tensor until the step ends (narrow it with
list/scope), no host synchronisation per call.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from msprobe_engine.dump.entry import TensorSlot
from msprobe_engine.dump.step_filter import iter_slots, keep_entries, overflowing
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.torch.capture.recorder import Recorder
from msprobe_engine.frameworks.torch.tensor_identity import KnownTensors, version

log = logging.getLogger("msprobe_engine")
#: the step's summary: which calls overflowed, the first one first
SUMMARY_JSON = "overflow_summary.json"


class OverflowRecorder(Recorder):
    """The dump's recorder for ``task: overflow_check``; `overflows` lists (step, first call) so far."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._held: list[tuple[TensorSlot, torch.Tensor, str]] = []
        self._clones = KnownTensors()
        super().__init__(*args, **kwargs)
        self.copies = self.save_tensors = False  # tensors are held on the device, saved only if they overflow
        self.overflows: list[tuple[int, str]] = []
        self.last_overflowed: list[str] = []

    def _reset(self) -> None:
        super()._reset()
        self._held, self._clones = [], KnownTensors()

    def _slot(self, tensor: torch.Tensor, name: str) -> TensorSlot:
        slot = super()._slot(tensor, name)
        if slot.kind != "none":
            now = version(tensor)
            clone = self._clones.get(tensor, now)
            if clone is None:
                clone = tensor.detach().clone()
                self._clones.put(tensor, now, clone)
            self._held.append((slot, clone, name))
        return slot

    def finish_step(self) -> StepData:
        step, held = self._step_id, self._held
        data = super().finish_step()  # the one host transfer of statistics; resets the step
        names = overflowing(data.entries, data.host_rows, self.config.options.overflow_nums)
        self.last_overflowed = names
        if names:
            self.overflows.append((step, names[0]))
            log.warning("msprobe overflow_check: step %d: %d call(s) with nan/inf dumped; the first is %s",
                        step, len(names), names[0])
            self._emit_held(data, names, held)
        kept = keep_entries(data, names)
        if names:
            kept.extra = {SUMMARY_JSON: {"step": step, "overflow_nums": self.config.options.overflow_nums,
                                         "first_overflow": names[0], "overflowed": names}}
        return kept

    def _emit_held(self, data: StepData, names: list[str], held: list) -> None:
        wanted = {id(slot) for name in names for slot in iter_slots(data.entries[name])}
        items = []
        for slot, clone, name in held:
            if id(slot) in wanted:
                slot.data_name = f"{name}.pt"
                items.append((slot, clone.to("cpu")))
        if items:
            self.emit_tensors(items)
