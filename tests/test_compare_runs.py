"""`compare` of two monitor runs (metrics.jsonl): first diverging step and tag."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from msprobe_engine.analysis import compare_runs
from msprobe_engine.analysis.runs import relative_difference
from msprobe_engine.cli import main

TAGS = ["actv/layers.0.mlp/output/norm", "actv/layers.1.mlp/output/norm", "grad/layers.1.mlp.fc1.weight/norm",
        "train/loss"]


def _write_run(out_dir: Path, values: dict[int, dict[str, float]], rank: int = 0) -> Path:
    rank_dir = out_dir / f"rank{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    with open(rank_dir / "metrics.jsonl", "w") as f:
        for step, metrics in values.items():
            f.write(json.dumps({"step": step, "rank": rank, "micro_steps": 1, "metrics": metrics, "alerts": []}) + "\n")
    return out_dir


def _steps(n: int) -> dict[int, dict[str, float]]:
    return {s: {t: 1.0 + 0.1 * s + i for i, t in enumerate(TAGS)} for s in range(n)}


def test_first_divergence_is_earliest_step_then_first_tag_in_record_order(tmp_path):
    a = _steps(6)
    b = _steps(6)
    b[3]["grad/layers.1.mlp.fc1.weight/norm"] *= 1.5       # later in the record
    b[3]["actv/layers.1.mlp/output/norm"] *= 1.01          # earlier: this is the first
    b[3]["actv/layers.0.mlp/output/norm"] *= 1.0000001     # within tolerance
    b[5]["train/loss"] = float("nan")
    result = compare_runs(_write_run(tmp_path / "a", a), _write_run(tmp_path / "b", b))
    first = result.first
    assert (first.step, first.rank, first.tag) == (3, 0, "actv/layers.1.mlp/output/norm")
    assert first.rel_diff == pytest.approx(0.01 / 1.01)
    assert [(d.step, d.tag) for d in result.per_step] == [(3, "actv/layers.1.mlp/output/norm"), (5, "train/loss")]
    assert result.per_step[1].rel_diff == math.inf and result.steps_compared == 6
    assert compare_runs(tmp_path / "a", tmp_path / "b", rtol=0.05).first.tag == "grad/layers.1.mlp.fc1.weight/norm"


def test_identical_runs_and_equal_nonfinite(tmp_path):
    a = _steps(3)
    a[2]["train/loss"] = float("nan")
    a[1]["train/loss"] = float("inf")
    result = compare_runs(_write_run(tmp_path / "a", a), _write_run(tmp_path / "b", a))
    assert result.first is None and result.per_step == [] and result.only_a == []


@pytest.mark.parametrize("a,b,expected", [
    (1.0, 1.0, 0.0), (0.0, 0.0, 0.0), (2.0, 1.0, 0.5), (-1.0, 1.0, 2.0), (0.0, 1e-9, 1.0),
    (float("nan"), float("nan"), 0.0), (float("inf"), float("inf"), 0.0),
    (float("inf"), float("-inf"), math.inf), (1.0, float("nan"), math.inf),
])
def test_relative_difference(a, b, expected):
    assert relative_difference(a, b) == expected


def test_atol_ignores_tiny_absolute_changes(tmp_path):
    a = {0: {"grad/x/norm": 1e-12}}
    b = {0: {"grad/x/norm": 3e-12}}
    _write_run(tmp_path / "a", a), _write_run(tmp_path / "b", b)
    assert compare_runs(tmp_path / "a", tmp_path / "b").first.tag == "grad/x/norm"
    assert compare_runs(tmp_path / "a", tmp_path / "b", atol=1e-9).first is None


def test_ranks_steps_tags_missing_and_bad_lines(tmp_path):
    a, b = _steps(4), _steps(3)
    del b[1]["train/loss"]
    _write_run(tmp_path / "a", a)
    _write_run(tmp_path / "a", _steps(2), rank=1)
    _write_run(tmp_path / "b", b)
    _write_run(tmp_path / "b", {0: {"train/loss": 4.0}, 1: {"train/loss": 9.0}}, rank=1)
    with open(tmp_path / "b" / "rank0" / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "metrics": \n{"step": "x", "metrics": {}}\n')
    result = compare_runs(tmp_path / "a", tmp_path / "b")
    assert (result.first.step, result.first.rank, result.first.tag) == (1, 1, "train/loss")
    assert result.only_a == ["rank 0 step 3", "rank 0 tag train/loss (first at step 1)",
                             "rank 1 tag actv/layers.0.mlp/output/norm (first at step 0)",
                             "rank 1 tag actv/layers.1.mlp/output/norm (first at step 0)",
                             "rank 1 tag grad/layers.1.mlp.fc1.weight/norm (first at step 0)"]
    file = tmp_path / "b" / "rank0" / "metrics.jsonl"
    assert [p.split(": skipped")[0] for p in result.problems] == [f"{file}:4", f"{file}:5"]


def test_cli_detects_runs(tmp_path, capsys):
    b = _steps(3)
    b[2]["train/loss"] = 100.0
    _write_run(tmp_path / "a", _steps(3)), _write_run(tmp_path / "b", b)
    assert main(["compare", str(tmp_path / "a" / "rank0"), str(tmp_path / "b" / "rank0" / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "first divergence: step 2 rank 0 tag train/loss" in out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["first"]["step"] == 2
