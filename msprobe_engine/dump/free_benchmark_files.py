"""free_benchmark's thresholds and result file (the predecessor's), framework-neutral.

The ratio of an output is the worst, over its elements where either value is above ``tol``,
of ``r`` and ``1 / r`` with ``r = (|original| + tol) / (|perturbed| + tol)`` (``tol`` = the
square root of the dtype's noise value forward, 1e-3 backward; a nan/inf ratio counts as 1).
An output passes when ``ratio <= threshold``; ``no_change`` needs exactly 1. (The predecessor
divides by ``|x| + tol`` on one side only, so equal small values read below 1 and could fail;
here equal outputs give exactly 1.)

Check mode writes the outputs that fail, one row each, to ``step<N>/<rank dir>/free_benchmark.csv``:
``rank, pert_mode, stage, step, api_name, max_rel, dtype, shape, output_index`` (max_rel =
ratio - 1; output_index empty for a single output).
"""
from __future__ import annotations

import csv
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Sequence

from msprobe_engine.dump.writer import rank_dir_name

RESULT_CSV = "free_benchmark.csv"
#: the perturbation added by add_noise, by dtype name; its square root is the forward tolerance
NOISE = {"bfloat16": 1e-4, "float16": 1e-6, "float32": 1e-8, "float64": 1e-16}
#: the ratio an output may reach, by dtype name (others: float32's)
THRESHOLDS = {"float16": 1.002, "bfloat16": 1.004, "float32": 1.0002}
BACKWARD_TOL = 1e-3


@dataclass
class ResultRow:
    """One output that failed the comparison (the predecessor's columns, in its order)."""
    rank: int
    pert_mode: str
    stage: str
    step: int
    api_name: str
    max_rel: float
    dtype: str
    shape: str
    output_index: int | None


def tolerance(dtype: str, stage: str) -> float:
    """The |value| below which elements are not compared."""
    return BACKWARD_TOL if stage == "backward" else NOISE.get(dtype, NOISE["float32"]) ** 0.5


def threshold(dtype: str, pert_mode: str) -> float:
    return 1.0 if pert_mode == "no_change" else THRESHOLDS.get(dtype, THRESHOLDS["float32"])


def passes(ratio: float, limit: float) -> bool:
    """Within the threshold (a nan ratio, from an overflow, passes, as in the predecessor)."""
    return ratio != ratio or 1 / limit <= ratio <= limit


def write_results(dump_path: Path, step: int, rank: int | None, rows: Sequence[ResultRow]) -> Path:
    """Append `rows` to the step's result file (created with its header)."""
    out = Path(dump_path) / f"step{step}" / rank_dir_name(rank)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULT_CSV
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow([field.name for field in fields(ResultRow)])
        writer.writerows(astuple(row) for row in rows)
    return path
