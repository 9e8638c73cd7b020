"""Model graphs: the hierarchy of a dump, node-by-node comparison of two dumps, and its
outputs (TensorBoard's tb-graph-ascend ``.vis.db``, a self-contained HTML report)."""
from msprobe_engine.analysis.graph.build import build_graph
from msprobe_engine.analysis.graph.model import Graph, Node
from msprobe_engine.analysis.graph.graph_set import GraphSet
from msprobe_engine.analysis.graph.service import build_graphs, incident_graphs, is_incident, write_outputs

__all__ = ["Graph", "GraphSet", "Node", "build_graph", "build_graphs", "incident_graphs", "is_incident",
           "write_outputs"]
