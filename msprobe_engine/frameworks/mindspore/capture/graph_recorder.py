"""The MindSpore L0 statistics dump in GRAPH_MODE: Cell entries
from the rows measured inside the compiled graph.

`watch(net)` taps every sub-Cell of the net (`graph_capture.GraphCapture`: the Cell's outputs,
positional inputs and the gradients w.r.t. its outputs, reduced inside the graph); it must run
before the net is first compiled (`debugger.start(net)` before the first call). At each step's
end the rows (and the parameter gradients given to `debugger.step(grads)`) reach the host in
one transfer and become the reference's MindSpore entries:
``Cell.<path>.<Class>.forward.0`` (``input_args``, ``output``) and ``.backward.0`` (``input``: the
gradients w.r.t. the outputs), ``.parameters_grad.0``. What the graph cannot give is left out:
keyword inputs, the gradients w.r.t. the inputs (the backward entry's ``output`` is empty), the
Cell's own parameters; a Cell called several times a step has one entry (its calls merged); a
tuple gives its first `graph_capture.ROWS_PER_CELL` items. `scope` and `list` are not applied.
"""
from __future__ import annotations

import logging
from typing import Any

from mindspore import Tensor, nn

from msprobe_engine.dump.entry import TensorSlot
from msprobe_engine.dump.recorder import DumpRecorder, RecorderContext
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.mindspore.capture.cells import PREFIX
from msprobe_engine.frameworks.mindspore.capture.recorder import tensor_kind
from msprobe_engine.frameworks.mindspore.graph_capture import GraphCapture
from msprobe_engine.stats import empty_rows
from msprobe_engine.stats.table import MetricKey

log = logging.getLogger("msprobe_engine")


def _kind(dtype: str) -> str:
    return "bool" if dtype == "Bool" else "float" if "Float" in dtype else "int"


class GraphCellRecorder(DumpRecorder):
    """Collects one step at a time from the taps in the compiled graph (see the module docstring)."""

    records_calls = False

    def __init__(self, ctx: RecorderContext) -> None:
        super().__init__(ctx)
        self.backend = ctx.backend
        self.capture: GraphCapture | None = None
        self._names: dict[str, str] = {}  # Cell path -> Cell.<path>.<Class>
        self._grads: list[tuple[str, str, Tensor]] = []
        self._collecting = False
        self._dumped = False  # collected in this step

    @property
    def active(self) -> bool:
        return self._collecting

    @active.setter
    def active(self, value: bool) -> None:
        self._collecting = value
        self._dumped = self._dumped or value

    def watch(self, model: nn.Cell) -> None:
        cells = [(path, cell) for path, cell in model.cells_and_names() if path]
        self._names = {path: f"{PREFIX}.{path}.{type(cell).__name__}" for path, cell in cells}
        self.capture = GraphCapture(cells, (True, True, True), False, log.warning)

    def param_grads(self, named: list[tuple[str, str, Tensor]]) -> None:
        """The step's parameter gradients: (``Cell.<path>.<Class>``, local name, gradient)."""
        self._grads = [(key, name, g) for key, name, g in named if tensor_kind(g) != "none"]

    def finish_step(self) -> StepData:
        """The step's entries and its one host transfer; the taps' Parameter is reset."""
        dumped, self._dumped = self._dumped, False
        grads, self._grads = self._grads, []
        taken = self.capture.take(dumped) if self.capture is not None else None
        entries: dict[str, Any] = {}
        blocks = []
        if taken is not None:
            keys, rows = taken
            blocks.append(rows)
            for i, key in enumerate(keys):
                self._place(entries, key, i)
        if grads:
            first = len(taken[0]) if taken is not None else 0
            blocks.append(self.backend.partial_stats([g for _, _, g in grads]))
            for n, (key, name, grad) in enumerate(grads):
                slot = TensorSlot(str(grad.dtype), list(grad.shape), False, tensor_kind(grad), first + n)
                entries.setdefault(f"{key}.parameters_grad.0", {})[name] = [slot]
        host = self.backend.to_host(self.backend.concat(blocks)) if blocks else empty_rows()
        if blocks:
            self.transfers += 1
        return StepData(entries, {}, None, host)

    def _place(self, entries: dict[str, Any], key: MetricKey, row: int) -> None:
        """The slot of row `row` (`key`: kind, Cell path, role) in its entry."""
        dtype, shape = self.capture.meta[key]
        slot = TensorSlot(dtype, shape, False, _kind(dtype), row)
        role, _, item = key.role.partition(".")
        index = int(item) if item else 0
        cell = self._names[key.path]
        if key.kind == "actv_grad":
            entry = entries.setdefault(f"{cell}.backward.0", {"input": [], "output": []})
            _put(entry["input"], index, slot)
        else:
            entry = entries.setdefault(f"{cell}.forward.0", {"input_args": [], "input_kwargs": {}, "output": []})
            _put(entry["input_args" if role == "input" else "output"], index, slot)

    def remove(self) -> None:
        if self.capture is not None:
            self.capture.remove()


def _put(items: list, index: int, slot: TensorSlot) -> None:
    items.extend([None] * (index + 1 - len(items)))
    items[index] = slot
