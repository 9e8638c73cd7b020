"""Command line: ``msprobe-engine <verb> ...`` (also ``python -m msprobe_engine``).

A verb is one entry of ``VERBS``: its help line, a function adding its arguments to a
sub-parser, and a function running it from the parsed arguments (returning the exit code).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from msprobe_engine.dump.reader import DumpError


class Verb(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _write_json(obj: Any, target: str) -> None:
    text = json.dumps(obj, indent=1, default=str)
    if target == "-":
        print(text)
    else:
        Path(target).write_text(text + "\n", encoding="utf-8")


# ------------------------------------------------------------------ analyze

def _analyze_arguments(p: argparse.ArgumentParser) -> None:
    from msprobe_engine.analysis.overflow import MUTATION_RATIO

    p.add_argument("dump", help="a rank directory (with dump.json) or a dump root with step*/rank*/")
    p.add_argument("--rules", action="append", default=[], metavar="YAML",
                   help="extra ignore rules (same layout as the packaged ignore_rules.yaml); repeatable")
    p.add_argument("--mutation-ratio", type=float, default=MUTATION_RATIO,
                   help="output Norm above this many times the input Norm is a numerical mutation "
                        f"(default {MUTATION_RATIO:g})")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON ('-' prints it instead of the table)")


def _analyze_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.overflow import analyze
    from msprobe_engine.analysis.report import format_analysis

    results = analyze(args.dump, rules=args.rules, mutation_ratio=args.mutation_ratio)
    if args.json != "-":
        print(format_analysis(results))
    if args.json:
        _write_json([r.as_dict() for r in results], args.json)
    return 0


# ------------------------------------------------------------------ compare

def _threshold(text: str) -> tuple[str, float]:
    from msprobe_engine.analysis.compare import Thresholds

    name, _, value = text.partition("=")
    names = [f.name for f in dataclasses.fields(Thresholds)]
    if name not in names:
        raise argparse.ArgumentTypeError(f"unknown threshold {name!r}; one of {', '.join(names)}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"threshold {name}: {value!r} is not a number") from None


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    from msprobe_engine.analysis.runs import ATOL, RTOL

    p.add_argument("a", help="baseline: a dump (rank dir or dump root) or a monitor run (dir or metrics.jsonl)")
    p.add_argument("b", help="target, of the same kind as A")
    p.add_argument("-o", "--output", metavar="CSV",
                   help="dumps: the CSV of all rows (default compare_result_<time>.csv)")
    p.add_argument("--xlsx", metavar="PATH", help="dumps: also write the rows as xlsx (needs openpyxl)")
    p.add_argument("--statistics-only", action="store_true", help="dumps: compare statistics, do not load tensors")
    p.add_argument("--threshold", action="append", type=_threshold, default=[], metavar="NAME=VALUE",
                   help="dumps: override a status threshold (cosine_error, cosine_warning, thousandth_warning, "
                        "stat_rel_error, stat_rel_warning); repeatable")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="dumps: progress line on stderr (default: only on a terminal)")
    p.add_argument("--rtol", type=float, default=RTOL, help=f"runs: relative tolerance (default {RTOL:g})")
    p.add_argument("--atol", type=float, default=ATOL, help=f"runs: absolute tolerance (default {ATOL:g})")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON ('-' for stdout)")


def _compare_dumps_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.compare import Thresholds, compare_dumps
    from msprobe_engine.analysis.report import RowWriter, format_comparison

    csv_path = args.output or f"compare_result_{time.strftime('%Y%m%d%H%M%S')}.csv"
    with RowWriter(csv_path, args.xlsx) as writer:
        comp = compare_dumps(args.a, args.b, Thresholds(**dict(args.threshold)),
                             statistics_only=args.statistics_only, on_row=writer.write, keep_rows=False,
                             progress=args.progress)
    if args.json != "-":
        print(format_comparison(comp))
        print(f"rows written to {csv_path}" + (f" and {args.xlsx}" if args.xlsx else ""))
    if args.json:
        _write_json(comp.summary(), args.json)
    return 0


def _compare_runs_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.report import format_runs
    from msprobe_engine.analysis.runs import compare_runs

    result = compare_runs(args.a, args.b, rtol=args.rtol, atol=args.atol)
    if args.json != "-":
        print(format_runs(result))
    if args.json:
        _write_json(result.as_dict(), args.json)
    return 0


def _compare_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.runs import is_run

    if is_run(args.a) and is_run(args.b):
        return _compare_runs_run(args)
    return _compare_dumps_run(args)


# ------------------------------------------------------------------ graph

def _graph_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("incident", nargs="?", help="an incident directory: the graph of its failing step, culprit marked")
    p.add_argument("-tp", "--target-path", help="the dump to show (rank dir or dump root with step*/rank*/)")
    p.add_argument("-gp", "--golden-path", help="a reference dump: compare the target with it node by node")
    p.add_argument("-o", "--output", help="output directory (needed with -tp; default <incident>/graph)")
    p.add_argument("--overflow-check", action="store_true", help="mark nodes with nan/inf (critical/high/medium)")


def _graph_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.graph import build_graphs, incident_graphs, is_incident, write_outputs
    from msprobe_engine.analysis.graph.report import format_graphs

    if args.incident and (args.target_path or args.golden_path):
        raise ValueError("give either an incident directory or -tp <dump> [-gp <reference>], not both")
    if args.incident:
        if not is_incident(args.incident):
            raise ValueError(f"{args.incident}: not an incident directory (no incident.json); for a dump use -tp")
        result = incident_graphs(args.incident)
        output = args.output or str(Path(args.incident) / "graph")
    elif args.target_path:
        if not args.output:
            raise ValueError("-o <output dir> is needed with -tp")
        result = build_graphs(args.target_path, args.golden_path, overflow_check=args.overflow_check)
        output = args.output
    else:
        raise ValueError("give an incident directory or -tp <dump> [-gp <reference dump>] -o <dir>")
    print(format_graphs(result, write_outputs(result, output)))
    return 0


# ------------------------------------------------------------------ check-config

def _unreachable(config: Any, spec: str) -> list[str]:
    """Warnings about rules that cannot fire on the model `module:factory` builds."""
    import importlib

    from msprobe_engine.config.reach import unreachable_rules

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model: expected MODULE:FACTORY, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec}: {type(exc).__name__}: {exc}") from None
    model = factory()
    return unreachable_rules(config, model[0] if isinstance(model, tuple) else model)


def _check_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a monitor config (.yaml, .yml or .json)")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="a function returning the model (or a tuple starting with it), called with no "
                        "arguments: warn about rules whose metrics match no tag of that model")


def _check_config_run(args: argparse.Namespace) -> int:
    """Every problem of the config on its own line (exit 1), or ok plus warnings (exit 0)."""
    from msprobe_engine.config import ConfigError, load_config
    from msprobe_engine.config.loader import problems

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        errors = problems(exc)
        for message in errors:
            print(f"error: {message}", file=sys.stderr)
        print(f"{args.config}: {len(errors)} error{'s' if len(errors) > 1 else ''}", file=sys.stderr)
        return 1
    warnings = _unreachable(config, args.model) if args.model else []
    for message in warnings:
        print(f"warning: {message}", file=sys.stderr)
    print(f"{args.config}: ok; output_dir={config.output_dir}, sinks={','.join(sink.name for sink in config.sinks)}, "
          f"alerts={','.join(r.rule for r in config.alerts)}" + (f"; {len(warnings)} warning(s)" if warnings else ""))
    return 0


VERBS: dict[str, Verb] = {
    "analyze": Verb("find where a dump first went bad (nan/inf scenes, ignore rules)",
                    _analyze_arguments, _analyze_run),
    "compare": Verb("compare two dumps (statistics or tensors) or two monitor runs",
                    _compare_arguments, _compare_run),
    "graph": Verb("model graph of a dump, node-by-node comparison of two dumps, or an incident's step "
                  "(TensorBoard tb-graph-ascend file and HTML report)", _graph_arguments, _graph_run),
    "check-config": Verb("validate a monitor config file before a run",
                         _check_config_arguments, _check_config_run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msprobe-engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, verb in VERBS.items():
        verb.add_arguments(sub.add_parser(name, help=verb.help, description=verb.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb; exit code 0 on success, 1 when an input cannot be used, 2 on bad arguments."""
    args = build_parser().parse_args(argv)
    try:
        return VERBS[args.verb].run(args)
    except (DumpError, OSError, ValueError, RuntimeError) as e:
        print(f"msprobe-engine {args.verb}: error: {e}", file=sys.stderr)
        return 1
