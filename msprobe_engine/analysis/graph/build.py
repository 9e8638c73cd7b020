"""Build the graph of one rank directory from its dump.json and construct.json.

Every entry of dump.json becomes a node, in execution order; construct.json (written at
levels L0 and mix) gives each its parent. Where construct.json names no parent for a
backward call, the parent's backward counterpart is taken from the forward call (hooks
of in-place layers can lose it). ``parameters_grad`` entries go under the last backward
call of their module. At the top level, runs of two or more consecutive API calls are
grouped into ``Apis_Between_Modules.<n>`` nodes, as the predecessor does. Without
construct.json (level L1) the graph is flat: every call right under the root, with a note.
"""
from __future__ import annotations

import re
from collections import deque
from typing import Any

from msprobe_engine.analysis.graph.model import API, API_GROUP, MODULE, ROOT, Graph, Node
from msprobe_engine.dump.reader import CONSTRUCT_JSON, DumpError, RankDump
from msprobe_engine.dump.schema import iter_tensors, parse_entry_name

API_GROUP_NAME = "Apis_Between_Modules"
_MODULE_BACKWARD = re.compile(r"\.backward\.(\d+)$")
_API_BACKWARD = re.compile(r"\.backward$")
_PARAM_GRAD = re.compile(r"\.parameters_grad(?:\.\d+)?$")
_API_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*\..+\.\d+\.(forward|backward)$")
_ROLE_WORDS = {"input_args": "input", "input_kwargs": "input", "input": "input"}


def node_kind(name: str) -> int:
    """MODULE for module/cell calls and parameter gradients, API for API calls."""
    parsed = parse_entry_name(name)
    if parsed is not None:
        return MODULE if parsed.is_module else API
    if name.startswith(("Module.", "Cell.")) or _PARAM_GRAD.search(name):
        return MODULE
    return API if _API_NAME.match(name) else MODULE


def tensor_key(entry: str, label: str) -> str:
    """The predecessor's name of a tensor of an entry: ``<entry>.input.0``, ``<entry>.output.0``,
    ``<entry>.parameters.weight`` (``input_args``/``input_kwargs`` both read ``input``)."""
    role, _, rest = label.partition(".")
    word = _ROLE_WORDS.get(role, role)
    return f"{entry}.{word}.{rest}" if rest else f"{entry}.{word}"


def _forward_of(name: str) -> str | None:
    if _MODULE_BACKWARD.search(name):
        return _MODULE_BACKWARD.sub(r".forward.\1", name)
    if _API_BACKWARD.search(name):
        return _API_BACKWARD.sub(".forward", name)
    return None


def _backward_of(name: str) -> str:
    return re.sub(r"\.forward\.(\d+)$", r".backward.\1", re.sub(r"\.forward$", ".backward", name))


def resolve_parent(construct: dict[str, Any], name: str) -> str | None:
    """The parent of `name`: construct.json's, else (backward calls) the backward of the forward's parent."""
    parent = construct.get(name)
    if isinstance(parent, str) and parent:
        return parent
    forward = _forward_of(name)
    forward_parent = construct.get(forward) if forward else None
    if isinstance(forward_parent, str) and forward_parent:
        candidate = _backward_of(forward_parent)
        if candidate in construct:
            return candidate
    return None


def _fill_tensors(node: Node, entry: Any) -> None:
    if not isinstance(entry, dict):
        return
    grad = _PARAM_GRAD.search(node.name)  # the predecessor numbers them: <module>.parameters_grad.0
    for ref in iter_tensors(node.name[:grad.start()] + ".parameters_grad" if grad else node.name, entry):
        side = node.inputs if ref.is_input else node.outputs
        side[tensor_key(node.name, ref.label)] = dict(ref.record)


def _stacks(dump: RankDump) -> dict[str, list[str]]:
    """entry -> stack lines; stack.json maps entries to lines, or (predecessor) ids to [entries, lines]."""
    doc = dump.stack()
    out: dict[str, list[str]] = {}
    for key, value in doc.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
            for entry in value[0]:
                out[str(entry)] = [str(line) for line in value[1]] if isinstance(value[1], list) else [str(value[1])]
        elif isinstance(value, list):
            out[key] = [str(line) for line in value]
    return out


def _would_cycle(graph: Graph, node: str, parent: str) -> bool:
    while parent is not None:
        if parent == node:
            return True
        parent = graph.nodes[parent].parent
    return False


def _attach_parameter_grads(graph: Graph) -> None:
    last_backward: dict[str, tuple[int, str]] = {}
    for name in graph.nodes:
        if m := _MODULE_BACKWARD.search(name):
            prefix = name[:m.start()]
            if int(m.group(1)) >= last_backward.get(prefix, (-1, ""))[0]:
                last_backward[prefix] = (int(m.group(1)), name)
    for node in list(graph.nodes.values()):
        m = _PARAM_GRAD.search(node.name)
        if m and node.parent == graph.root and node.name[:m.start()] in last_backward:
            graph.attach(node, last_backward[node.name[:m.start()]][1])


def _group_top_level_apis(graph: Graph) -> None:
    root = graph.nodes[graph.root]
    children, grouped, run = list(root.children), [], []

    def flush() -> None:
        if len(run) < 2:
            grouped.extend(run)
        else:
            group = graph.add(f"{API_GROUP_NAME}.{sum(n.startswith(API_GROUP_NAME) for n in grouped)}", API_GROUP, None)
            group.order = graph.nodes[run[0]].order
            group.parent = graph.root
            for name in run:
                graph.nodes[name].parent = group.name
            group.children = list(run)
            grouped.append(group.name)
        run.clear()

    for name in children:
        if graph.nodes[name].kind == API:
            run.append(name)
            continue
        flush()
        grouped.append(name)
    flush()
    root.children = grouped


def build_graph(dump: RankDump) -> Graph:
    """The graph of one rank directory (see the module docstring)."""
    graph = Graph(dump.step, dump.rank, str(dump.path), task=dump.task, framework=dump.framework)
    graph.add(ROOT, MODULE, None)
    construct = dump.construct()
    if not isinstance(construct, dict):
        raise DumpError(f"{dump.path / CONSTRUCT_JSON}: expected an object (entry -> parent entry), "
                        f"got {type(construct).__name__}")
    stacks = _stacks(dump)
    for name, entry in dump.data.items():
        node = graph.add(name, node_kind(name), None)
        _fill_tensors(node, entry)
        node.stack = stacks.get(name, [])
    if not construct:
        level = dump.meta.get("level", "?")
        graph.notes.append(f"{dump.path}: no {CONSTRUCT_JSON} (dump level {level}): the model hierarchy needs a "
                           f"dump of level L0 or mix; the graph shows the calls flat, in execution order")
        for node in list(graph.nodes.values())[1:]:
            graph.attach(node, graph.root)
        return graph
    for name in construct:
        graph.add(name, node_kind(name), None)
    pending = deque(list(graph.nodes.values())[1:])
    while pending:
        node = pending.popleft()
        parent = resolve_parent(construct, node.name)
        if parent is not None and parent not in graph.nodes:
            pending.append(graph.add(parent, node_kind(parent), None))  # named as a parent only
        if parent is None or _would_cycle(graph, node.name, parent):
            parent = graph.root
        graph.attach(node, parent)
    for node in graph.nodes.values():  # parents before children in order: a parent is listed when it starts
        node.children.sort(key=lambda n: graph.nodes[n].order)
    _attach_parameter_grads(graph)
    _group_top_level_apis(graph)
    return graph
