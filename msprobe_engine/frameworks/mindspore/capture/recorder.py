"""The training-thread side of the MindSpore dump (L0): Cell calls -> entry skeletons.

Names as the reference writes them for MindSpore: ``Cell.<path>.<Class>.forward.<n>``,
``.backward.<n>``, ``.parameters_grad.0`` (1.x format: ``.parameters_grad``); counters restart every step and count every call
made while collecting, dumped or not (`dump.select` decides, as for PyTorch).

Tensors are not measured in the hooks: each gets a row and waits; the rows are computed by
the MindSpore backend in ONE batched call (one compiled graph) at the end of each forward
pass of the net (before an optimizer can change the parameters) and at the end of the step,
and the step's rows reach the host in one transfer at `finish_step`. The tensor task (and
``summary_mode: md5``) also needs host copies: they are taken at those same moments.
A backward entry pairs with the latest forward call of its Cell still without one
(MindSpore runs backward hooks in reverse order).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor

from msprobe_engine.dump.entry import UNHANDLED, TensorSlot, describe
from msprobe_engine.dump.recorder import RecorderContext
from msprobe_engine.dump.select import Selection
from msprobe_engine.dump.writer import Frames, StepData
from msprobe_engine.frameworks.mindspore.capture.gated import GatedRecorder
from msprobe_engine.stats import empty_rows

log = logging.getLogger("msprobe_engine")

TensorItems = list[tuple[TensorSlot, np.ndarray]]
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_CELL_MACHINERY = os.path.join("mindspore", "nn", "cell.py")
_FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def tensor_kind(tensor: Tensor) -> str:
    """float, int, bool or none (no statistics: empty or complex)."""
    dtype = tensor.dtype
    if tensor.size == 0 or dtype in (ms.complex64, ms.complex128):
        return "none"
    if dtype == ms.bool_:
        return "bool"
    return "float" if dtype in _FLOATS else "int"


def host_copy(tensor: Tensor) -> np.ndarray:
    """A numpy copy of `tensor` (bfloat16 as float32, which numpy lacks)."""
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.astype(ms.float32)
    return np.array(tensor.asnumpy(), copy=True)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


class CellRecorder(GatedRecorder):
    """Collects one step at a time; `active` is switched by the session (start/stop)."""

    def __init__(self, ctx: RecorderContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        self.backend = ctx.backend
        self.sel = Selection(config)
        self.emit_tensors = ctx.emit_tensors
        self.save_tensors = config.task == "tensor"
        self.copies = self.save_tensors or config.summary_mode == "md5"
        self.transfers = 0
        self._reset()

    @property
    def routes_apis(self) -> bool:
        return self.sel.apis

    def _reset(self) -> None:
        self.entries: dict[str, Any] = {}
        self.construct: dict[str, str | None] = {}
        self.stacks: dict[str, Frames] | None = {} if self.config.stack else None
        self._api_depth = 0  # > 0 inside a recorded API call (calls inside it are not recorded)
        self._frames: Frames | None = None
        self._counters: dict[str, int] = {}
        self._open: list[tuple[str, str, bool]] = []  # (key, forward name, dumped) of running calls
        self._backward: dict[str, list[tuple[str, str | None]]] = {}  # key -> (backward name, parent)
        self._ran: set[str] = set()
        self._waiting: list[tuple[TensorSlot, Tensor]] = []
        self._blocks: list[Tensor] = []
        self._rows = 0
        self.sel.new_step()

    # ---- errors ------------------------------------------------------------------------
    def _guard(self, where: str) -> contextlib.AbstractContextManager:
        """A hook body (see `GatedRecorder._gated`): an error is logged once per `where` and skipped
        (strict: raised)."""
        return self._gated(lambda exc: self.skipped(where, exc, f"msprobe dump: error in {where}"))

    # ---- tensors -----------------------------------------------------------------------
    def _leaf(self, value: Any, name: str) -> Any:
        if isinstance(value, Tensor):
            return self._slot(value, name)
        if isinstance(value, ms.dtype.Type):
            return {"type": "mindspore.dtype", "value": str(value)}
        return UNHANDLED

    def _slot(self, tensor: Tensor, name: str) -> TensorSlot:
        """The tensor's record; its row is computed with the others at the next `flush`."""
        kind = tensor_kind(tensor)
        row = -1
        if kind != "none":
            row = self._rows + len(self._waiting)
        data_name = f"{name}.npy" if self.save_tensors else None
        slot = TensorSlot(str(tensor.dtype), list(tensor.shape), False, kind, row, data_name)
        if row >= 0 or self.copies:
            self._waiting.append((slot, tensor))
        return slot

    def _describe(self, value: Any, name: str) -> Any:
        return describe(value, name, self._leaf)

    def flush(self) -> None:
        """Measure the waiting tensors with one backend call (no host transfer), and hand
        their host copies to the writer when the config asks for copies."""
        waiting, self._waiting = self._waiting, []
        measured = [t for slot, t in waiting if slot.row >= 0]
        if measured:
            self._blocks.append(self.backend.partial_stats(measured))
            self._rows += len(measured)
        if self.copies and waiting:
            self.emit_tensors([(slot, host_copy(t)) for slot, t in waiting])

    def finish_step(self) -> StepData:
        """Close the step: the last measurements and the step's one host transfer."""
        try:
            with self._guard("step end"):
                self.flush()
            host = empty_rows()
            if self._blocks:
                host = self.backend.to_host(self.backend.concat(self._blocks))
                self.transfers += 1
            return StepData(self.entries, self.construct, self.stacks, host)
        finally:
            self._reset()

    # ---- Cells (L0, mix) and APIs (L1, mix) -----------------------------------------------
    def _count(self, key: str) -> int:
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        return n

    def cell_begin(self, key: str) -> None:
        """Forward pre-hook of the Cell named `key` (``Cell.<path>.<Class>``)."""
        if self.active:
            with self._guard(f"forward pre-hook of {key}"):
                n = self._count(key)
                self._begin(key, f"{key}.forward.{n}", f"{key}.backward.{n}")

    def api_begin(self, key: str) -> None:
        """Forward pre-hook of the API named `key` (``Functional.relu``, ``Primitive.matmul.MatMul``)."""
        if not self.active:
            return
        self._api_depth += 1
        if self._api_depth > 1:
            return
        with self._guard(f"API {key}"):
            n = self._count(key)
            self._begin(key, f"{key}.{n}.forward", f"{key}.{n}.backward")

    def _begin(self, key: str, forward: str, backward: str) -> None:
        want = self.sel.want(key, forward, backward)
        in_scope = self.sel.begin(forward)
        parent = self._open[-1][1] if self._open else None
        keep = want.forward and in_scope
        self._open.append((key, forward, keep))
        self._ran.add(key)
        if keep and self.stacks is not None:
            self.stacks[forward] = call_stack()
        if want.backward:
            parent_backward = parent.replace(".forward.", ".backward.") if parent else None
            self._backward.setdefault(key, []).append((backward, parent_backward))

    def cell_end(self, key: str, args: tuple, kwargs: dict, output: Any, params: list[tuple[str, Any]]) -> None:
        """Forward hook of a Cell: its forward entry (inputs, output, own parameters)."""
        self._end(key, args, kwargs, output, params, f"forward hook of {key}")

    def api_end(self, key: str, args: tuple, kwargs: dict, output: Any, func: Any = None) -> None:
        """Forward hook of an API: its forward entry (inputs, output); `func` (the API) is not needed."""
        if self._api_depth == 0:
            return
        self._api_depth -= 1
        if self._api_depth == 0:
            self._end(key, args, kwargs, output, [], f"API {key}")

    def _end(self, key: str, args: tuple, kwargs: dict, output: Any, params: list[tuple[str, Any]],
             where: str) -> None:
        if not self._open or self._open[-1][0] != key:
            return
        with self._guard(where):
            _, forward, keep = self._open.pop()
            self.sel.end(forward)
            if not keep:
                if self.stacks is not None:
                    self.stacks.pop(forward, None)
                return
            entry: dict[str, Any] = {}
            if self.sel.inputs:
                entry["input_args"] = self._describe(list(args), f"{forward}.input")
                entry["input_kwargs"] = self._describe(kwargs, f"{forward}.input")
            if self.sel.outputs:
                entry["output"] = self._describe(_as_list(output), f"{forward}.output")
            if self.sel.inputs and params:
                entry["parameters"] = {k: self._slot(p, f"{forward}.parameters.{k}") for k, p in params}
            self._add(forward, entry, self._open[-1][1] if self._open else None)

    def cell_backward(self, key: str, grad_input: Any, grad_output: Any) -> None:
        """Backward hook of a Cell or API: gradients of its inputs (`grad_input`) and outputs."""
        pending = self._backward.get(key)
        if not self.active or not pending:
            return
        with self._guard(f"backward hook of {key}"):
            backward, parent = pending.pop()
            in_scope = self.sel.begin(backward)
            self.sel.end(backward)
            if not in_scope:
                return
            entry: dict[str, Any] = {}
            if self.sel.inputs:
                entry["input"] = self._grads(grad_output, f"{backward}.input")
            if self.sel.outputs:
                entry["output"] = self._grads(grad_input, f"{backward}.output")
            self._add(backward, entry, parent)

    def api_backward(self, key: str, grad_input: Any, grad_output: Any) -> None:
        """Backward hook of an API. A Primitive's input gradients are recorded last argument first,
        as the predecessor records them (one gradient hook per input, called in that order), so
        that its compare pairs them position by position (an input that needs no gradient, such
        as the data entering the first layer, is recorded too: last)."""
        if key.startswith("Primitive."):
            grad_input = tuple(reversed(_as_list(grad_input)))
        self.cell_backward(key, grad_input, grad_output)

    def _grads(self, grads: Any, name: str) -> list:
        return [self._slot(g, f"{name}.{i}") if isinstance(g, Tensor) else None
                for i, g in enumerate(_as_list(grads))]

    def forward_done(self) -> None:
        """The net's forward pass ended: measure its tensors before an optimizer step."""
        if self.active and self._waiting:
            with self._guard("end of forward"):
                self.flush()

    def param_grads(self, named: list[tuple[str, str, Tensor]]) -> None:
        """Parameter gradients of the step: (``Cell.<path>.<Class>``, local name, gradient)."""
        with self._guard("parameter gradients"):
            for key, name, grad in named:
                entry_name = self._param_grad_name(key)
                if key not in self._ran:
                    continue  # the Cell did not run while collecting in this step
                want = self.sel.want(key, entry_name, entry_name)
                if want.backward and self.sel.outputs and self.sel.begin(entry_name):
                    grads = self.entries.setdefault(entry_name, {}).setdefault(name, [])
                    suffix = f".{len(grads)}" if grads else ""
                    grads.append(self._slot(grad, f"{entry_name}.{name}{suffix}"))

    def _param_grad_name(self, key: str) -> str:
        """``<key>.parameters_grad.0`` as the predecessor's MindSpore dump (26.2) names a Cell's
        gradients of a step (its counter counts gradient passes; `step(grads)` is one pass);
        ``<key>.parameters_grad`` in its 1.x format."""
        if self.config.predecessor_format == "1.x":
            return f"{key}.parameters_grad"
        return f"{key}.parameters_grad.0"

    def _add(self, name: str, entry: dict, parent: str | None) -> None:
        self.entries[name] = entry
        if self.sel.modules:
            self.construct[name] = parent


def call_stack() -> Frames:
    """The caller's stack, innermost first, without this package's frames and MindSpore's Cell
    machinery (``mindspore/nn/cell.py``) between the user's code and the hook."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_PACKAGE_DIR) and not file.endswith(_CELL_MACHINERY):
            frames.append((file, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames
