"""No import cycle in the engine: between its files, or between the packages and modules of any
one package (type-only imports under `if TYPE_CHECKING:` included), checked with grimp (which
import-linter uses)."""
from __future__ import annotations

from collections import defaultdict

import grimp
import pytest

GRAPH = grimp.build_graph("msprobe_engine", include_external_packages=False)


def cycles(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    edges = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles(["a", "b", "c", "d"], edges) == [["a", "b", "c"]]


def test_no_import_cycle_between_files():
    edges = defaultdict(set)
    for module in GRAPH.modules:
        edges[module] |= GRAPH.find_modules_directly_imported_by(module)
    assert cycles(sorted(GRAPH.modules), edges) == []


@pytest.mark.parametrize("package", sorted(m for m in GRAPH.modules if GRAPH.find_children(m)))
def test_no_import_cycle_between_the_parts_of_a_package(package):
    """Within `package`, each child module or subpackage (with everything under it) is one node;
    an import from anything under one child of anything under another is an edge."""
    children = sorted(GRAPH.find_children(package))

    def child_of(module: str) -> str | None:
        return next((c for c in children if module == c or module.startswith(c + ".")), None)

    edges = defaultdict(set)
    for module in GRAPH.find_descendants(package):
        source = child_of(module)
        for imported in GRAPH.find_modules_directly_imported_by(module):
            target = child_of(imported)
            if target is not None and target != source:
                edges[source].add(target)
    assert cycles(children, edges) == []
