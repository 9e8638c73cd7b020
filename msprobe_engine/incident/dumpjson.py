"""The anomalous step's statistics as the ``data`` of an msprobe dump.json (task statistics, L0).

Entries, in execution order:

- ``Module.<path>.<Class>.forward.<n>``: ``input_args`` / ``input_kwargs`` (the rows that
  measured the call's inputs, see `CallGraph`) and ``output``;
- ``Module.<path>.<Class>.backward.<n>``: ``input`` (gradients of the outputs) and ``output``
  (the gradient of each positional input tensor: its whole gradient, which is the call's own
  when the call alone reads it);
- ``Module.<path>.<Class>.parameters_grad``: one gradient per parameter.

So `analyze` finds in it the same first culprit as the incident, forward and backward.

The rows of all micro-steps are merged (``forward.<n>`` is the n-th call within a micro-step);
dtype and shape are those of the last micro-step. Parameters, optimizer state and the loss
have no place in this format; they are in the incident's metrics.jsonl. The records follow the
monitored framework's format (`dump.entry.FORMATS`): MindSpore's are ``Cell.`` entries of
``mindspore.Tensor`` records without ``requires_grad``.
"""
from __future__ import annotations

from typing import Any, Sequence

from msprobe_engine.dump.entry import FORMATS, TensorSlot, render_entries
from msprobe_engine.incident.graph import INPUT_GRAD_KIND, INPUT_KIND, CallGraph, call_index, module_path
from msprobe_engine.json_text import json_special
from msprobe_engine.stats import P_NUMEL
from msprobe_engine.stats.table import MetricKey, StatTable

#: (dtype, shape, requires_grad) of the tensor a row measured
TensorMeta = tuple[Any, Sequence[int], bool]


def entry_name(prefix: str, path: str, cls: str | None, *tail: str) -> str:
    """``Module.<path>.<Class>.<tail...>`` (the root module's own entries omit the path); an
    unknown class is written as the prefix (``Module``, ``Cell``)."""
    return ".".join([prefix, *([path] if path else []), cls or prefix, *tail])


def call_entry_name(prefix: str, call: str, cls: str | None, phase: str) -> str:
    """``Module.<path>.<Class>.<phase>.<n>`` of the module call ``<path>[:<n>]``."""
    return entry_name(prefix, module_path(call), cls, phase, str(call_index(call)))


def stats_dump(table: StatTable, graph: CallGraph | None, meta: dict[MetricKey, TensorMeta],
               framework: str = "pytorch") -> dict[str, Any]:
    """The rendered ``data`` of dump.json for one step's statistics (`graph`: see `CallGraph`),
    in the format of `framework` (``pytorch`` or ``mindspore``), non-finite values as `json_special`
    (for `dump_json_text`)."""
    prefix = FORMATS[framework].module_prefix
    entries = _Builder(table, graph or CallGraph(), meta, prefix).entries()
    return render_entries(entries, table.partials, framework, json_special)


class _Builder:
    def __init__(self, table: StatTable, graph: CallGraph, meta: dict[MetricKey, TensorMeta], prefix: str) -> None:
        self.table, self.graph, self.meta, self.prefix = table, graph, meta, prefix
        self.index = {key: i for i, key in enumerate(table.keys)}
        self.rows: dict[tuple[str, str], list[MetricKey]] = {}
        self.latest = 0  # the last row `slot` used
        for key in table.keys:
            self.rows.setdefault((key.kind, key.path), []).append(key)

    def entries(self) -> dict[str, Any]:
        """Entries in execution order: a forward entry where its call returned (its first row),
        a backward entry where its last gradient arrived, as a dump orders them (of two backward
        entries completed by the same gradient, the later begun, i.e. the inner, first)."""
        out: dict[str, tuple[int, Any]] = {}
        for i, key in enumerate(self.table.keys):
            cls = self.graph.classes.get(module_path(key.path))
            if key.kind in ("actv", INPUT_KIND):
                name = call_entry_name(self.prefix, key.path, cls, "forward")
                if name not in out:
                    out[name] = (i, self.forward(key.path))
            elif key.kind in ("actv_grad", INPUT_GRAD_KIND):
                name = call_entry_name(self.prefix, key.path, cls, "backward")
                if name not in out:
                    self.latest = i
                    entry = self.backward(key.path)
                    out[name] = (self.latest, entry)
            elif key.kind == "grad":
                owner, _, param = key.path.rpartition(".")
                name = entry_name(self.prefix, owner, self.graph.classes.get(owner), "parameters_grad")
                out.setdefault(name, (i, {}))[1][param] = [self.slot(key, requires_grad=False)]
        ranked = sorted(enumerate(out.items()), key=lambda item: (item[1][1][0], -item[0]))
        return {name: entry for _, (name, (_, entry)) in ranked}

    def forward(self, call: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"input_args": [], "input_kwargs": {}, "output": []}
        noted = self.graph.reads.get(call)
        inputs = (noted.items() if noted is not None else
                  [(k.role, k) for k in self.rows.get(("actv", call), []) if k.role.startswith("input")])
        for role, key in inputs:
            if key in self.index:
                _place_input(entry, role, self.slot(key))
        for key in self.rows.get(("actv", call), []):
            if key.role.startswith("output"):
                _place_output(entry["output"], key.role, self.slot(key))
        return entry

    def backward(self, call: str) -> dict[str, Any]:
        """``input``: the gradients of the call's outputs; ``output``: those of its positional
        inputs (each input tensor's whole gradient, as measured where the tensor was first seen)."""
        entry: dict[str, Any] = {"input": [], "output": []}
        for key in self.rows.get(("actv_grad", call), []):
            _place_output(entry["input"], key.role, self.slot(key, requires_grad=False))
        for role, key in self.graph.reads.get(call, {}).items():
            grad = _gradient_key(self.graph.tensor_of(key))
            position = role.split(".")[1]
            if grad in self.index and position.isdigit():
                _insert(entry["output"], [position], self.slot(grad, requires_grad=False))
        return entry

    def slot(self, key: MetricKey, requires_grad: bool | None = None) -> TensorSlot:
        row = self.index[key]
        self.latest = max(self.latest, row)
        numel = int(self.table.partials[row, P_NUMEL])
        dtype, shape, grad = self.meta.get(key, ("unknown", [numel], False))
        dtype = str(dtype)
        kind = "none" if numel == 0 else "bool" if "bool" in dtype.lower() else \
            "int" if "int" in dtype.lower() else "float"
        return TensorSlot(dtype, [int(d) for d in shape], bool(grad if requires_grad is None else requires_grad),
                          kind, row)


def _gradient_key(key: MetricKey) -> MetricKey:
    """The row of the gradient of the tensor that `key` measured in the forward."""
    kind = INPUT_GRAD_KIND if key.role.startswith("input") else "actv_grad"
    return MetricKey(kind, key.path, key.role)


def _place_input(entry: dict[str, Any], role: str, slot: TensorSlot) -> None:
    """``input.<i>...`` goes to input_args, ``input.<name>...`` to input_kwargs."""
    parts = role.split(".")[1:]
    if parts and parts[0].isdigit():
        _insert(entry["input_args"], parts, slot)
    elif parts:
        _insert(entry["input_kwargs"], parts, slot)


def _place_output(outputs: list, role: str, slot: TensorSlot) -> None:
    """``output`` is the one output, ``output.<i>...`` an element, ``output.<key>...`` a dict item."""
    parts = role.split(".")[1:]
    if not parts:
        outputs.append(slot)
    elif parts[0].isdigit():
        _insert(outputs, parts, slot)
    else:
        if not outputs or not isinstance(outputs[0], dict):
            outputs.insert(0, {})
        _insert(outputs[0], parts, slot)


def _insert(node: list | dict, parts: list[str], value: Any) -> None:
    """Put `value` at `parts` (list positions or dict keys) inside `node`, creating containers."""
    head: Any = parts[0]
    rest = parts[1:]
    if isinstance(node, list):
        head = int(head)
        node.extend([None] * (head + 1 - len(node)))
        current = node[head]
    else:
        current = node.get(head)
    if not rest:
        node[head] = value
        return
    if not isinstance(current, (list, dict)):
        current = node[head] = [] if rest[0].isdigit() else {}
    _insert(current, rest, value)
