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

from msprobe_engine.analysis import config_check
from msprobe_engine.analysis.precheck import precision_compare
from msprobe_engine.cli_input import NothingToCheck, bounded_int, finite_float, run_verb, safe_streams


class Verb(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    #: other names of the verb (the predecessor's spelling)
    aliases: tuple[str, ...] = ()


def _write_json(obj: Any, target: str) -> None:
    text = json.dumps(obj, indent=1, default=str)
    if target == "-":
        print(text)
    else:
        Path(target).write_text(text + "\n", encoding="utf-8")


# ------------------------------------------------------------------ analyze

def _analyze_arguments(p: argparse.ArgumentParser) -> None:
    from msprobe_engine.analysis.overflow import MUTATION_RATIO

    p.add_argument("dump", help="a rank directory (with dump.json; rank<N>, proc<pid> or rank) or a dump root with step*/ below")
    p.add_argument("--rules", action="append", default=[], metavar="YAML",
                   help="extra ignore rules (same layout as the packaged ignore_rules.yaml); repeatable")
    p.add_argument("--mutation-ratio", type=finite_float(0.0, above=True), default=MUTATION_RATIO,
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


# ------------------------------------------------------------------ tensorboard

def _tensorboard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logdir", required=True, help="an output_dir (every run in it) or one run directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=bounded_int(0, 65535), default=6006)


def _tensorboard_run(args: argparse.Namespace) -> int:
    from msprobe_engine.sinks.tb_server import serve

    return serve(args.logdir, args.host, args.port)


# ------------------------------------------------------------------ compare

def _threshold(text: str) -> tuple[str, float]:
    from msprobe_engine.analysis.compare import Thresholds

    name, _, value = text.partition("=")
    names = [f.name for f in dataclasses.fields(Thresholds)]
    if name not in names:
        raise argparse.ArgumentTypeError(f"unknown threshold {name!r}; one of {', '.join(names)}")
    try:
        return name, finite_float(0.0)(value)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"threshold {name}: {exc}") from None


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
    p.add_argument("--rtol", type=finite_float(0.0), default=RTOL, help=f"runs: relative tolerance (default {RTOL:g})")
    p.add_argument("--atol", type=finite_float(0.0), default=ATOL, help=f"runs: absolute tolerance (default {ATOL:g})")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON ('-' for stdout)")
    p.add_argument("--find-divergence", action="store_true",
                   help="print only where B first departs from A (first call of two dumps, in execution order, "
                        "or first step and tag of two runs), with --rtol/--atol")


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
    if not result.steps_compared:
        raise NothingToCheck(f"{args.a} and {args.b}: no step recorded in both runs, nothing compared"
                             + "".join(f"; {p}" for p in result.problems[:3]))
    if args.json != "-":
        print(format_runs(result))
    if args.json:
        _write_json(result.as_dict(), args.json)
    return 0


def _compare_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis import divergence
    from msprobe_engine.analysis.runs import is_run

    if args.find_divergence:
        return divergence.run(args)
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

    from msprobe_engine.collect.reach import unreachable_rules

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
    p.add_argument("config", help="a monitor config (.yaml, .yml or .json), or a dump config (one with a "
                                  "'task' or 'dump_path' key: the predecessor's config.json)")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="a function returning the model (or a tuple starting with it), called with no "
                        "arguments: warn about rules whose metrics match no tag of that model")


def _check_config_run(args: argparse.Namespace) -> int:
    """Every problem of the config on its own line (exit 1), or ok plus warnings (exit 0)."""
    from msprobe_engine.config import ConfigError, load_config
    from msprobe_engine.config.loader import problems, read_file
    from msprobe_engine.dump.config import is_dump_config, load_dump_config

    try:
        if is_dump_config(read_file(Path(args.config))):
            dump = load_dump_config(args.config)
            print(f"{args.config}: ok; dump task={dump.task}, level={dump.level}, dump_path={dump.dump_path}")
            return 0
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


# ------------------------------------------------------------------ grad-probe

def _grad_probe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="a grad_probe dump_path (rank<N>/ with grad_summary_<step>.csv and step<N>/)")
    p.add_argument("b", nargs="?", help="a second run to compare with; without it, each step of A is "
                                        "compared with the step before")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="where rank<N>/similarities.csv and the PNG plots go")
    p.add_argument("--json", metavar="PATH", help="also write the similarities as JSON ('-' for stdout)")


def _grad_probe_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.grad_probe import compare_runs, compare_steps, write_similarities

    results = compare_runs(args.a, args.b) if args.b else compare_steps(args.a)
    written = write_similarities(results, args.output)
    if args.json != "-":
        for result in results:
            print(f"rank {result.rank}: steps {result.steps}: summary similarity "
                  + ", ".join(f"{v:.4f}" for v in result.by_param["summary"]))
            for problem in result.problems:
                print(f"  problem: {problem}")
        print("written: " + ", ".join(str(p) for p in written))
    if args.json:
        _write_json([r.as_dict() for r in results], args.json)
    return 0


# ------------------------------------------------------------------ free-benchmark

def _free_benchmark_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", help="the dump_path of a free_benchmark run (step<N>/<rank>/free_benchmark.csv)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON ('-' for stdout)")


def _free_benchmark_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.free_benchmark import RESULT_CSV, format_failures, result_files, summarize

    if not result_files(args.dump):
        raise NothingToCheck(f"{args.dump}: no {RESULT_CSV} here nor in step*/*/ (not a free_benchmark dump_path): "
                             "nothing checked")
    failures = summarize(args.dump)
    if args.json != "-":
        print(format_failures(failures))
    if args.json:
        _write_json([f.as_dict() for f in failures], args.json)
    return 0
# ------------------------------------------------------------------ run_ut / generate_operator (API pre-check)

def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _run_ut_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", metavar="DUMP",
                   help="offline: a tensor or statistics dump (rank dir or dump root with step*/rank*/)")
    p.add_argument("-o", "--output", metavar="DIR", default=".",
                   help="directory of accuracy_checking_result_<time>.csv and _details_ (default: .)")
    p.add_argument("--config", metavar="FILE", help="config.json/.yaml with the predecessor's run_ut section")
    p.add_argument("--white-list", type=_names, metavar="APIS", help="only these APIs (comma-separated: gelu,linear)")
    p.add_argument("--black-list", type=_names, metavar="APIS", help="not these APIs (comma-separated)")
    p.add_argument("--device", default="cpu", help="device of the original-dtype run (default cpu; e.g. cuda)")
    p.add_argument("--resume", action="store_true",
                   help="continue the newest result CSV in -o: APIs already there are skipped")
    p.add_argument("--xlsx", action="store_true", help="also write both tables as one .xlsx next to the CSVs")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: only on a terminal)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="offline: replay the calls in N processes (the predecessor's multi_run_ut; default 1)")
    p.add_argument("--online", action="store_true",
                   help="online: run the checker server; training processes send their API calls to it")
    p.add_argument("--host", help="online: address to listen on (default 127.0.0.1, or run_ut.host)")
    p.add_argument("--port", type=bounded_int(0, 65535), help="online: TCP port (default run_ut.port; 0 picks a free one)")
    p.add_argument("--queue-size", type=bounded_int(1, 1 << 20), default=256, help="online: calls held waiting for the benchmark")
    p.add_argument("--tls-path", metavar="DIR", help="online: serve TLS with DIR/server.crt and DIR/server.key")
    p.add_argument("--nfs-path", metavar="DIR", help="online: watch this shared directory instead of a TCP port")


def _run_ut_config(args: argparse.Namespace) -> Any:
    from msprobe_engine.analysis.precheck.runner import load_precheck_config

    config = load_precheck_config(args.config)
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in
               {"white_list": args.white_list, "black_list": args.black_list, "host": args.host,
                "port": args.port, "tls_path": args.tls_path, "nfs_path": args.nfs_path}.items() if v is not None}
    return dataclasses.replace(config, **changes)


def _run_ut_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.precheck.runner import count_statuses, run_ut

    config = _run_ut_config(args)
    if args.online:
        from msprobe_engine.analysis.precheck.server import serve

        return serve(args.output, config, queue_size=args.queue_size, device=args.device, resume=args.resume)
    if not args.input:
        raise ValueError("run_ut: give a dump with -i (or --online to run the checker server)")
    reports = run_ut(args.input, args.output, device=args.device, config=config, resume=args.resume,
                     progress=args.progress, xlsx=args.xlsx, workers=args.workers)
    counts = count_statuses(reports)
    if not counts and not args.resume:
        print("run_ut: no API calls in this dump (an L0 dump has module entries only: dump at level L1 or mix)")
    else:
        print("run_ut: " + (", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "nothing new"))
    for report in reports:
        print(f"results: {report.result_path}\ndetails: {report.details_path}")
    return 0


def _generate_operator_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", metavar="DUMP", required=True, help="the dump (rank dir or dump root)")
    p.add_argument("--api", required=True, help="the call: Functional.gelu.0.forward (or Functional.gelu.0)")
    p.add_argument("-o", "--output", metavar="PY", default="repro.py", help="the script to write (default repro.py)")
    p.add_argument("--device", default="cpu", help="the script's default device (it takes one as argument too)")


def _generate_operator_run(args: argparse.Namespace) -> int:
    from msprobe_engine.analysis.precheck.cases import find_case
    from msprobe_engine.analysis.precheck.runner import precheck_of
    from msprobe_engine.dump.reader import load_dump

    for dump in load_dump(args.input).values():
        case = find_case(dump, args.api)
        if case is None:
            continue
        precheck = precheck_of(dump)
        script = Path(args.output)
        script.write_text(precheck.repro_script(case, dump.path, script, args.device), encoding="utf-8")
        print(f"{case.name} of {dump.path}: written to {script}; run: python {script} [device]")
        return 0
    raise ValueError(f"{args.input}: no API call {args.api!r} in this dump")


VERBS: dict[str, Verb] = {
    "analyze": Verb("find where a dump first went bad (nan/inf scenes, ignore rules)",
                    _analyze_arguments, _analyze_run),
    "tensorboard": Verb("serve runs with TensorBoard (works when two packages bring the same plugin)",
                        _tensorboard_arguments, _tensorboard_run),
    "compare": Verb("compare two dumps (statistics or tensors) or two monitor runs",
                    _compare_arguments, _compare_run),
    "graph": Verb("model graph of a dump, node-by-node comparison of two dumps, or an incident's step "
                  "(TensorBoard tb-graph-ascend file and HTML report)", _graph_arguments, _graph_run),
    "check-config": Verb("validate a monitor config file before a run",
                         _check_config_arguments, _check_config_run),
    "grad-probe": Verb("gradient direction similarity of grad_probe dumps (two runs, or steps of one)",
                       _grad_probe_arguments, _grad_probe_run),
    "free-benchmark": Verb("the APIs a free_benchmark run found unstable, worst first",
                           _free_benchmark_arguments, _free_benchmark_run),
    "run_ut": Verb("API accuracy pre-check: replay every API call of a dump (or, --online, of a running "
                   "training) against a CPU float64 benchmark", _run_ut_arguments, _run_ut_run),
    "generate_operator": Verb("write a script that reproduces one API call of a dump",
                              _generate_operator_arguments, _generate_operator_run),
    "config-check": Verb("what differs between two runs: Python, packages, numerics env vars, config, "
                         "data-order and weight fingerprints (first difference first)",
                         config_check.arguments, config_check.run),
    "api-precision-compare": Verb("two devices' run_ut details compared (the predecessor's -npu/-gpu tool, "
                                  "also named api_precision_compare): which APIs are worse on the device than "
                                  "on the reference", precision_compare.arguments, precision_compare.run,
                                  aliases=("api_precision_compare",)),
}


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error instead of one line")
    parser = argparse.ArgumentParser(prog="msprobe-engine", description=__doc__.splitlines()[0], parents=[debug])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, verb in VERBS.items():
        verb_parser = sub.add_parser(name, aliases=list(verb.aliases), help=verb.help, description=verb.help,
                                     parents=[debug])
        verb.add_arguments(verb_parser)
        verb_parser.set_defaults(verb=name)  # called by an alias: still this verb
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb; exit code 0 on success, 1 when an input cannot be used or holds nothing
    to check, 2 on bad arguments (argparse exits with it). One line on stderr, no traceback
    unless ``--debug``."""
    safe_streams()
    args = build_parser().parse_args(argv)
    return run_verb(args.verb, VERBS[args.verb].run, args, debug=getattr(args, "debug", False))
