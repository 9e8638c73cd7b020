"""Text summary of a `graph` run for the terminal."""
from __future__ import annotations

from pathlib import Path

from msprobe_engine.analysis.graph.graph_set import GraphSet
from msprobe_engine.analysis.graph.tensorboard import format_command


def format_graphs(result: GraphSet, files: dict[str, Path]) -> str:
    """What was built, what diverged first, how the structures differ, and where the files are."""
    lines = []
    def path(graph, name: str) -> str:
        return " > ".join(graph.ancestors(name)[1:]) or "the root"

    for i, graph in enumerate(result.targets):
        head = f"{graph.label}: {len(graph.nodes)} nodes ({graph.source})"
        lines.append(head + (f" vs {result.references[i].source}" if result.compared else ""))
        lines += [f"  note: {note}" for note in graph.notes]
        if result.compared:
            first = graph.first_divergence
            lines.append(f"  first divergence: {first} (in {path(graph, first)}): {graph.nodes[first].reason}"
                         if first else "  first divergence: none")
            structure = result.structures[i]
            if not structure.same:
                lines.append(f"  structure differs: {len(structure.only_target)} node(s) only in the target "
                             f"{structure.only_target[:5]}, {len(structure.only_reference)} only in the reference "
                             f"{structure.only_reference[:5]}")
        if graph.culprit:
            lines.append(f"  culprit: {graph.culprit} (in {path(graph, graph.culprit)})")
        overflow = [n.name for n in graph.nodes.values() if n.overflow]
        if overflow:
            lines.append(f"  nan/inf in {len(overflow)} node(s), first {overflow[0]}")
    if result.problems:
        lines.append(f"{len(result.problems)} problem(s) in the input, first: {result.problems[0]}")
    lines.append(f"TensorBoard (tb-graph-ascend): {format_command(files['vis_db'].parent)}")
    lines.append(f"HTML report: {files['html']}")
    lines.append(f"summary: {files['summary']}")
    return "\n".join(lines)
