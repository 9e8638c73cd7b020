"""`GraphSet`: the graphs of one `graph` run (targets, their references and structures), and its summary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msprobe_engine.analysis.graph.model import Graph
from msprobe_engine.analysis.graph.precision import Structure


@dataclass
class GraphSet:
    """Graphs of the target dump and, for a comparison, the reference graph paired with each."""
    targets: list[Graph]
    references: list[Graph] = field(default_factory=list)
    structures: list[Structure] = field(default_factory=list)
    mode: str = "statistics"
    overflow_check: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def compared(self) -> bool:
        return bool(self.references)

    def summary(self) -> dict[str, Any]:
        """Per graph: where it came from, notes, the first divergence / culprit, structure; JSON-ready."""
        graphs = []
        for i, graph in enumerate(self.targets):
            item: dict[str, Any] = {"step": graph.step, "rank": graph.rank, "dump": graph.source,
                                    "nodes": len(graph.nodes), "notes": graph.notes}
            if self.compared:
                first = graph.nodes.get(graph.first_divergence) if graph.first_divergence else None
                item.update(reference=self.references[i].source,
                            first_divergence=None if first is None else
                            {"node": first.name, "ancestors": graph.ancestors(first.name)[1:], "reason": first.reason},
                            structure=self.structures[i].as_dict())
            if graph.culprit:
                item["culprit"] = {"node": graph.culprit, "ancestors": graph.ancestors(graph.culprit)[1:]}
            if self.overflow_check:
                item["overflow"] = {n.name: n.overflow for n in graph.nodes.values() if n.overflow}
            graphs.append(item)
        return {"mode": self.mode if self.compared else "build", "graphs": graphs, "problems": self.problems}
