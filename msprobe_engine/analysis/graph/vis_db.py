"""Write graphs as the SQLite ``.vis.db`` file that TensorBoard's ``tb-graph-ascend`` plugin
(8.3.2) reads: tables ``tb_nodes`` (one row per node and graph), ``tb_config`` (one row:
build or compare, colours, ranks, steps) and ``tb_stack`` (call stacks), as the
predecessor's ``msprobe graph_visualize`` writes them. Target graphs are the plugin's
``NPU`` side, reference graphs its ``Bench`` side. The plugin refuses files and directories
that others can write to, so the file is made 0640 and its directory is not group-writable.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.graph.model import Graph, Node

TARGET, REFERENCE = "NPU", "Bench"
NODE_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "graph_id": "TEXT NOT NULL", "node_order": "INTEGER NOT NULL",
    "node_name": "TEXT NOT NULL", "node_type": "TEXT NOT NULL", "up_node": "TEXT", "sub_nodes": "TEXT",
    "precision_index": "INTEGER", "overflow_level": "TEXT", "micro_step_id": "INTEGER NOT NULL",
    "matched_node_link": "TEXT", "stack_id": "TEXT", "parallel_merge_info": "TEXT", "matched_distributed": "TEXT",
    "modified": "INTEGER NOT NULL", "input_data": "TEXT", "output_data": "TEXT", "data_source": "TEXT",
    "dump_data_dir": "TEXT", "step": "INTEGER NOT NULL", "rank": "INTEGER NOT NULL", "is_distributed": "INTEGER",
}
CONFIG_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "graph_type": "TEXT NOT NULL", "task": "TEXT", "tool_tip": "TEXT",
    "micro_steps": "INTEGER", "overflow_check": "INTEGER", "node_colors": "TEXT NOT NULL",
    "rank_list": "TEXT NOT NULL", "step_list": "TEXT NOT NULL",
}
STACK_COLUMNS = {"id": "TEXT PRIMARY KEY", "stack_info": "TEXT"}
INDEXES = {
    "index1": ["step", "rank", "data_source", "up_node", "node_order"],
    "index2": ["step", "rank", "data_source", "node_name"],
    "index3": ["step", "rank", "data_source", "node_order"],
    "index4": ["step", "rank", "node_order"],
    "index5": ["step", "rank", "micro_step_id", "node_order"],
    "index6": ["step", "rank", "modified", "matched_node_link"],
}
#: colour -> the precision_index range it stands for (the plugin's legend)
NODE_COLORS = {
    "#FFFCF3": {"value": [0, 0.3], "description": "all tensors of this node (and below) pass",
                "accuracy_level": "pass"},
    "#FFDC7F": {"value": [0.3, 0.6], "description": "a tensor of this node (or below) passes a warning threshold",
                "accuracy_level": "warning"},
    "#FF704D": {"value": [0.6, 1], "description": "a tensor of this node (or below) differs beyond the error "
                                                  "threshold", "accuracy_level": "error"},
    "#C7C7C7": {"value": [], "description": "no partner in the other run", "accuracy_level": "unmatched node"},
}
TOOL_TIPS = {
    "Max diff": "target minus reference, maximum", "Min diff": "target minus reference, minimum",
    "Mean diff": "target minus reference, mean", "L2norm diff": "target minus reference, L2 norm",
}


def graph_key(graph: Graph) -> tuple[int, int]:
    """(step, rank) as the plugin numbers them: 0 where the dump directory names none."""
    return (graph.step or 0, graph.rank or 0)


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return str(value)


def display_records(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Tensor records as the plugin shows them: every value a string; a record whose Max is
    null (a None argument, a non-tensor) collapses to ``{"value": "null"}``."""
    out = {}
    for key, record in records.items():
        shown = {k: _text(v) for k, v in record.items()}
        if shown.get("Max") == "null" and "Max diff" not in shown:
            shown = {"value": "null"}
        out[key] = shown
    return out


def _link(node: Node, other: Graph | None) -> list[str]:
    if other is None or node.matched is None or node.matched not in other.nodes:
        return []
    return [*other.ancestors(node.matched), node.matched]


def _rows(graph: Graph, source: str, key: tuple[int, int], other: Graph | None, stacks: dict[str, str],
          compared: bool) -> list[tuple]:
    """The node rows of `graph`, filed under `key` (a reference graph under its target's key)."""
    step, rank = key
    rows = []
    for node in graph.nodes.values():
        stack_text = json.dumps(node.stack)
        stack_id = stacks.setdefault(stack_text, f"{source}_{step}_{rank}_{len(stacks)}")
        rows.append((
            f"{source}_{step}_{rank}_{node.name}", f"{source}_{step}_{rank}", node.order, node.name, str(node.kind),
            node.parent or "", json.dumps(node.children) if node.children else "",
            node.subtree_precision if compared and source == TARGET else None, node.overflow, 0,
            json.dumps(_link(node, other)), stack_id, "", "{}", 0,
            json.dumps(display_records(node.inputs)), json.dumps(display_records(node.outputs)),
            source, graph.source, step, rank, 0))
    return rows


def _create(conn: sqlite3.Connection, table: str, columns: dict[str, str]) -> str:
    conn.execute(f"CREATE TABLE {table} ({', '.join(f'{k} {v}' for k, v in columns.items())})")
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def write_vis_db(path: Path, targets: list[Graph], references: list[Graph] | None = None, *,
                 task: str = "summary", overflow_check: bool = False) -> Path:
    """Write `targets` (and, for a comparison, the `references` paired with them) to `path`."""
    compared = bool(references)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # renamed into place whole: a failure leaves nothing
    partial.unlink(missing_ok=True)
    try:
        _write(partial, targets, references, compared, task, overflow_check)
        os.chmod(partial, 0o640)
        os.replace(partial, path)
    except sqlite3.Error as exc:  # a full disk, a file system sqlite cannot lock
        raise OSError(f"{path}: cannot write the graph database: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


def _write(path: Path, targets: list[Graph], references: list[Graph] | None, compared: bool, task: str,
           overflow_check: bool) -> None:
    stacks: dict[str, str] = {}
    conn = sqlite3.connect(path)
    try:
        insert_node = _create(conn, "tb_nodes", NODE_COLUMNS)
        for i, graph in enumerate(targets):
            other = references[i] if compared else None
            conn.executemany(insert_node, _rows(graph, TARGET, graph_key(graph), other, stacks, compared))
            if other is not None:
                conn.executemany(insert_node, _rows(other, REFERENCE, graph_key(graph), graph, stacks, compared))
        insert_stack = _create(conn, "tb_stack", STACK_COLUMNS)
        conn.executemany(insert_stack, [(sid, text) for text, sid in stacks.items()])
        insert_config = _create(conn, "tb_config", CONFIG_COLUMNS)
        keys = [graph_key(g) for g in targets]
        conn.execute(insert_config, ("1", "compare" if compared else "build", task,
                                     json.dumps(TOOL_TIPS if compared else {}), 1, int(overflow_check),
                                     json.dumps(NODE_COLORS), json.dumps(sorted({r for _, r in keys})),
                                     json.dumps(sorted({s for s, _ in keys}))))
        for name, columns in INDEXES.items():
            conn.execute(f"CREATE INDEX {name} ON tb_nodes ({', '.join(columns)})")
        conn.commit()
    finally:
        conn.close()
