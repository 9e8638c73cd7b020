"""YAML parsed with ``yaml.SafeLoader`` and a bound on what aliases may expand to.

An alias (``*name``) is the node it names, shared, so parsing stays small; but whoever then
walks the tree (validation, ``json.dumps``) walks every copy: nine nested levels of ten
aliases ("billion laughs") are 10^9 strings from a few hundred bytes. Each alias adds the
size of the node it names to a running total, and the document is refused once that passes
`MAX_EXPANDED` nodes, before anything walks it.
"""
from __future__ import annotations

from typing import Any

import yaml

#: the most nodes the aliases of one document may stand for (a config has a few hundred)
MAX_EXPANDED = 100_000


class AliasBombError(yaml.YAMLError):
    """The aliases of a document expand to more than `MAX_EXPANDED` nodes."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.expanded = 0
        self.sizes: dict[int, int] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                self.expanded += _size(node, self.sizes)
                if self.expanded > MAX_EXPANDED:
                    raise AliasBombError(f"aliases (*{event.anchor}, line {event.start_mark.line + 1}) expand to "
                                         f"more than {MAX_EXPANDED} nodes")
        return super().compose_node(parent, index)


def _size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes below and including `node`, each alias counted in full (memoised; a node still
    being composed, reached through a recursive alias, counts 1)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = 1
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total = 1 + sum(_size(k, sizes) + _size(v, sizes) for k, v in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing aliases that expand beyond `MAX_EXPANDED` nodes."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: where (line and column, from 1) and what."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    what = " ".join(str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part)
    if mark is None:
        return " ".join(str(exc).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {what or type(exc).__name__}"
