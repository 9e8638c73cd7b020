"""Offline pre-check (``run_ut``): every API call of a dump replayed and judged, one report per rank.

The replay itself is the framework's (``load_framework("torch").precheck()``); this module picks
the cases, skips what a resumed run already did, judges each output with `standards` and writes
the rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from msprobe_engine.analysis.precheck.cases import ApiCase, dump_cases
from msprobe_engine.analysis.precheck.report import ApiResult, PrecheckReport
from msprobe_engine.analysis.precheck.standards import check_output
from msprobe_engine.analysis.progress import Progress
from msprobe_engine.errors import ConfigError
from msprobe_engine.config.loader import read_file
from msprobe_engine.dump.reader import DumpError, RankDump, load_dump
from msprobe_engine.registry import framework_entry, framework_names, framework_where, load_framework

CONFIG_KEYS = ("white_list", "black_list", "error_data_path", "precision", "is_online", "nfs_path", "host", "port",
               "rank_list", "tls_path")


@dataclass(frozen=True)
class PrecheckConfig:
    """The predecessor's ``run_ut`` keys we use (``error_data_path``, ``rank_list``, ``is_online``
    are accepted and ignored; ``tls_path`` names a directory with server.crt/server.key,
    ``nfs_path`` a directory shared by the training and the online checker)."""
    white_list: tuple[str, ...] = ()
    black_list: tuple[str, ...] = ()
    precision: int = 14
    host: str = "127.0.0.1"
    port: int = 0
    tls_path: str | None = None
    nfs_path: str | None = None


def load_precheck_config(path: Path | str | None) -> PrecheckConfig:
    """The ``run_ut`` section of a config.json/.yaml (or its top level); a ConfigError names the key."""
    if path is None:
        return PrecheckConfig()
    data = read_file(Path(path))
    section = data.get("run_ut", data) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: run_ut: expected a mapping")
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key not in CONFIG_KEYS:
            if section is data and key in ("task", "dump_path", "rank", "step", "level", "framework"):
                continue
            raise ConfigError(f"{path}: run_ut.{key}: unknown key; known: {', '.join(CONFIG_KEYS)}")
        if key in ("white_list", "black_list"):
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ConfigError(f"{path}: run_ut.{key}: expected a list of API names, got {value!r}")
            values[key] = tuple(value)
        elif key in ("precision", "port"):
            lowest = -1 if key == "port" else 0  # the predecessor's "port": -1 means not set
            if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= 65535:
                raise ConfigError(f"{path}: run_ut.{key}: expected an integer from {lowest} to 65535, got {value!r}")
            values[key] = max(value, 0)
        elif key in ("host", "tls_path", "nfs_path") and value:
            values[key] = str(value)
    return PrecheckConfig(**values)


def precheck_of(dump: RankDump) -> Any:
    """The framework side that replays `dump` (a DumpError for a framework without one)."""
    name = framework_where(dump_format=dump.framework, precheck=True)
    if name is None:
        replays = [entry.dump_format for entry in map(framework_entry, framework_names()) if entry.precheck]
        raise DumpError(f"{dump.dump_json}: framework {dump.framework!r}: run_ut replays "
                        f"{', '.join(replays)} dumps")
    return load_framework(name).precheck()


def check_case(case: ApiCase, precheck: Any, device: str = "cpu", recorded_output: bool = False) -> ApiResult:
    """Replay one case (through the framework's `precheck`) and judge every output and gradient.
    A case that cannot be replayed is ``SKIP`` with the reason; a broken dump file raises."""
    result = ApiResult(case.name)
    result.forward_skip = case.skip_reason()
    if result.forward_skip:
        return result
    try:
        replayed = precheck.replay(case, device, recorded_output)
    except DumpError:
        raise
    except Exception as e:  # the API itself failed on these inputs: reported, the run goes on
        result.forward_skip = f"replay failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return result
    result.forward = [check_output(b, d, dtype) for b, d, dtype in replayed.forward]
    if not result.forward:
        result.forward_skip = "no tensor or number in the output to compare"
    result.backward = [check_output(b, d, dtype) for b, d, dtype in replayed.backward]
    result.backward_skip = replayed.backward_skip
    return result


def run_ut(dump_path: Path | str, out_dir: Path | str, *, device: str = "cpu", config: PrecheckConfig | None = None,
           resume: bool = False, progress: bool | None = None, xlsx: bool = False,
           workers: int = 1) -> list[PrecheckReport]:
    """Pre-check every API call of the dump at `dump_path` (a rank dir or a dump root); the
    reports land in `out_dir` (``step<S>/rank<R>/`` below it when the dump has several).
    `workers` > 1: the calls of each rank directory are replayed by that many processes
    (`precheck.workers`), the report the same row for row."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"run_ut: workers: expected a positive integer, got {workers!r}")
    config = config or PrecheckConfig()
    dumps = load_dump(dump_path)
    reports = []
    for (step, rank), dump in dumps.items():
        precheck = precheck_of(dump)
        target = Path(out_dir)
        if len(dumps) > 1:
            target = target / f"step{'' if step is None else step}" / f"rank{'' if rank is None else rank}"
        report = PrecheckReport(target, resume=resume, precision=config.precision)
        cases = [c for c in dump_cases(dump, config.white_list, config.black_list) if c.name not in report.done]
        bar = Progress(f"run_ut {dump.path}", progress)
        bar.start(len(cases))
        try:
            if workers > 1 and len(cases) > 1:
                from msprobe_engine.analysis.precheck.workers import check_in_workers

                results = check_in_workers(dump, framework_where(dump_format=dump.framework, precheck=True), cases, workers,
                                           device, check_case)
            else:
                results = (check_case(case, precheck, device) for case in cases)
            for done, result in enumerate(results, 1):
                report.add(result)
                bar.update(done)
        finally:
            bar.finish()
            report.close(target / report.result_path.with_suffix(".xlsx").name if xlsx else None)
        reports.append(report)
    return reports


def count_statuses(reports: Iterable[PrecheckReport]) -> dict[str, int]:
    """pass/warning/error/SKIP counts over the reports (forward and backward verdicts)."""
    total: dict[str, int] = {}
    for report in reports:
        for status, n in report.counts.items():
            total[status] = total.get(status, 0) + n
    return total
