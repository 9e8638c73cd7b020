"""``run_ut --workers N``: the cases of one rank directory replayed by N worker processes.

Each worker (spawned: safe with CUDA and with any threads the parent runs) loads the rank
directory and the framework's replay once; the parent hands it case names and gets the
results back in case order, so the report is the one a single process writes, row for row.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path
from typing import Any, Callable, Iterator

from msprobe_engine.analysis.precheck.cases import ApiCase, dump_cases
from msprobe_engine.analysis.precheck.report import ApiResult
from msprobe_engine.dump.reader import RankDump, load_rank_dir
from msprobe_engine.registry import load_framework

_worker: dict[str, Any] = {}


def _start(rank_dir: str, framework: str, check: Callable[..., ApiResult]) -> None:
    dump = load_rank_dir(Path(rank_dir))
    _worker["check"] = check
    _worker["cases"] = {case.name: case for case in dump_cases(dump, (), ())}
    _worker["precheck"] = load_framework(framework).precheck()


def _check(name: str, device: str) -> ApiResult:
    return _worker["check"](_worker["cases"][name], _worker["precheck"], device)


def check_in_workers(dump: RankDump, framework: str, cases: list[ApiCase], workers: int, device: str,
                     check: Callable[..., ApiResult]) -> Iterator[ApiResult]:
    """The results of `check(case, precheck, device)` for `cases` (of `dump`), in their order, from
    `workers` processes (`check` is pickled by name: a module-level function)."""
    context = multiprocessing.get_context("spawn")
    chunk = max(1, len(cases) // (workers * 4))
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                             initargs=(str(dump.path), framework, check)) as pool:
        yield from pool.map(_check, [case.name for case in cases], repeat(device), chunksize=chunk)
