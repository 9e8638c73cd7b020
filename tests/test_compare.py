"""`compare` of two dumps: metrics against numpy references, matching, statuses, bad input, CLI."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from dumpgen import build_dump, stat_record, write_dump_json
from msprobe_engine.analysis import Thresholds, compare_dumps, tensor_metrics
from msprobe_engine.analysis.compare import COLUMNS
from msprobe_engine.analysis.match import count_by_pass, match_entries
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


def test_passes_name_then_site_then_order_then_signature():
    a = ["Functional.relu.0.forward", "Tensor.__add__.0.forward", "Tensor.__iadd__.0.forward",
         "Module.fc.Linear.parameters_grad", "Torch.mm.3.forward", "Torch.mm.4.forward", "Functional.gelu.0.forward"]
    b = ["Functional.relu.0.forward", "Tensor.add.0.forward", "Tensor.add_.0.forward",
         "Module.fc.Linear.parameters_grad.0", "Torch.mm.0.forward", "Torch.mm.1.forward",
         "Functional.silu.0.forward", "Torch.zeros.0.forward"]
    small, large = stat_record(1.0, 0.0, 0.5, 1.0, shape=[2]), stat_record(9.0, 0.0, 4.0, 9.0, shape=[2])
    data_a = {n: {"output": [small]} for n in a} | {"Functional.gelu.0.forward": {"output": [large]}}
    data_b = {n: {"output": [small]} for n in b} | {"Functional.silu.0.forward": {"output": [large]},
                                                     "Torch.zeros.0.forward": {"output": [small]}}
    pairs, fallback = match_entries(a, b, data_a, data_b)
    assert fallback
    assert [(p.a, p.b, p.how) for p in pairs] == [
        ("Functional.relu.0.forward", "Functional.relu.0.forward", "name"),
        ("Tensor.__add__.0.forward", "Tensor.add.0.forward", "order"),     # x + y is x.add(y)
        ("Tensor.__iadd__.0.forward", "Tensor.add_.0.forward", "order"),   # x += y is x.add_(y)
        ("Module.fc.Linear.parameters_grad", "Module.fc.Linear.parameters_grad.0", "spelling"),  # 1.x vs 26.2
        ("Torch.mm.3.forward", "Torch.mm.0.forward", "order"),             # counters shifted: call order
        ("Torch.mm.4.forward", "Torch.mm.1.forward", "order"),
        ("Functional.gelu.0.forward", "Functional.silu.0.forward", "signature"),  # same tensors, same values
        (None, "Torch.zeros.0.forward", "only_b"),  # values 9x apart from gelu's: left unmatched
    ]
    assert count_by_pass(pairs) == {"name": 1, "spelling": 1, "site": 0, "order": 4, "signature": 1,
                                    "only_a": 0, "only_b": 1}
    single, _ = match_entries(["Functional.relu.5.forward"], ["Functional.relu.2.forward"])
    assert [(p.a, p.b, p.how) for p in single] == [("Functional.relu.5.forward", "Functional.relu.2.forward", "site")]
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
    # exact names pair first: the extra call in B (relu.2) and zeros stay unmatched
    assert not rank.order_fallback and rank.only_b == ["Torch.zeros.0.forward", "Functional.relu.2.forward"]
    assert rank.matched_by == {"name": 2, "spelling": 0, "site": 0, "order": 0, "signature": 0,
                               "only_a": 0, "only_b": 2}
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


def test_xlsx_output_holds_the_csv_rows(tmp_path):
    from openpyxl import load_workbook  # always in the test environment

    clean = build_dump(tmp_path / "clean", task="statistics")
    assert main(["compare", str(clean), str(clean), "-o", str(tmp_path / "r.csv"),
                 "--xlsx", str(tmp_path / "r.xlsx")]) == 0
    with open(tmp_path / "r.csv", newline="", encoding="utf-8") as f:
        csv_rows = list(csv.reader(f))
    sheet = load_workbook(tmp_path / "r.xlsx", read_only=True)["compare"]
    xlsx_rows = [["" if v is None else str(v) for v in row] for row in sheet.iter_rows(values_only=True)]
    assert xlsx_rows[0] == csv_rows[0] == COLUMNS and len(xlsx_rows) == len(csv_rows) > 1
    status = COLUMNS.index("status")
    assert [r[status] for r in xlsx_rows[1:]] == [r[status] for r in csv_rows[1:]] and \
        {r[status] for r in xlsx_rows[1:]} == {"pass"}
    entry = COLUMNS.index("entry_a")
    assert [r[entry] for r in xlsx_rows[1:]] == [r[entry] for r in csv_rows[1:]]


def _with_nonfinite(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[3], x[10], x[11] = np.nan, np.inf, -np.inf
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.bool])
@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_metrics_of_torch_tensors_equal_those_of_their_float64_values(dtype, chunk):
    """Torch inputs (bfloat16 included, converted chunk by chunk) give exactly the metrics of
    the same values as a float64 numpy array."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal(300) * 3
    b = a * (1 + rng.uniform(-0.006, 0.006, a.shape))
    b[::17] = 0.0
    a[::23] = 0.0
    if dtype.is_floating_point:
        a, b = _with_nonfinite(a), _with_nonfinite(b)
        b[11] = np.inf  # -inf vs inf: a mismatch
    ta, tb = torch.from_numpy(a).to(dtype), torch.from_numpy(b).to(dtype)
    got = tensor_metrics(ta.reshape(20, 15), tb.reshape(20, 15), chunk=chunk)
    want = tensor_metrics(ta.double().numpy(), tb.double().numpy(), chunk=chunk)
    assert got == want
    assert got.nonfinite_mismatch == (1 if dtype.is_floating_point else 0)


@pytest.mark.parametrize("spread", [0.0005, 0.003, 0.02])
@pytest.mark.parametrize("chunk", [5, 64, 1 << 18])
def test_ratios_exact_whatever_the_largest_relative_error(spread, chunk):
    """The ratio counts skip a pass when a chunk's largest relative error is within a ratio;
    the counts equal the reference's in every case, with 0/0 counting as within and x/0 not."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal(257)
    b = a * (1 + rng.uniform(-spread, spread, a.shape))
    a[[5, 6, 70]] = 0.0
    b[[5, 6]] = 0.0      # 0 vs 0: within
    b[70] = 1e-30        # 0 vs tiny: relative error inf
    m = tensor_metrics(a, b, chunk=chunk)
    for key, value in _reference(a, b).items():
        assert getattr(m, key) == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert m.max_rel_err == math.inf


def test_metrics_all_zero_chunks_and_large_values():
    z = np.zeros(10)
    assert tensor_metrics(z, z, chunk=3).one_thousandth_ratio == 1.0
    a = np.array([1e300, -1e300, 5.0])
    b = np.array([1e300, -1e300, 5.0])
    m = tensor_metrics(a, b)
    assert (m.max_abs_err, m.max_rel_err, m.one_thousandth_ratio, m.nonfinite_mismatch) == (0.0, 0.0, 1.0, 0)


def test_open_tensor_maps_pt_and_npy_and_keeps_the_checks(tmp_path):
    from msprobe_engine.dump.reader import DumpError, load_dump
    from msprobe_engine.dump.schema import iter_tensors

    rank_dir = tmp_path / "dump" / "step0" / "rank0"
    names = {"Torch.a.0.forward": "bf.pt", "Torch.b.0.forward": "legacy.pt", "Torch.c.0.forward": "x.npy",
             "Torch.d.0.forward": "link.pt"}
    write_dump_json(rank_dir, {entry: {"output": [stat_record(1.0, 0.0, 0.5, 1.0, data_name=name)]}
                               for entry, name in names.items()}, task="tensor")
    tdir = rank_dir / "dump_tensor_data"
    tdir.mkdir()
    torch.save(torch.tensor([1.5, 2.0], dtype=torch.bfloat16), tdir / "bf.pt")
    torch.save(torch.arange(3), tdir / "legacy.pt", _use_new_zipfile_serialization=False)
    np.save(tdir / "x.npy", np.arange(4, dtype=np.int16))
    torch.save(torch.zeros(2), tmp_path / "outside.pt")
    (tdir / "link.pt").symlink_to(tmp_path / "outside.pt")
    dump = load_dump(rank_dir)[(0, 0)]
    refs = {entry: next(iter_tensors(entry, dump.data[entry])) for entry in names}
    bf = dump.open_tensor(refs["Torch.a.0.forward"])
    assert isinstance(bf, torch.Tensor) and bf.dtype == torch.bfloat16 and bf.tolist() == [1.5, 2.0]
    assert dump.open_tensor(refs["Torch.b.0.forward"]).tolist() == [0, 1, 2]  # legacy format: read, not mapped
    npy = dump.open_tensor(refs["Torch.c.0.forward"])
    assert isinstance(npy, np.memmap) and npy.tolist() == [0, 1, 2, 3]
    with pytest.raises(DumpError, match="resolves outside dump_tensor_data/"):
        dump.open_tensor(refs["Torch.d.0.forward"])
    # load_tensor still gives numpy arrays in memory
    assert dump.load_tensor(refs["Torch.a.0.forward"]).dtype == np.float32


def test_tensor_compare_of_bfloat16_dumps(tmp_path):
    """A tensor dump holding bfloat16 .pt files compares through the torch path."""
    for side, scale in (("a", 1.0), ("b", 1.0 + 2**-7)):
        rank_dir = tmp_path / side / "step0" / "rank0"
        t = torch.linspace(-3, 3, 40, dtype=torch.bfloat16).reshape(4, 10) * scale
        rec = stat_record(t.max().item(), t.min().item(), t.float().mean().item(), t.float().norm().item(),
                          data_name="Torch.mul.0.forward.output.0.pt")
        rec.update(dtype="torch.bfloat16", shape=[4, 10])
        write_dump_json(rank_dir, {"Torch.mul.0.forward": {"output": [rec]}}, task="tensor")
        (rank_dir / "dump_tensor_data").mkdir()
        torch.save(t, rank_dir / "dump_tensor_data" / rec["data_name"])
    (row,) = compare_dumps(tmp_path / "a", tmp_path / "b").rows
    a = torch.load(tmp_path / "a/step0/rank0/dump_tensor_data/Torch.mul.0.forward.output.0.pt").double().numpy()
    b = torch.load(tmp_path / "b/step0/rank0/dump_tensor_data/Torch.mul.0.forward.output.0.pt").double().numpy()
    for key, value in _reference(a, b).items():
        assert row[key] == pytest.approx(value, rel=1e-12), key


def test_npy_tensor_dump_compares_without_torch(tmp_path):
    """torch is needed only for .pt files: a .npy tensor dump compares with torch unimportable."""
    import subprocess
    import sys

    for side, scale in (("a", 1.0), ("b", 1.0001)):
        x = np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(scale)
        rec = stat_record(float(x.max()), float(x.min()), float(x.mean()), float(np.linalg.norm(x)),
                          shape=[3, 4], data_name="t.npy")
        rank_dir = write_dump_json(tmp_path / side, {"Torch.x.0.forward": {"output": [rec]}}, task="tensor")
        (rank_dir / "dump_tensor_data").mkdir()
        np.save(rank_dir / "dump_tensor_data" / "t.npy", x)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from msprobe_engine.analysis import compare_dumps\n"
            f"(row,) = compare_dumps({str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}).rows\n"
            "print(row['status'], row['max_rel_err'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "pass" and float(out[1]) == pytest.approx(1e-4, rel=1e-2)
