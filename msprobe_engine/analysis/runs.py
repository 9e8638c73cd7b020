"""Compare two monitor runs (``<output_dir>/<run name>/rank<R>/metrics.jsonl``) and find where they diverge.

A run is given as its run directory (``<output_dir>/<run name>``), one rank directory or
one metrics.jsonl; an output_dir that holds a single run stands for that run. The
`Health/*` overview is left out: it repeats other tags, and `Health/monitor_ms` is a time.

Records align by rank, step and tag (the monitor's own cost, ``monitor/*``, is left out). Two values differ when their relative difference
|b - a| / max(|a|, |b|) exceeds ``rtol`` and |b - a| exceeds ``atol``, or when their nan/inf
classes differ (nan vs a number, +inf vs -inf; nan vs nan is equal). The first divergence
is the earliest step; within it, the first tag in the record's (execution) order; ties
between ranks go to the lower rank.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.metrics import same_nonfinite
from msprobe_engine.health import PREFIX as HEALTH

JSONL_NAME = "metrics.jsonl"
_RANK_RE = re.compile(r"^rank(\d+)$")
RTOL = 1e-3
ATOL = 0.0
#: tags of the monitor's own cost (`monitor/overhead_ms`, ...): they differ from run to run, not compared
SELF_METERING = "monitor/"

Records = dict[int, dict[str, float]]  # step -> {tag: value}, tags in record order


def is_run(path: Path | str) -> bool:
    """True for a metrics.jsonl file or a directory holding one (directly, in rank*/ or in
    <run>/rank*/)."""
    path = Path(path)
    return (path.is_file() and path.suffix == ".jsonl") or (path / JSONL_NAME).is_file() or \
        (path.is_dir() and any(path.glob(f"rank*/{JSONL_NAME}"))) or bool(_runs_in(path))


def _runs_in(path: Path) -> list[Path]:
    """The run directories (holding rank*/metrics.jsonl) directly under an output_dir."""
    if not path.is_dir():
        return []
    return sorted(d for d in path.iterdir() if d.is_dir() and any(d.glob(f"rank*/{JSONL_NAME}")))


def _run_files(path: Path) -> dict[int, Path]:
    if path.is_file():
        return {0: path}
    if (path / JSONL_NAME).is_file():
        match = _RANK_RE.match(path.name)
        return {int(match.group(1)) if match else 0: path / JSONL_NAME}
    files = {int(d.name[4:]): d / JSONL_NAME for d in path.iterdir()
             if _RANK_RE.match(d.name) and (d / JSONL_NAME).is_file()}
    runs = _runs_in(path) if not files else []
    if len(runs) == 1:
        return _run_files(runs[0])
    if runs:
        raise FileNotFoundError(f"{path} holds {len(runs)} runs ({', '.join(d.name for d in runs)}): "
                                "give one run directory")
    if not files:
        raise FileNotFoundError(f"{path}: no {JSONL_NAME} here nor in rank*/ directories")
    return dict(sorted(files.items()))


def read_records(file: Path, problems: list[str]) -> Records:
    """step -> metrics of one JSONL file; unreadable lines are skipped with a problem naming file:line.
    A step written twice keeps its last record."""
    records: Records = {}
    with open(file, "rb") as f:  # lines decoded one by one: a non-UTF-8 line is skipped, not fatal
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
                step, metrics = obj["step"], obj["metrics"]
                if not isinstance(step, int) or isinstance(step, bool) or not isinstance(metrics, dict) \
                        or abs(step) > 2 ** 53:
                    raise TypeError("'step' must be an integer and 'metrics' an object")
                records[step] = {k: float(v) for k, v in metrics.items()
                                 if isinstance(v, (int, float)) and not k.startswith((HEALTH, SELF_METERING))}
            except (ValueError, KeyError, TypeError, OverflowError) as e:
                problems.append(f"{file}:{lineno}: skipped: {type(e).__name__}: {str(e)[:200]}")
    return records


def load_run(path: Path | str, problems: list[str]) -> dict[int, Records]:
    """rank -> step -> metrics of a run directory, a rank directory or a metrics.jsonl file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return {rank: read_records(file, problems) for rank, file in _run_files(path).items()}


def relative_difference(a: float, b: float) -> float:
    """|b - a| / max(|a|, |b|): 0 for equal values (and equal nan/inf), inf for differing nan/inf."""
    if a == b or same_nonfinite(a, b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(b - a) / max(abs(a), abs(b))


@dataclass(frozen=True, slots=True)
class Divergence:
    """One tag whose values differ beyond the tolerance."""
    rank: int
    step: int
    tag: str
    a: float
    b: float
    rel_diff: float


@dataclass
class RunComparison:
    """Result of ``compare_runs``: the first divergence, the first per (rank, step), and gaps."""
    first: Divergence | None
    per_step: list[Divergence]
    steps_compared: int
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["first"] = asdict(self.first) if self.first else None
        return out


def _differs(a: float, b: float, rtol: float, atol: float) -> bool:
    rel = relative_difference(a, b)
    return rel > rtol and (math.isinf(rel) or abs(b - a) > atol)


def _note_missing(out: list[str], seen: set, rank: int, step: int, tags: list[str], side: str) -> None:
    """Record each tag missing from the other run once, with the first step it is seen at."""
    for tag in tags:
        if (rank, tag, side) not in seen:
            seen.add((rank, tag, side))
            out.append(f"rank {rank} tag {tag} (first at step {step})")


def compare_runs(a: Path | str, b: Path | str, rtol: float = RTOL, atol: float = ATOL) -> RunComparison:
    """Find the first step and tag where run ``b`` departs from run ``a``."""
    problems: list[str] = []
    run_a, run_b = load_run(a, problems), load_run(b, problems)
    only_a = [f"rank {r}" for r in run_a if r not in run_b]
    only_b = [f"rank {r}" for r in run_b if r not in run_a]
    per_step: list[Divergence] = []
    seen: set[tuple[int, str, str]] = set()
    compared = 0
    for rank in (r for r in run_a if r in run_b):
        steps_a, steps_b = run_a[rank], run_b[rank]
        only_a += [f"rank {rank} step {s}" for s in steps_a if s not in steps_b]
        only_b += [f"rank {rank} step {s}" for s in steps_b if s not in steps_a]
        for step in sorted(s for s in steps_a if s in steps_b):
            compared += 1
            ma, mb = steps_a[step], steps_b[step]
            _note_missing(only_a, seen, rank, step, [t for t in ma if t not in mb], "A")
            _note_missing(only_b, seen, rank, step, [t for t in mb if t not in ma], "B")
            hit = next((t for t in ma if t in mb and _differs(ma[t], mb[t], rtol, atol)), None)
            if hit is not None:
                per_step.append(Divergence(rank, step, hit, ma[hit], mb[hit], relative_difference(ma[hit], mb[hit])))
    per_step.sort(key=lambda d: (d.step, d.rank))
    return RunComparison(per_step[0] if per_step else None, per_step, compared, only_a, only_b, problems)
