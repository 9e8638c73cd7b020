"""`grad-probe`: gradient direction similarity between two grad_probe runs, or between steps of one.

The similarity of a parameter is the share of its elements whose direction (``grad > 0``, the
``step<N>/<param>.npy`` files of levels L1/L2) is the same in both; ``summary`` pools every
parameter. Two runs are compared step by step (steps present in both); one run is compared
with itself, each step against the one before. Written per rank, in the predecessor's layout::

    <output>/rank<R>/similarities.csv                    step, <steps...>; one row per parameter
    <output>/rank<R>/similarities_picture/<param>_similarities.png
    <output>/rank<R>/similarities.png                    every parameter over the steps, one figure

Rule of thumb (the predecessor's): between two runs, a similarity below 0.97 at the first
compared step, or a drop of more than 0.03 from one step to the next, marks a problem.
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from msprobe_engine.dump.grad_probe_files import SUMMARY_PREFIX
from msprobe_engine.errors import read_utf8

SUMMARY = "summary"
FIRST_STEP_MIN = 0.97
MAX_DROP = 0.03
_RANK_RE = re.compile(r"^rank(\d+)$")
_STEP_RE = re.compile(r"^step(\d+)$")


@dataclass
class Similarities:
    """One rank: the compared steps and, per parameter (and ``summary``), one similarity per step."""
    rank: int
    steps: list[int]
    by_param: dict[str, list[float]]
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "steps": self.steps, "similarities": self.by_param, "problems": self.problems}


def rank_dirs(root: Path | str) -> dict[int, Path]:
    """``rank<R>`` directories of a grad_probe dump_path (or the rank directory itself, as rank 0)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _RANK_RE.match(p.name))}
    if not found and any(root.glob(f"{SUMMARY_PREFIX}*.csv")):
        found = {0: root}
    if not found:
        raise ValueError(f"{root}: no rank<N> directories with {SUMMARY_PREFIX}<step>.csv (a grad_probe dump_path?)")
    return found


def _steps(rank_dir: Path) -> dict[int, Path]:
    return {int(m.group(1)): p for p in rank_dir.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))}


def _param_order(rank_dir: Path, step: int) -> list[str]:
    path = rank_dir / f"{SUMMARY_PREFIX}{step}.csv"
    if not path.is_file():
        raise ValueError(f"{path}: missing (direction files without their summary)")
    return [row[0] for row in list(csv.reader(io.StringIO(read_utf8(path), newline="")))[1:] if row]


def _direction(step_dir: Path, name: str) -> np.ndarray:
    path = step_dir / f"{name}.npy"
    if not path.is_file():
        raise ValueError(f"{path}: missing; level L0 writes no directions (use grad_level L1 or L2)")
    try:
        array = np.load(path)
    except (OSError, ValueError, EOFError) as exc:  # truncated, or not a .npy file
        raise ValueError(f"{path}: cannot load the direction of {name}: {type(exc).__name__}: {exc}") from None
    if array.dtype != bool:
        raise ValueError(f"{path}: expected a bool direction array, got {array.dtype}")
    return array


def _similar(pairs: list[tuple[Path, Path]], names: list[str], by_param: dict[str, list[float]]) -> None:
    """Append one step's similarities for every parameter and the pooled summary."""
    for dir_a, dir_b in pairs:
        same = total = 0
        for name in names:
            a, b = _direction(dir_a, name), _direction(dir_b, name)
            if a.shape != b.shape:
                raise ValueError(f"{name}: shape {list(a.shape)} in {dir_a} but {list(b.shape)} in {dir_b}")
            equal = int((a == b).sum())
            same, total = same + equal, total + a.size
            by_param.setdefault(name, []).append(equal / a.size if a.size else 0.0)
        by_param.setdefault(SUMMARY, []).append(same / total if total else 0.0)


def compare_runs(a: Path | str, b: Path | str) -> list[Similarities]:
    """Similarity per step between runs `a` and `b`, per rank present in both."""
    ranks_a, ranks_b = rank_dirs(a), rank_dirs(b)
    shared = sorted(set(ranks_a) & set(ranks_b))
    if not shared:
        raise ValueError(f"no rank in both {a} ({sorted(ranks_a)}) and {b} ({sorted(ranks_b)})")
    results = []
    for rank in shared:
        steps_a, steps_b = _steps(ranks_a[rank]), _steps(ranks_b[rank])
        steps = sorted(set(steps_a) & set(steps_b))
        if not steps:
            raise ValueError(f"rank {rank}: no step<N> directory in both runs")
        by_param: dict[str, list[float]] = {}
        _similar([(steps_a[s], steps_b[s]) for s in steps], _param_order(ranks_a[rank], steps[0]), by_param)
        result = Similarities(rank, steps, by_param)
        result.problems = rule_of_thumb(result, first_step=True)
        results.append(result)
    return results


def compare_steps(run: Path | str) -> list[Similarities]:
    """Similarity of each step with the step before it, within one run."""
    results = []
    for rank, rank_dir in sorted(rank_dirs(run).items()):
        steps = sorted(_steps(rank_dir))
        if len(steps) < 2:
            raise ValueError(f"{rank_dir}: {len(steps)} step directory; comparing steps needs two or more")
        dirs = _steps(rank_dir)
        by_param: dict[str, list[float]] = {}
        _similar([(dirs[p], dirs[s]) for p, s in zip(steps, steps[1:])], _param_order(rank_dir, steps[0]), by_param)
        result = Similarities(rank, steps[1:], by_param)
        result.problems = rule_of_thumb(result, first_step=False)
        results.append(result)
    return results


def rule_of_thumb(result: Similarities, first_step: bool) -> list[str]:
    """Problems by the rule of thumb: low similarity at the first step (two runs), drops between steps."""
    problems = []
    for name, values in result.by_param.items():
        if first_step and values and values[0] < FIRST_STEP_MIN:
            problems.append(f"rank {result.rank} {name}: similarity {values[0]:.4f} at step {result.steps[0]} "
                            f"is below {FIRST_STEP_MIN} (the runs differ from the start)")
        for i in range(1, len(values)):
            if values[i - 1] - values[i] > MAX_DROP:
                problems.append(f"rank {result.rank} {name}: similarity dropped {values[i - 1] - values[i]:.4f} "
                                f"from step {result.steps[i - 1]} to step {result.steps[i]} (more than {MAX_DROP})")
    return problems


def write_similarities(results: list[Similarities], output: Path | str) -> list[Path]:
    """similarities.csv and the PNG plots per rank; returns the CSV paths."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    for result in results:
        out = Path(output) / f"rank{result.rank}"
        pictures = out / "similarities_picture"
        pictures.mkdir(parents=True, exist_ok=True)
        with open(out / "similarities.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["step"] + [str(s) for s in result.steps])
            writer.writerows([name] + values for name, values in result.by_param.items())
        for name, values in result.by_param.items():
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(result.steps, values, marker="o")
            ax.set(xlabel="steps", ylabel="similarities", title=f"{name}_similarities")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            fig.savefig(pictures / f"{name}_similarities.png", dpi=80)
            plt.close(fig)
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, values in result.by_param.items():
            ax.plot(result.steps, values, marker=".", label=name, linewidth=2.5 if name == SUMMARY else 1)
        ax.axhline(FIRST_STEP_MIN, color="grey", linestyle="--", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="step", ylabel="direction similarity", title=f"rank {result.rank}: similarity per layer")
        ax.legend(fontsize="x-small", loc="lower left")
        fig.savefig(out / "similarities.png", dpi=90)
        plt.close(fig)
        written.append(out / "similarities.csv")
    return written
