"""The first culprit of an anomalous step, from the step's statistics rows alone.

`bad` marks the rows that show the anomaly: non-finite values for `non_finite` incidents,
a norm far above its running average for `spike` incidents.

Forward: the first module call, in the order the calls returned, whose inputs were good and
whose output was bad. Forward hooks fire when a call returns, so a child comes before its
parent: a parent whose child produced the bad value is never named, and a parent is named
when the value went bad in its own code (its children then read a bad input). A call's inputs
are the rows noted in the `CallGraph` (or its own input rows when there is no graph); a call
with no input row counts its inputs as good.

Backward, when every forward row was good: the first bad gradient row in backward order is
the gradient of some tensor; the culprit is the innermost call that read that tensor in the
forward and whose own output gradients were good: its backward made the bad gradient.
Without activation gradients (`watch.activation_grads: false`) this is estimated from the
parameter gradients: the module last in forward order whose parameter gradients are bad.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from msprobe_engine.incident.graph import INPUT_GRAD_KIND, INPUT_KIND, CallGraph, is_ancestor, module_path
from msprobe_engine.stats.table import MetricKey, StatTable

FORWARD_KINDS = ("actv", INPUT_KIND)
BACKWARD_KINDS = ("actv_grad", INPUT_GRAD_KIND)


@dataclass(frozen=True, slots=True)
class Culprit:
    """Where an anomaly started. `call` is None when no watched module fits (the bad value came
    from code outside them); `first_bad` names the first bad row of that phase in execution
    order; `bad` the culprit's own bad rows; `also` other calls that fit as well."""
    phase: str
    call: str | None
    module_class: str | None
    method: str
    first_bad: str
    bad: list[str] = field(default_factory=list)
    also: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def row_name(key: MetricKey) -> str:
    """``kind/path/role`` (the TensorBoard tag without its statistic)."""
    return f"{key.kind}/{key.path}/{key.role}" if key.role else f"{key.kind}/{key.path}"


def first_culprit(table: StatTable, bad: np.ndarray, graph: CallGraph | None = None) -> Culprit | None:
    """The culprit of the anomaly marked by `bad` (one flag per row of `table`); None when
    no forward, gradient or parameter-gradient row is bad."""
    return _Search(table, bad, graph or CallGraph()).run()


class _Search:
    def __init__(self, table: StatTable, bad: np.ndarray, graph: CallGraph) -> None:
        self.keys, self.bad, self.graph = table.keys, bad, graph
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.outputs: dict[str, list[int]] = {}
        self.own_inputs: dict[str, list[int]] = {}
        self.output_grads: dict[str, list[int]] = {}
        for i, key in enumerate(self.keys):
            if key.kind == "actv":
                into = self.outputs if key.role.startswith("output") else self.own_inputs
                into.setdefault(key.path, []).append(i)
            elif key.kind == "actv_grad":
                self.output_grads.setdefault(key.path, []).append(i)

    def run(self) -> Culprit | None:
        return self.forward() or self.backward() or self.parameter_grads()

    def _first_bad(self, kinds: tuple[str, ...]) -> int | None:
        return next((i for i, key in enumerate(self.keys) if key.kind in kinds and self.bad[i]), None)

    def _any_bad(self, rows: list[int]) -> bool:
        return any(self.bad[i] for i in rows)

    def _culprit(self, phase: str, call: str | None, method: str, first: int, bad: Sequence[int] = (),
                 also: Sequence[str] = ()) -> Culprit:
        cls = self.graph.classes.get(module_path(call)) if call is not None else None
        return Culprit(phase, call, cls, method, row_name(self.keys[first]),
                       [row_name(self.keys[i]) for i in bad], list(also))

    def forward(self) -> Culprit | None:
        first = self._first_bad(FORWARD_KINDS)
        if first is None:
            return None
        for call, rows in self.outputs.items():
            bad_out = [i for i in rows if self.bad[i]]
            if bad_out and not self._any_bad(self._inputs(call)):
                return self._culprit("forward", call, "its inputs were good and its output was not", first, bad_out)
        return self._culprit("forward", None, "no watched call had good inputs and a bad output: the bad "
                             "value came from outside the watched modules (data, parameters, the root's code)",
                             first)

    def _inputs(self, call: str) -> list[int]:
        noted = self.graph.reads.get(call)
        if noted is None:
            return self.own_inputs.get(call, [])
        return [self.index[k] for k in noted.values() if k in self.index]

    def backward(self) -> Culprit | None:
        first = self._first_bad(BACKWARD_KINDS)
        if first is None:
            return None
        key = self.keys[first]
        tensor = (self.graph.reads.get(key.path, {}).get(key.role) if key.kind == INPUT_GRAD_KIND
                  else MetricKey("actv", key.path, key.role))
        readers = self.graph.consumers(tensor) if tensor is not None else []
        good = [c for c in readers if not self._any_bad(self.output_grads.get(c, []))]
        innermost = [c for c in good if not any(is_ancestor(c, other) for other in good)]
        if innermost:
            return self._culprit("backward", innermost[0], "its output gradients were good and it read the "
                                 "tensor whose gradient went bad", first, [first], innermost[1:])
        return self._culprit("backward", None, "no watched call read that tensor with good output gradients: "
                             "the gradient went bad in code outside the watched modules", first)

    def parameter_grads(self) -> Culprit | None:
        first = self._first_bad(("grad",))
        if first is None:
            return None
        forward_order = {module_path(call): n for n, call in enumerate(self.outputs)}
        by_module: dict[str, list[int]] = {}
        for i, key in enumerate(self.keys):
            if key.kind == "grad" and self.bad[i]:
                by_module.setdefault(key.path.rpartition(".")[0], []).append(i)
        module = max(by_module, key=lambda m: forward_order.get(m, -1))
        why = ("the watched activation gradients were all good" if any(k.kind in BACKWARD_KINDS for k in self.keys)
               else "no activation gradients watched")
        return self._culprit("backward", module, f"estimate ({why}): the module last in forward order whose "
                             "parameter gradients are bad", first, by_module[module])
