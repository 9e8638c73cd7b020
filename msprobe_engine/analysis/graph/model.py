"""The graph of one rank and step: nodes (modules, API calls, groups) in a hierarchy.

A node is one dump entry (``Module.layers.0.Linear.forward.0``, ``Functional.relu.3.forward``)
or a group the builder made (the root, ``Apis_Between_Modules.<n>``). Its parent comes from
construct.json. A comparison adds, per node of the target graph, the matched node of the
reference, a precision class (`PASS`, `WARNING`, `ERROR`; None when not compared) and the
diff of each tensor; the first node in execution order whose own class is `ERROR` is the
first divergence, and its ancestors are marked as containing it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

#: node kinds, numbered as the plugin's ``node_type`` column
MODULE, API, API_GROUP = 0, 1, 9
#: precision classes, as the plugin's ``precision_index`` (0 pass, 0.5 warning, 1 error)
PASS, WARNING, ERROR = 0.0, 0.5, 1.0
PRECISION_OF_STATUS = {"pass": PASS, "warning": WARNING, "error": ERROR}
CLASS_NAMES = {PASS: "pass", WARNING: "warning", ERROR: "error"}
ROOT = "DefaultModel"


@dataclass
class Node:
    """One node. ``inputs``/``outputs`` map a tensor key (``<entry>.input.0``) to its dump
    record, extended by the diff fields of a comparison."""
    name: str
    kind: int
    order: int
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    stack: list[str] = field(default_factory=list)
    precision: float | None = None
    subtree_precision: float | None = None
    reason: str = ""
    matched: str | None = None
    overflow: str | None = None
    first_divergence: bool = False
    contains_divergence: bool = False
    culprit: bool = False
    contains_culprit: bool = False

    @property
    def class_name(self) -> str:
        """``pass``/``warning``/``error`` of the subtree, ``unmatched`` or ``none`` (no comparison)."""
        if self.subtree_precision is None:
            return "unmatched" if self.precision is None and self.reason == "unmatched" else "none"
        return CLASS_NAMES[self.subtree_precision]


@dataclass
class Graph:
    """The nodes of one (step, rank) dump, keyed by name, in execution order."""
    step: int | None
    rank: int | None
    source: str
    nodes: dict[str, Node] = field(default_factory=dict)
    root: str = ROOT
    notes: list[str] = field(default_factory=list)
    first_divergence: str | None = None
    culprit: str | None = None
    task: str = ""
    framework: str = ""

    def add(self, name: str, kind: int, parent: str | None) -> Node:
        """The node `name`, created (last in order) when new; `parent` is set when it has none yet."""
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Node(name, kind, len(self.nodes))
        if parent is not None and node.parent is None and parent != name:
            self.attach(node, parent)
        return node

    def attach(self, node: Node, parent: str) -> None:
        """Make `parent` (which must exist) the parent of `node`, detaching it from its old one."""
        if node.parent is not None:
            self.nodes[node.parent].children.remove(node.name)
        node.parent = parent
        self.nodes[parent].children.append(node.name)

    def ancestors(self, name: str) -> list[str]:
        """Names from the root down to the parent of `name`."""
        chain, seen = [], {name}
        parent = self.nodes[name].parent
        while parent is not None and parent not in seen:
            chain.append(parent)
            seen.add(parent)
            parent = self.nodes[parent].parent
        return chain[::-1]

    def mark_first_divergence(self, name: str) -> None:
        """Mark `name` as the first divergent node and its ancestors as containing it."""
        self.first_divergence = name
        self.nodes[name].first_divergence = True
        for parent in self.ancestors(name):
            self.nodes[parent].contains_divergence = True

    def mark_culprit(self, name: str) -> None:
        """Mark `name` as an incident's culprit and its ancestors as containing it."""
        self.culprit = name
        self.nodes[name].culprit = True
        for parent in self.ancestors(name):
            self.nodes[parent].contains_culprit = True

    def walk(self) -> Iterator[Node]:
        """Every node, parents before children, children in their order."""
        stack = [self.root]
        while stack:
            node = self.nodes[stack.pop()]
            yield node
            stack.extend(reversed(node.children))

    @property
    def label(self) -> str:
        return f"step {self.step if self.step is not None else '-'} rank {self.rank if self.rank is not None else '-'}"
