"""`api-precision-compare` (also `api_precision_compare`): two devices' run_ut details compared, against the predecessor's own tool.

The device under test is a GELU computed through float16 (`precheck_helpers.lossy_gelu`), the
reference the exact one: each runs our run_ut on the same dump. The predecessor's
``msprobe api_precision_compare`` and ours read the two details files; both write the same
result and details CSVs, cell for cell, and flag GELU only (forward and backward).
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

import tests.precheck_helpers as helpers
from msprobe_engine.analysis.precheck.precision_compare import (DETAIL_COLUMNS, RESULT_COLUMNS, compare_details,
                                                               read_details)
from msprobe_engine.analysis.precheck.runner import run_ut
from msprobe_engine.cli import main
from tests.predecessor_helpers import run_msprobe


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def details(tmp_path_factory):
    """(device details CSV, reference details CSV): run_ut on one dump, with and without the lossy GELU."""
    root = tmp_path_factory.mktemp("precision_compare")
    rank_dir = helpers.train_step_dump(root / "dump", "tensor")
    helpers.install()
    try:
        device = run_ut(rank_dir, root / "device")[0].details_path
    finally:
        helpers.uninstall()
    reference = run_ut(rank_dir, root / "reference")[0].details_path
    return device, reference


def _row(name: str, dtype: str = "torch.float32", **values: str) -> dict[str, str]:
    row = {"API Name": name, "Bench Dtype": "torch.float64", "DEVICE Dtype": dtype, "Shape": "(2,)"}
    row.update(dict.fromkeys(("小值域错误占比", "均方根误差", "相对误差最大值", "相对误差平均值", "误差均衡性"), "0.001"))
    row.update(dict.fromkeys(("二进制一致错误率", "相对误差错误率", "绝对误差错误率", "inf/nan错误率", "ULP误差平均值",
                              "ULP误差大于阈值占比", "双千指标"), " "))
    row.update(Message=" ", **values)
    return row


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


#: rows built for each branch of the judgement (device side), and what each gets (API, forward, backward)
BRANCHES = [("Torch.mm.0.forward.output.0", {"均方根误差": "0.0013"}),    # ratio 1.3: above mm's 1.2
            ("Torch.add.0.forward.output.0", {"均方根误差": "0.0013"}),   # below the default 2
            ("Torch.add.0.backward.output.0", {"均方根误差": "inf"}),     # inf on one side only
            ("Torch.argmax.0.forward.output.0", {"DEVICE Dtype": "torch.int64", "二进制一致错误率": "0.5"}),
            ("Torch.double.0.forward.output.0", {"DEVICE Dtype": "torch.float64"}),
            ("Torch.bad.name", {}),
            ("Torch.gone.0.forward.output.0", {})]  # the reference lacks it
JUDGED = {"Torch.mm.0": ["error", " "], "Torch.add.0": ["pass", "error"], "Torch.argmax.0": ["error", " "],
          "Torch.bad.name": ["SKIP", "SKIP"], "Torch.double.0": ["SKIP", "SKIP"]}


@pytest.mark.slow
def test_the_same_csvs_as_the_predecessors_tool(details, tmp_path, capsys):
    """Two real run_ut reports, and the rows built for each branch, in one pair of files: one run of
    the predecessor's tool (its start-up is most of the time)."""
    real_device, real_reference = (read_details(path) for path in details)
    header = list(real_device[0])
    built = [{**dict.fromkeys(header, " "), **_row(name, **values)} for name, values in BRANCHES]
    device = _write(tmp_path / "npu.csv", real_device + built)
    reference = _write(tmp_path / "gpu.csv", real_reference + [{**dict.fromkeys(header, " "), **_row(name)}
                                                               for name, _ in BRANCHES[:-1]])
    assert main(["api_precision_compare", "-npu", str(device), "-gpu", str(reference), "-o", str(tmp_path / "ours")]) == 1
    assert "error(s): Functional.gelu.0" in capsys.readouterr().out
    run_msprobe("api_precision_compare", "-npu", str(device), "-gpu", str(reference), "-o", str(tmp_path / "theirs"))
    for prefix, header_ in (("api_precision_compare_result_", RESULT_COLUMNS),
                            ("api_precision_compare_details_", DETAIL_COLUMNS)):
        (ours,) = (tmp_path / "ours").glob(f"{prefix}*.csv")
        (theirs,) = (tmp_path / "theirs").glob(f"{prefix}*.csv")
        assert ours.read_bytes()[:3] == theirs.read_bytes()[:3] == b"\xef\xbb\xbf"
        our_rows, their_rows = _rows(ours), _rows(theirs)
        assert our_rows[0] == their_rows[0] == list(header_)
        assert len(their_rows) > 6
        for ours_row, theirs_row in zip(our_rows, their_rows):
            assert ours_row == theirs_row
        assert len(our_rows) == len(their_rows)
        assert ours.read_bytes() == theirs.read_bytes()
    details_rows = {row[0]: row for row in _rows(ours)[1:]}
    assert details_rows["Torch.mm.0.forward.output.0"][3:5] == ["1.30000000000000", "error"]
    assert details_rows["Torch.mm.0.forward.output.0"][-2] == "标杆比对法"
    assert details_rows["Torch.add.0.backward.output.0"][3:5] == ["nan", "error"]
    assert "inf或nan不一致" in details_rows["Torch.add.0.backward.output.0"][-1]
    assert "Torch.gone.0.forward.output.0" not in details_rows  # the row the reference lacks: left out
    results = {row[0]: row[1:3] for row in _rows(ours.with_name(ours.name.replace("details", "result")))[1:]}
    assert {name: results.pop(name) for name in JUDGED} == JUDGED
    assert results.pop("Functional.gelu.0") == ["error", "error"]
    assert set(map(tuple, results.values())) == {("pass", "pass")}


def test_a_file_that_is_not_a_details_file_is_named(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("API Name,DEVICE Dtype\nx,y\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.csv: not a pre-check details file: missing column\(s\) 小值域错误占比"):
        read_details(bad)


def test_the_verb_is_api_precision_compare_and_its_predecessor_spelling_too(tmp_path, capsys):
    device = [_row("Torch.mm.0.forward.output.0", 均方根误差="0.0013"), _row("Torch.add.0.forward.output.0")]
    reference = [_row(r["API Name"]) for r in device]
    npu, gpu = _write(tmp_path / "npu.csv", device), _write(tmp_path / "gpu.csv", reference)
    results, details = compare_details(device, reference)
    for verb in ("api-precision-compare", "api_precision_compare"):
        out = tmp_path / verb
        assert main([verb, "-npu", str(npu), "-gpu", str(gpu), "-o", str(out)]) == 1  # an error found: exit 1
        assert "1 error(s): Torch.mm.0" in capsys.readouterr().out
        (result,) = out.glob("api_precision_compare_result_*.csv")
        (detail,) = out.glob("api_precision_compare_details_*.csv")
        assert _rows(result)[1:] == results and _rows(detail)[1:] == details
