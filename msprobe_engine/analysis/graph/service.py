"""`graph`: build the graphs of a dump (one per step and rank), or compare two dumps node by node,
or turn an incident directory into the graph of its failing step; write the plugin's file,
the HTML report and a JSON summary.

Rank directories of the two dumps pair by (step, rank). Where the layouts differ (the same
model on 1 and on 2 ranks), every rank of a step pairs with the other dump's only rank of
that step; entries then match by name, and tensors sharded by tensor parallelism differ in
shape (reported as errors, not merged: see docs/graph.md).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from msprobe_engine.analysis.compare import Thresholds, compare_rank_dumps
from msprobe_engine.analysis.graph.build import build_graph
from msprobe_engine.analysis.graph.graph_set import GraphSet
from msprobe_engine.analysis.graph.html_report import write_html
from msprobe_engine.analysis.graph.model import Graph
from msprobe_engine.analysis.graph.precision import apply_comparison
from msprobe_engine.analysis.graph.vis_db import write_vis_db
from msprobe_engine.analysis.overflow import analyze_rank, load_ignore_rules
from msprobe_engine.dump.reader import DumpError, DumpKey, RankDump, load_dump, read_json

INCIDENT_JSON = "incident.json"
SUMMARY_JSON = "graph_summary.json"


def pair_rank_dumps(a: dict[DumpKey, RankDump], b: dict[DumpKey, RankDump]) -> tuple[list[tuple[RankDump, RankDump]],
                                                                                      list[str]]:
    """(reference, target) pairs: by (step, rank); a single rank dir on a side pairs with every
    rank of the other side in the same step (a single dir on both sides pairs as is)."""
    if len(a) == 1 and len(b) == 1:
        return [(next(iter(a.values())), next(iter(b.values())))], []
    pairs, problems = [], []
    for key, target in b.items():
        if key in a:
            pairs.append((a[key], target))
            continue
        same_step = [d for k, d in a.items() if k[0] == key[0]]
        if len(same_step) == 1:
            pairs.append((same_step[0], target))
        else:
            problems.append(f"step {key[0]} rank {key[1]}: no reference rank directory for {target.path}")
    paired = {id(ref) for ref, _ in pairs}
    problems += [f"step {k[0]} rank {k[1]}: only in the reference ({d.path})" for k, d in a.items()
                 if id(d) not in paired]
    return pairs, problems


def _mark_overflow(graph: Graph, dump: RankDump, rules: dict) -> None:
    for finding in analyze_rank(dump, rules).findings:
        if finding.entry in graph.nodes:
            graph.nodes[finding.entry].overflow = finding.level


def build_graphs(target: Path | str, reference: Path | str | None = None, *, overflow_check: bool = False,
                 thresholds: Thresholds | None = None) -> GraphSet:
    """The graphs of dump `target`; with `reference`, each compared with its paired reference graph.

    With `overflow_check`, nodes with nan/inf get the level of `analyze` (critical, high, medium).
    """
    dumps_b = load_dump(target, strict=False)
    rules = load_ignore_rules() if overflow_check else {}
    result = GraphSet([], overflow_check=overflow_check)
    if reference is None:
        for dump in dumps_b.values():
            graph = build_graph(dump)
            if overflow_check:
                _mark_overflow(graph, dump, rules)
            result.targets.append(graph)
            result.problems += dump.problems
        return result
    pairs, result.problems = pair_rank_dumps(load_dump(reference, strict=False), dumps_b)
    if not pairs:
        raise DumpError(f"{target} and {reference}: no rank directories to pair")
    for dump_a, dump_b in pairs:
        summary, rows = compare_rank_dumps(dump_a, dump_b, thresholds)
        graph_a, graph_b = build_graph(dump_a), build_graph(dump_b)
        result.structures.append(apply_comparison(graph_b, graph_a, summary, rows))
        result.mode = summary.mode
        result.problems += summary.problems
        if overflow_check:
            _mark_overflow(graph_b, dump_b, rules)
            _mark_overflow(graph_a, dump_a, rules)
        result.targets.append(graph_b)
        result.references.append(graph_a)
    return result


def is_incident(path: Path | str) -> bool:
    return (Path(path) / INCIDENT_JSON).is_file()


def incident_graphs(directory: Path | str) -> GraphSet:
    """The graph of an incident's failing step, its culprit marked, nan/inf marked.

    The replay's dump (it has construct.json) is used when the step was replayed, else the
    incident's statistics dump (no construct.json: a flat graph, with a note saying so).
    """
    directory = Path(directory)
    incident = read_json(directory / INCIDENT_JSON)
    if not isinstance(incident, dict):
        raise DumpError(f"{directory / INCIDENT_JSON}: expected an object")
    replay = directory / "replay"
    source = replay if replay.is_dir() and any(replay.iterdir()) else directory / "dump"
    result = build_graphs(source, overflow_check=True)
    culprit = incident.get("culprit")
    culprit = culprit.get("dump_entry") if isinstance(culprit, dict) else None  # a culprit of another shape: none marked
    for graph in result.targets:
        if culprit in graph.nodes:
            graph.mark_culprit(culprit)
        else:
            graph.notes.append(f"{directory}: the incident names no culprit call" if not culprit else
                               f"{directory}: culprit {culprit} is not a node of {graph.source}")
    return result


def _output_dir(out: Path) -> Path:
    """`out` when it is new (created here, mode 0o755 at most) or empty, else a new subdirectory."""
    if out.exists() and not out.is_dir():
        raise OSError(f"{out}: not a directory")
    if not out.exists():
        out.mkdir(parents=True)
        os.chmod(out, os.stat(out).st_mode & ~0o022)
        return out
    if not any(out.iterdir()):
        return out
    stem = f"graph_{time.strftime('%Y%m%d%H%M%S')}"
    for n in range(1000):
        sub = out / (stem if n == 0 else f"{stem}_{n}")
        try:
            sub.mkdir(mode=0o755)
            return sub
        except FileExistsError:
            continue
    raise OSError(f"{out}: no free graph_<time> subdirectory name")


def write_outputs(result: GraphSet, out_dir: Path | str) -> dict[str, Path]:
    """Write ``<kind>_<time>.vis.db`` (for TensorBoard), ``<kind>_<time>.html`` and
    ``graph_summary.json`` into `out_dir`; their paths by kind (``vis_db``, ``html``, ``summary``).

    A directory that already holds files (a shared one, /tmp, an earlier output) is neither
    overwritten nor re-permissioned: the outputs go into a new ``graph_<time>`` directory in it.
    A directory the tool creates is closed to other users (group and others cannot write)."""
    out = _output_dir(Path(out_dir))
    stem = f"{'compare' if result.compared else 'build'}_{time.strftime('%Y%m%d%H%M%S')}"
    task = "all" if result.mode == "tensor" else "summary"
    db = write_vis_db(out / f"{stem}.vis.db", result.targets, result.references or None, task=task,
                      overflow_check=result.overflow_check)
    html = write_html(out / f"{stem}.html", result)
    summary = out / SUMMARY_JSON
    summary.write_text(json.dumps(result.summary(), indent=1, default=str) + "\n", encoding="utf-8")
    return {"vis_db": db, "html": html, "summary": summary}
