"""free_benchmark's thresholds and result file (the predecessor's), framework-neutral.

The ratio of an output is the worst, over its elements where either value is above ``tol``,
of ``r`` and ``1 / r`` with ``r = (|original| + tol) / (|perturbed| + tol)`` (``tol`` = the
square root of the dtype's noise value forward, 1e-3 backward; a nan/inf ratio counts as 1).
An output passes when ``ratio <= threshold``; ``no_change`` needs exactly 1. (The predecessor
divides by ``|x| + tol`` on one side only, so equal small values read below 1 and could fail;
here equal outputs give exactly 1.)

Check mode writes the outputs that fail, one row each, to ``step<N>/<rank dir>/free_benchmark.csv``:
``rank, pert_mode, stage, step, api_name, max_rel, dtype, shape, output_index`` (max_rel =
ratio - 1; output_index empty for a single output; MindSpore's file names the second column
``pert_type``, as the predecessor's MindSpore side does). `Judge` turns a step's ratios into
those rows (thresholds, preheat), the same for every framework.
"""
from __future__ import annotations

import csv
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

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
    rank: int | None
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


@dataclass(frozen=True)
class Compared:
    """One output compared in a step, waiting for its ratio: `dtype` is the framework-neutral
    name (``float32``) that picks the threshold, `dtype_label` and `shape` what the CSV shows."""
    name: str
    stage: str
    dtype: str
    dtype_label: str
    shape: str
    index: int | None


@dataclass
class Judge:
    """A free_benchmark run's verdicts: per step, the ratios of its compared outputs -> the failing rows.

    With ``if_preheat`` the first ``preheat_step`` steps only sample (at most ``max_sample``
    outputs per API) and each API's threshold becomes the largest of its dtype threshold and
    the ratios sampled."""
    options: Any                      # the free_benchmark task's Config (`dump.tasks.FreeBenchmark.Config`)
    rank: int | None                  # what the rank column shows
    failed: list[ResultRow] = field(default_factory=list)   # every failing output so far
    compared: int = 0                 # outputs judged so far (not counting preheat samples)
    _limits: dict[str, float] = field(default_factory=dict)
    _samples: dict[str, int] = field(default_factory=dict)

    def rows(self, step: int, compared: Sequence[Compared], ratios: Sequence[float]) -> list[ResultRow]:
        """The failing outputs of `step` (also appended to `failed`)."""
        rows = []
        for item, value in zip(compared, ratios):
            key = item.name.rsplit(".", 2)[0]
            limit = max(threshold(item.dtype, self.options.pert_mode), self._limits.get(key, 0.0))
            if self.options.if_preheat and step < self.options.preheat_step:
                if self._samples.get(key, 0) < self.options.max_sample:
                    self._samples[key] = self._samples.get(key, 0) + 1
                    self._limits[key] = max(self._limits.get(key, 0.0), value)
                continue
            self.compared += 1
            if not passes(value, limit):
                rows.append(ResultRow(self.rank, self.options.pert_mode, item.stage, step, item.name, value - 1,
                                      item.dtype_label, item.shape, item.index))
        self.failed.extend(rows)
        return rows


def write_results(dump_path: Path, step: int, rank: int | None, rows: Sequence[ResultRow],
                  header: Sequence[str] | None = None) -> Path:
    """Append `rows` to the step's result file (created with its header: `header`, default
    `ResultRow`'s field names)."""
    out = Path(dump_path) / f"step{step}" / rank_dir_name(rank)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULT_CSV
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(list(header) if header else [f.name for f in fields(ResultRow)])
        writer.writerows(astuple(row) for row in rows)
    return path
