"""``run_ut --workers N``: the same report, row for row, as one process (the lossy GELU still flagged)."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

import precheck_helpers as helpers
from msprobe_engine.analysis.precheck.runner import run_ut
from msprobe_engine.cli import main


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


@pytest.mark.slow
def test_workers_write_the_single_process_report(tmp_path, monkeypatch):
    rank_dir = helpers.train_step_dump(tmp_path / "dump", "tensor")
    # the workers are spawned: they install the lossy GELU through sitecustomize, as the parent does here
    site = helpers.sitecustomize_dir(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    helpers.install()
    try:
        single = run_ut(rank_dir, tmp_path / "one")[0]
        assert main(["run_ut", "-i", str(rank_dir), "-o", str(tmp_path / "two"), "--workers", "2"]) == 0
    finally:
        helpers.uninstall()
    parallel = next((tmp_path / "two").glob("accuracy_checking_result_*.csv"))
    assert _rows(parallel) == _rows(single.result_path)
    assert dict((r[0], r[1]) for r in _rows(parallel)[1:])["Functional.gelu.0"] == "error"
    details = next((tmp_path / "two").glob("accuracy_checking_details_*.csv"))
    assert _rows(details) == _rows(single.result_path.with_name(single.result_path.name.replace("result", "details")))


def test_workers_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="workers: expected a positive integer, got 0"):
        run_ut(tmp_path, tmp_path / "out", workers=0)
