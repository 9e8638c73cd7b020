"""`compare` of two dumps: metrics against numpy references, matching, statuses, bad input, CLI."""
from __future__ import annotations

import csv
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from dumpgen import build_dump, stat_record, write_dump_json
from msprobe_engine.analysis import Thresholds, compare_dumps, tensor_metrics
from msprobe_engine.analysis.match import match_entries
from msprobe_engine.cli import main


def _reference(a: np.ndarray, b: np.ndarray) -> dict:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    diff = np.abs(b - a)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(a))
    return {"cosine": float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), "max_abs_err": float(diff.max()),
            "max_rel_err": float(rel.max()), "one_thousandth_ratio": float(np.mean(rel <= 0.001)),
            "five_thousandth_ratio": float(np.mean(rel <= 0.005)),
            "euclidean_distance": float(np.linalg.norm(b - a))}


@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_metrics_match_numpy_reference(chunk):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 40)).astype(np.float32)
    b = a * (1 + rng.uniform(-0.004, 0.004, a.shape)).astype(np.float32) + 1e-3 * (rng.random(a.shape) < 0.1)
    m = tensor_metrics(a, b, chunk=chunk)
    for key, value in _reference(a, b).items():
        assert getattr(m, key) == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert 0 < m.one_thousandth_ratio < m.five_thousandth_ratio < 1
    assert m.nonfinite_mismatch == 0 and m.numel == 2000


def test_metrics_zero_tensors_and_empty():
    z = np.zeros((3, 3), np.float32)
    assert tensor_metrics(z, z).as_dict() == {"cosine": 1.0, "max_abs_err": 0.0, "max_rel_err": 0.0,
                                              "one_thousandth_ratio": 1.0, "five_thousandth_ratio": 1.0,
                                              "euclidean_distance": 0.0, "nonfinite_mismatch": 0, "numel": 9}
    m = tensor_metrics(z, np.full((3, 3), 2.0))
    assert (m.cosine, m.max_abs_err, m.max_rel_err, m.one_thousandth_ratio, m.euclidean_distance) == \
        (0.0, 2.0, math.inf, 0.0, 6.0)
    assert tensor_metrics(np.zeros(0), np.zeros(0)).cosine == 1.0


def test_metrics_nan_inf_compared_by_class():
    a = np.array([1.0, np.nan, np.inf, -np.inf, 2.0, 3.0])
    b = np.array([1.0, np.nan, np.inf, np.inf, np.nan, 3.3])
    m = tensor_metrics(a, b, chunk=4)
    assert m.nonfinite_mismatch == 2                       # -inf vs inf, 2.0 vs nan
    assert m.one_thousandth_ratio == pytest.approx(3 / 6)  # 1.0, nan/nan, inf/inf within; 3.0/3.3 not
    finite = _reference(np.array([1.0, 3.0]), np.array([1.0, 3.3]))
    assert m.cosine == pytest.approx(finite["cosine"]) and m.max_rel_err == pytest.approx(0.1)
    assert m.euclidean_distance == pytest.approx(0.3)


def test_metrics_bool_and_int():
    a = np.array([True, False, True, True])
    b = np.array([True, True, True, False])
    m = tensor_metrics(a, b)
    ref = _reference(a, b)
    assert (m.cosine, m.max_abs_err, m.euclidean_distance) == pytest.approx(
        (ref["cosine"], 1.0, math.sqrt(2)))
    assert m.max_rel_err == math.inf and m.one_thousandth_ratio == 0.5
    ai, bi = np.arange(-5, 5, dtype=np.int64), np.arange(-5, 5, dtype=np.int32)[::-1].copy()
    for key, value in _reference(ai, bi).items():
        assert getattr(tensor_metrics(ai, bi), key) == pytest.approx(value), key


@pytest.mark.parametrize("task,mode", [("tensor", "tensor"), ("statistics", "statistics")])
def test_clean_vs_injected_names_the_layer(tmp_path, task, mode):
    clean = build_dump(tmp_path / "clean", task=task)
    bad = build_dump(tmp_path / "bad", inject_nan_into="layers.2", task=task)
    comp = compare_dumps(clean.parent.parent, bad.parent.parent)
    (rank,) = comp.ranks
    assert rank.mode == mode and not rank.order_fallback
    first = comp.first_error
    assert (first["entry_a"], first["tensor"]) == ("Module.layers.2.Linear.forward.0", "output.0")
    assert "nan/inf differ" in first["reason"]
    before = [r for r in comp.rows if r["order"] < first["order"]]
    assert before and all(r["status"] == "pass" for r in before)
    if task == "tensor":
        assert all(r["cosine"] == 1.0 for r in before)
        assert first["nonfinite_mismatch"] == 1
    same = compare_dumps(clean, build_dump(tmp_path / "again", task=task))
    assert same.first_error is None and same.ranks[0].counts["pass"] == len(same.rows)


def test_shifted_call_counters_fall_back_to_call_site_and_order():
    a = ["Functional.relu.0.forward", "Tensor.add.0.forward", "Functional.relu.1.forward", "Tensor.add.1.forward"]
    b = ["Functional.relu.0.forward", "Functional.relu.1.forward", "Tensor.add.0.forward",
         "Functional.relu.2.forward", "Tensor.add.1.forward"]
    pairs, fallback = match_entries(a, b)
    assert fallback
    assert [(p.a, p.b, p.how) for p in pairs] == [
        ("Functional.relu.0.forward", "Functional.relu.0.forward", "name"),
        (None, "Functional.relu.1.forward", "only_b"),
        ("Tensor.add.0.forward", "Tensor.add.0.forward", "name"),
        ("Functional.relu.1.forward", "Functional.relu.2.forward", "order"),
        ("Tensor.add.1.forward", "Tensor.add.1.forward", "name"),
    ]
    same, fallback = match_entries(a, a)
    assert not fallback and all(p.how == "name" and p.a == p.b for p in same)


def test_compare_reports_unmatched_and_repaired(tmp_path):
    rec = stat_record(1.0, 0.0, 0.5, 1.0)
    entry = {"input_args": [rec], "input_kwargs": {}, "output": [rec]}
    write_dump_json(tmp_path / "a", {"Functional.relu.0.forward": entry, "Functional.relu.1.forward": entry})
    shifted = {"input_args": [rec], "input_kwargs": {}, "output": [stat_record(2.0, 0.0, 0.5, 1.0)]}
    write_dump_json(tmp_path / "b", {"Torch.zeros.0.forward": {"output": [rec]}, "Functional.relu.0.forward": entry,
                                     "Functional.relu.1.forward": shifted, "Functional.relu.2.forward": entry})
    (rank,) = compare_dumps(tmp_path / "a", tmp_path / "b").ranks
    assert rank.order_fallback and rank.only_b == ["Torch.zeros.0.forward", "Functional.relu.2.forward"]
    assert rank.counts == {"pass": 3, "warning": 0, "error": 1, "unmatched": 3}
    assert rank.first_error["reason"] == "Max relative error 1 > 0.5"


def test_statistics_thresholds(tmp_path):
    rec = stat_record(1.0, -1.0, 0.0, 10.0)
    write_dump_json(tmp_path / "a", {"Torch.mul.0.forward": {"output": [rec]}})
    write_dump_json(tmp_path / "b", {"Torch.mul.0.forward": {"output": [stat_record(1.0, -1.0, 0.3, 10.5)]}})
    (row,) = compare_dumps(tmp_path / "a", tmp_path / "b").rows
    assert (row["status"], row["reason"]) == ("warning", "Norm relative error 0.05 > 0.01")
    assert row["Mean_rel_err"] == math.inf and row["Norm_diff"] == 0.5
    (row,) = compare_dumps(tmp_path / "a", tmp_path / "b", Thresholds(stat_rel_warning=0.1)).rows
    assert row["status"] == "pass"


def test_bad_tensors_are_error_rows_and_the_rest_goes_on(tmp_path):
    clean = build_dump(tmp_path / "clean")
    other = build_dump(tmp_path / "other")
    tdir = other / "dump_tensor_data"
    (tdir / "Module.layers.0.Linear.forward.0.output.0.pt").unlink()
    torch.save(torch.zeros(3, 3), tdir / "Module.layers.2.Linear.forward.0.output.0.pt")
    comp = compare_dumps(clean, other)
    errors = [r for r in comp.rows if r["status"] == "error"]
    assert [(r["entry_a"], r["tensor"]) for r in errors] == [("Module.layers.0.Linear.forward.0", "output.0"),
                                                            ("Module.layers.2.Linear.forward.0", "output.0")]
    assert "Module.layers.0.Linear.forward.0.output.0.pt is missing" in errors[0]["reason"]
    assert "shape [3, 3] differs from dump.json shape [4, 16]" in errors[1]["reason"]
    assert "data['Module.layers.2.Linear.forward.0'].output.0" in errors[1]["reason"]
    assert len(comp.ranks[0].problems) == 2
    assert sum(r["status"] == "pass" for r in comp.rows) == len(comp.rows) - 2


def test_cli_compare_csv_and_errors(tmp_path, capsys):
    clean = build_dump(tmp_path / "clean", task="statistics")
    bad = build_dump(tmp_path / "bad", inject_nan_into="layers.4", task="statistics")
    out = tmp_path / "rows.csv"
    assert main(["compare", str(clean), str(bad), "-o", str(out), "--json", str(tmp_path / "s.json"),
                 "--threshold", "stat_rel_error=0.9"]) == 0
    text = capsys.readouterr().out
    assert "first error: Module.layers.4.Linear.forward.0 output.0" in text
    rows = list(csv.DictReader(out.open()))
    assert rows[0]["entry_a"] == "Module.layers.0.Linear.forward.0" and rows[0]["status"] == "pass"
    assert json.loads((tmp_path / "s.json").read_text())["first_error"]["entry_a"] == \
        "Module.layers.4.Linear.forward.0"
    (bad / "dump.json").write_text("{oops")
    assert main(["compare", str(clean), str(bad), "-o", str(out)]) == 1
    assert f"{bad / 'dump.json'}: invalid JSON at line 1, column 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(clean), str(bad), "--threshold", "nope=1"])


@pytest.mark.skipif(importlib.util.find_spec("openpyxl") is not None, reason="openpyxl is installed")
def test_xlsx_without_openpyxl_is_a_clear_error(tmp_path, capsys):
    clean = build_dump(tmp_path / "clean", task="statistics")
    assert main(["compare", str(clean), str(clean), "-o", str(tmp_path / "r.csv"),
                 "--xlsx", str(tmp_path / "r.xlsx")]) == 1
    assert "xlsx output needs openpyxl" in capsys.readouterr().err
