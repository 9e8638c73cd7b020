"""Per-node precision of a target graph against a reference graph, from the rows of `compare`.

Entries are matched and judged by ``analysis.compare`` (its matching, thresholds and
metrics): each row is one tensor pair with a status. A node's own class is the worst status
of its tensors (pass 0, warning 0.5, error 1, the plugin's ``precision_index``); a node
with no tensors of its own (the root, a group, a module only named in construct.json) has
none. ``subtree_precision`` is the worst class in the node's subtree, so the path from the
root to a bad node is coloured. The first divergence is the node, in execution order, whose
own class is error; its ancestors are marked as containing it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msprobe_engine.analysis.compare import RankComparison, Row
from msprobe_engine.analysis.graph.build import tensor_key
from msprobe_engine.analysis.graph.model import ERROR, PRECISION_OF_STATUS, Graph
from msprobe_engine.dump.schema import STAT_KEYS

STAT_DIFF_NAMES = {"Max": "Max diff", "Min": "Min diff", "Mean": "Mean diff", "Norm": "L2norm diff"}
STAT_REL_NAMES = {"Max": "MaxRelativeErr", "Min": "MinRelativeErr", "Mean": "MeanRelativeErr",
                  "Norm": "NormRelativeErr"}
TENSOR_METRIC_NAMES = {"cosine": "Cosine", "max_abs_err": "MaxAbsErr", "max_rel_err": "MaxRelativeErr",
                       "one_thousandth_ratio": "One Thousandth Err Ratio",
                       "five_thousandth_ratio": "Five Thousandths Err Ratio", "euclidean_distance": "EucDist"}


@dataclass
class Structure:
    """How the two graphs differ in structure: entries without a partner, entries paired by
    call site and order rather than by name."""
    only_target: list[str] = field(default_factory=list)
    only_reference: list[str] = field(default_factory=list)
    paired_by_order: int = 0

    @property
    def same(self) -> bool:
        return not self.only_target and not self.only_reference

    def as_dict(self) -> dict[str, Any]:
        return {"same": self.same, "only_target": self.only_target, "only_reference": self.only_reference,
                "paired_by_order": self.paired_by_order}


def diff_fields(row: Row, tensor_mode: bool) -> dict[str, Any]:
    """The diff of one tensor pair under the predecessor's field names (relative errors in %)."""
    out: dict[str, Any] = {}
    for key in STAT_KEYS:
        out[STAT_DIFF_NAMES[key]] = row.get(f"{key}_diff")
        if not tensor_mode:
            rel = row.get(f"{key}_rel_err")
            out[STAT_REL_NAMES[key]] = None if rel is None else f"{rel * 100:.6f}%"
    if tensor_mode:
        out.update({name: row.get(col) for col, name in TENSOR_METRIC_NAMES.items()})
    out["Result"] = row.get("status")
    out["Err_message"] = row.get("reason") or ""
    return out


def apply_comparison(target: Graph, reference: Graph, summary: RankComparison, rows: list[Row]) -> Structure:
    """Fill matches, diff fields, classes and the first divergence of `target` (B) against
    `reference` (A), from the rows of one compared rank pair; the structure difference is returned."""
    tensor_mode = summary.mode == "tensor"
    worst: dict[str, float] = {}
    reasons: dict[str, list[str]] = {}
    for row in rows:
        name_b, name_a = row["entry_b"], row["entry_a"]
        if name_b is None or name_b not in target.nodes:
            continue
        node = target.nodes[name_b]
        if name_a is None:
            node.reason = "unmatched"
            continue
        node.matched = name_a
        key = tensor_key(name_b, row["tensor"])
        record = node.inputs.get(key) or node.outputs.get(key)
        if record is not None:
            record.update(diff_fields(row, tensor_mode))
        status = PRECISION_OF_STATUS.get(row["status"], ERROR)
        worst[name_b] = max(worst.get(name_b, 0.0), status)
        if row["status"] == "error" and row.get("reason"):
            reasons.setdefault(name_b, []).append(f"{row['tensor']}: {row['reason']}")
    for name, value in worst.items():
        target.nodes[name].precision = value
        target.nodes[name].reason = "; ".join(reasons.get(name, [])[:3])
    matched_a = {n.matched for n in target.nodes.values() if n.matched}
    for node in target.nodes.values():  # nodes without an entry (root, groups): matched by name
        if node.matched is None and node.reason != "unmatched" and node.name in reference.nodes \
                and node.name not in matched_a and not node.inputs and not node.outputs:
            node.matched = node.name
    partner = {n.matched: n.name for n in target.nodes.values() if n.matched}
    for node in reference.nodes.values():
        node.matched = partner.get(node.name)
        if node.matched is None:
            node.reason = "unmatched"
    _propagate(target)
    first = min((n for n in target.nodes.values() if n.precision == ERROR), key=lambda n: n.order, default=None)
    if first is not None:
        target.mark_first_divergence(first.name)
    return Structure(list(summary.only_b), list(summary.only_a), len(summary.repaired))


def _propagate(graph: Graph) -> None:
    for node in reversed(list(graph.walk())):  # children before parents
        values = [v for v in [node.precision, *(graph.nodes[c].subtree_precision for c in node.children)]
                  if v is not None]
        node.subtree_precision = max(values) if values else None

