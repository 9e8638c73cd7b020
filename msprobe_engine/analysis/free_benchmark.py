"""`free-benchmark`: the failing outputs of a free_benchmark run, grouped by API.

Reads every ``step<N>/<rank dir>/free_benchmark.csv`` below a dump_path and reports, per API
(``Torch.var``: the call name without counter and stage), how many outputs failed, in which
steps and ranks, and the worst ``max_rel`` with the call it came from.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

from msprobe_engine.dump.free_benchmark_files import RESULT_CSV
from msprobe_engine.errors import read_utf8


@dataclass
class ApiFailures:
    """The failures of one API."""
    api: str
    count: int = 0
    steps: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    worst: float = 0.0
    worst_call: str = ""

    def as_dict(self) -> dict:
        return {"api": self.api, "count": self.count, "steps": sorted(self.steps), "ranks": sorted(self.ranks),
                "worst_max_rel": self.worst, "worst_call": self.worst_call}


def result_files(root: Path | str) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    return sorted(root.glob(f"step*/*/{RESULT_CSV}")) or sorted(root.glob(RESULT_CSV))


def summarize(root: Path | str) -> list[ApiFailures]:
    """Failures per API, the worst first; [] when every compared output passed."""
    by_api: dict[str, ApiFailures] = {}
    for path in result_files(root):
        rows = csv.DictReader(io.StringIO(read_utf8(path), newline=""))
        for row in rows:
            try:
                name, rel = row["api_name"], abs(float(row["max_rel"]))
                step, rank = int(row["step"]), int(row["rank"] or 0)  # MindSpore's: empty outside distributed runs
            except (KeyError, ValueError, TypeError) as exc:  # TypeError: a short (truncated) row
                raise ValueError(f"{path}: line {rows.line_num}: not a free_benchmark result row "
                                 f"({type(exc).__name__}: {exc})") from None
            api = name.rsplit(".", 2)[0]
            item = by_api.setdefault(api, ApiFailures(api))
            item.count += 1
            item.steps.add(step)
            item.ranks.add(rank)
            if rel >= item.worst:
                item.worst, item.worst_call = rel, name
    return sorted(by_api.values(), key=lambda a: -a.worst)


def format_failures(failures: list[ApiFailures]) -> str:
    if not failures:
        return "free_benchmark: no failing output (every compared API passed)"
    lines = [f"{'api':32} {'failed':>6} {'worst max_rel':>14}  worst call / steps"]
    for a in failures:
        lines.append(f"{a.api:32} {a.count:>6} {a.worst:>14.6g}  {a.worst_call} / steps {sorted(a.steps)}")
    return "\n".join(lines)
