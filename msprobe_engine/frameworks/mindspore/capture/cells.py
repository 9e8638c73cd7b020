"""The MindSpore dump's Cell hooks (L0, mix; PyNative): which Cells, under which names, which hooks.

Every sub-Cell of the net (not the net itself, as PyTorch's dump leaves out the root module)
is named ``Cell.<path>.<Class>`` and gets, while a step is dumped, a forward pre-hook and a
forward hook, and, when backward data is dumped, a backward hook (``hook(cell, grad_input, grad_output)``: the
gradients of the Cell's inputs and of its outputs). A forward hook on the net itself marks
the end of each forward pass (the recorder measures the pass's tensors there, before an
optimizer can change the parameters). Hooks are `jit_safe`: inside `mindspore.jit` and in
GRAPH_MODE they compile to nothing (no Cell hook runs there).
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from mindspore import Parameter, nn

from msprobe_engine.frameworks.mindspore.cell_hooks import jit_safe
from msprobe_engine.handles import Handles

if TYPE_CHECKING:
    from msprobe_engine.frameworks.mindspore.capture.recorder import CellRecorder

PREFIX = "Cell"


def cell_keys(net: nn.Cell) -> dict[str, nn.Cell]:
    """``Cell.<path>.<Class>`` -> Cell, for every sub-Cell of `net` the dump hooks."""
    return {f"{PREFIX}.{path}.{type(cell).__name__}": cell for path, cell in net.cells_and_names() if path}


def own_parameters(cell: nn.Cell) -> list[tuple[str, Parameter]]:
    """The Cell's own parameters (not its children's), by their local names."""
    return list(cell.parameters_and_names(expand=False))


def parameter_owners(net: nn.Cell) -> dict[int, tuple[str, str]]:
    """id(parameter) -> (``Cell.<path>.<Class>`` of the sub-Cell holding it, its local name)."""
    return {id(p): (key, name) for key, cell in cell_keys(net).items() for name, p in own_parameters(cell)}


class DumpCellHooks(Handles):
    """The dump's hooks on one net, on only while a step is dumped (`install`, `remove`).

    MindSpore pays for a Cell hook on every call even when it returns at once (measured on
    the bench MLP: forward hooks on every Cell 1.4x the step time, with backward hooks 2.4x),
    so between dumped steps the net carries none."""

    def __init__(self, recorder: "CellRecorder", net: nn.Cell, backward: bool, cells: bool = True) -> None:
        """`cells`: hook the sub-Cells (L0, mix); the net's own end-of-forward hook is always there."""
        self.recorder = recorder
        self.net = net
        self.backward = backward
        self.cells = [(key, cell, own_parameters(cell)) for key, cell in (cell_keys(net) if cells else {}).items()]
        self.handles: list[Any] = []

    def install(self) -> None:
        if self.handles:
            return
        self.handles.append(self.net.register_forward_hook(jit_safe(self._root_end)))
        for key, cell, params in self.cells:
            self.handles.append(cell.register_forward_pre_hook(jit_safe(partial(self._begin, key))))
            self.handles.append(cell.register_forward_hook(jit_safe(partial(self._end, key, params)),
                                                           with_kwargs=True))
            if self.backward:
                self.handles.append(cell.register_backward_hook(jit_safe(partial(self._backward, key))))

    def _begin(self, key: str, cell: nn.Cell, args: tuple) -> None:
        self.recorder.cell_begin(key)

    def _end(self, key: str, params: list, cell: nn.Cell, args: tuple, kwargs: dict, output: Any) -> None:
        self.recorder.cell_end(key, args, kwargs, output, params)

    def _backward(self, key: str, cell: nn.Cell, grad_input: Any, grad_output: Any) -> None:
        self.recorder.cell_backward(key, grad_input, grad_output)

    def _root_end(self, cell: nn.Cell, args: tuple, output: Any) -> None:
        self.recorder.forward_done()
