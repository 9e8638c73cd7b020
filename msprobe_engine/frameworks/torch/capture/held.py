"""A dump recorder that writes only some calls of each step, with their real tensors.

Every captured call is recorded as for a statistics dump (statistics batched on the device)
and a device copy of each of its tensors is held until the step ends (one copy per tensor
version). After the step's one host transfer of statistics, `choose` (overflow_check,
diff_check) names the entries to write; only their tensors are copied to the host and saved
as .pt files, the other copies are released. A step where nothing is chosen writes nothing.

Cost: a device copy of every recorded tensor until the step ends (narrow it with list/scope);
no host synchronisation per call.
"""
from __future__ import annotations

from typing import Any

import torch

from msprobe_engine.dump.entry import TensorSlot
from msprobe_engine.dump.step_filter import held_items, keep_entries
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.torch.capture.recorder import Recorder
from msprobe_engine.frameworks.torch.tensor_identity import KnownTensors, version


class HeldTensorsRecorder(Recorder):
    """Base of the recorders that keep chosen calls; subclasses implement `choose`."""

    shares_slots = False  # a chosen entry's slots are named (data_name) after the step
    measures_at_hooks = False  # held tensors are cloned before in-place calls (the API mode)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._held: list[tuple[TensorSlot, torch.Tensor, str]] = []
        self._clones = KnownTensors()
        super().__init__(*args, **kwargs)
        self.copies = self.save_tensors = False  # held on the device; saved only when chosen

    def choose(self, step: int, data: StepData, held: list[tuple[TensorSlot, torch.Tensor, str]]
               ) -> tuple[list[str], dict[str, Any] | None]:
        """(the entries of the step to write, in order; more JSON files of the rank directory)."""
        raise NotImplementedError

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
        with torch._C.DisableTorchFunction():
            names, extra = self.choose(step, data, held)
            if names:
                self._emit_held(data, names, held)
        kept = keep_entries(data, names)
        kept.extra = extra
        return kept

    def _emit_held(self, data: StepData, names: list[str], held: list) -> None:
        items = held_items(data, names, held, "pt", _to_cpu)
        if items:
            self.emit_tensors(items)


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu")
