"""API accuracy pre-check (run_ut) offline, generate_operator, the standards, bad dumps.

The test model's GELU is replaced by one that computes in float16 for every dtype but float64
(tests/precheck_helpers.py): the pre-check must flag exactly that API, and nothing when the
GELU is the real one.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import precheck_helpers as helpers
from msprobe_engine.analysis.precheck.cases import ApiCase
from msprobe_engine.analysis.precheck.runner import PrecheckConfig, run_ut
from msprobe_engine.analysis.precheck.standards import check_output
from msprobe_engine.cli import main
from msprobe_engine.dump.reader import DumpError

ROOT = Path(__file__).resolve().parents[1]
APIS = ["Functional.linear.0", "Tensor.__mul__.0", "Functional.gelu.0", "Functional.layer_norm.0",
        "Functional.linear.1", "Functional.cross_entropy.0"]


def read_rows(path: Path) -> dict[str, list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["API name", "Forward Test Success", "Backward Test Success", "Message"]
    return {row[0]: row[1:] for row in rows[1:]}


@pytest.fixture
def lossy_gelu():
    helpers.install()
    yield
    helpers.uninstall()


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_run_ut_flags_exactly_the_lossy_api(tmp_path, lossy_gelu, task, capsys):
    rank_dir = helpers.train_step_dump(tmp_path / "dump", task)
    assert main(["run_ut", "-i", str(rank_dir), "-o", str(tmp_path / "out"), "--xlsx"]) == 0
    assert "1 error, 11 pass" in capsys.readouterr().out
    rows = read_rows(next((tmp_path / "out").glob("accuracy_checking_result_*.csv")))
    assert list(rows) == APIS
    assert rows.pop("Functional.gelu.0")[:2] == ["error", "pass"]
    assert all(r[:2] == ["pass", "pass"] for r in rows.values()), rows
    assert next((tmp_path / "out").glob("accuracy_checking_result_*.xlsx")).stat().st_size > 0
    with open(next((tmp_path / "out").glob("accuracy_checking_details_*.csv")), newline="", encoding="utf-8") as f:
        details = {row[0]: row for row in csv.reader(f)}
    assert details["Functional.gelu.0.forward.output.0"][-2] == "error"
    assert float(details["Functional.gelu.0.forward.output.0"][5]) > 1e-3  # max abs error column

    helpers.uninstall()  # the real GELU on the same dump: nothing to flag
    reports = run_ut(rank_dir, tmp_path / "control")
    assert set(reports[0].counts) == {"pass"}


def test_white_list_and_resume(tmp_path):
    rank_dir = helpers.train_step_dump(tmp_path / "dump", "tensor")
    first = run_ut(rank_dir, tmp_path / "out", config=PrecheckConfig(white_list=("linear",)))
    assert list(read_rows(first[0].result_path)) == ["Functional.linear.0", "Functional.linear.1"]
    second = run_ut(rank_dir, tmp_path / "out", resume=True, config=PrecheckConfig(black_list=("cross_entropy",)))
    assert second[0].result_path == first[0].result_path
    assert list(read_rows(second[0].result_path)) == ["Functional.linear.0", "Functional.linear.1", "Tensor.__mul__.0",
                                                      "Functional.gelu.0", "Functional.layer_norm.0"]


@pytest.mark.slow
def test_generate_operator_script_reproduces_the_error(tmp_path, lossy_gelu):
    rank_dir = helpers.train_step_dump(tmp_path / "dump", "statistics")
    script = tmp_path / "repro.py"
    assert main(["generate_operator", "-i", str(tmp_path / "dump"), "--api", "Functional.gelu.0.forward",
                 "-o", str(script)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    lossy = helpers.sitecustomize_dir(tmp_path / "site")
    bad = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": os.pathsep.join([str(lossy), str(ROOT)])})
    assert bad.returncode == 1, bad.stderr
    assert "Functional.gelu.0 on cpu: forward error" in bad.stdout
    good = subprocess.run([sys.executable, str(script), "cpu"], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": str(ROOT)})
    assert good.returncode == 0, good.stderr
    assert "forward pass, backward pass" in good.stdout
    assert str(rank_dir.resolve()) in script.read_text()


def test_truncated_dump_names_the_file_and_entry(tmp_path, capsys):
    rank_dir = helpers.train_step_dump(tmp_path / "dump", "tensor")
    tensor = rank_dir / "dump_tensor_data" / "Functional.gelu.0.forward.input.0.pt"
    tensor.write_bytes(tensor.read_bytes()[:40])
    with pytest.raises(DumpError, match=r"Functional\.gelu\.0\.forward\.input\.0\.pt.*'Functional\.gelu\.0\.forward'"
                                         r".*input_args\.0.*cannot load tensor"):
        run_ut(rank_dir, tmp_path / "out")
    dump_json = rank_dir / "dump.json"
    dump_json.write_text(dump_json.read_text()[:500])
    assert main(["run_ut", "-i", str(rank_dir), "-o", str(tmp_path / "out2")]) == 1
    assert f"{dump_json}: invalid JSON at line" in capsys.readouterr().err


def test_other_tool_version_entry_is_named(tmp_path, capsys):
    rank_dir = helpers.train_step_dump(tmp_path / "dump", "statistics")
    doc = json.loads((rank_dir / "dump.json").read_text())
    doc["data"]["Functional.gelu.0.forward"]["input_args"][0]["shape"] = "8x64"
    (rank_dir / "dump.json").write_text(json.dumps(doc))
    assert main(["run_ut", "-i", str(rank_dir), "-o", str(tmp_path / "out")]) == 1
    assert "data['Functional.gelu.0.forward'].input_args[0]: 'shape'" in capsys.readouterr().err


def test_unreplayable_calls_are_skipped_with_a_reason():
    record = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0,
              "Mean": 0.5, "Norm": 1.0, "requires_grad": False}
    entry = {"input_args": [record], "input_kwargs": {}}
    assert "random op" in ApiCase("Functional.dropout.0", "Functional.dropout", entry).skip_reason()
    assert "communication op" in ApiCase("Distributed.all_reduce.0", "Distributed.all_reduce", entry).skip_reason()
    unknown = {"input_args": [record, {}], "input_kwargs": {}}
    assert "could not describe" in ApiCase("Functional.gelu.0", "Functional.gelu", unknown).skip_reason()
    assert ApiCase("Functional.gelu.0", "Functional.gelu", entry).skip_reason() is None
    assert ApiCase("Tensor.add_.0", "Tensor.add_", entry).inplace


def test_standards_per_dtype():
    bench = np.linspace(4.0, 16.0, 1000)
    assert check_output(bench, bench.astype(np.float32).astype(np.float64), "torch.float32").status == "pass"
    half = bench.astype(np.float16).astype(np.float64)
    assert check_output(bench, half, "torch.float16").status == "pass"     # float16's own rounding
    assert check_output(bench, half, "torch.float32").status == "warning"  # the same error in float32
    for dtype in ("torch.float16", "torch.bfloat16", "torch.float32"):
        assert check_output(bench, bench * 1.02, dtype).status == "error"
    wrong = bench.copy()
    wrong[0] = np.inf
    assert "inf/nan" in check_output(bench, wrong, "torch.float32").message
    ints = np.arange(10)
    assert check_output(ints, ints, "torch.int64").status == "pass"
    assert check_output(ints, ints[::-1].copy(), "torch.int64").metrics["error_rate"] == 1.0
    assert check_output(bench, bench[:10], "torch.float32").status == "error"


def test_every_call_of_a_small_gpt_replays_from_statistics(tmp_path):
    """Attention, embedding, indexing, layer norm... from a statistics dump: all pass, the one
    creation op is skipped with its reason."""
    import torch
    from examples.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
    from msprobe_engine.dump import PrecisionDebugger

    cfg = GPTConfig(dim=32, heads=2, layers=1, seq=16, batch=2, vocab=64)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    tokens, targets = next(synthetic_batches(cfg, 1))
    debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(tmp_path / "dump"), "level": "L1",
                                  "risk_level": "ALL"})  # every API, creation ops included
    debugger.start(model)
    model(tokens, targets).backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    rows = read_rows(run_ut(tmp_path / "dump", tmp_path / "out")[0].result_path)
    skipped = {name: r for name, r in rows.items() if r[0] == "SKIP"}
    assert skipped == {"Torch.zeros_like.0": ["SKIP", " ", "creation op: no input to check"]}
    assert len(rows) > 15 and all(r[0] == "pass" and r[1] in ("pass", " ") for n, r in rows.items()
                                  if n not in skipped), rows
    assert any(n.startswith("Functional.multi_head_attention_forward") and r[1] == "pass" for n, r in rows.items())
    assert any(n.startswith("Tensor.transpose") for n in rows)  # (indexing is not wrapped, as in the predecessor)


@pytest.mark.slow
def test_analysis_side_imports_no_framework():
    code = ("import sys\n"
            "from msprobe_engine.analysis.precheck import cases, client, protocol, report, runner, server, standards\n"
            "print(sorted(m for m in ('torch', 'mindspore', 'deepspeed', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert out.strip() == "[]"


def test_predecessor_run_ut_config_section(tmp_path):
    from msprobe_engine.analysis.precheck.runner import load_precheck_config
    from msprobe_engine.errors import ConfigError

    config = {"task": "run_ut", "dump_path": "./dump", "rank": [], "step": [], "level": "L1",
              "run_ut": {"white_list": ["gelu"], "black_list": [], "error_data_path": "./", "is_online": True,
                         "nfs_path": "", "host": "127.0.0.1", "port": -1, "rank_list": [0]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_precheck_config(tmp_path / "config.json")
    assert (loaded.white_list, loaded.host, loaded.port) == (("gelu",), "127.0.0.1", 0)
    config["run_ut"]["white_lst"] = ["gelu"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"run_ut\.white_lst: unknown key"):
        load_precheck_config(tmp_path / "config.json")


def test_every_api_of_the_capture_catalog_resolves():
    """run_ut finds the function of every API name the L1 capture writes (communication ops are
    skipped by design)."""
    from msprobe_engine.frameworks.torch.capture.api import ApiCatalog
    from msprobe_engine.frameworks.torch.precheck.replay import resolve

    infos = [i for i in ApiCatalog().dumped() if i.prefix != "Distributed"]
    assert len(infos) > 1000
    assert [i.key for i in infos if not callable(resolve(i.key))] == []


@pytest.mark.slow
def test_dump_of_the_predecessor(tmp_path, lossy_gelu):
    """A tensor dump written by the real predecessor (its ``step0/proc<pid>/`` layout, its API
    names): run_ut flags the lossy GELU and nothing else. (Its statistics dumps have the same
    records; ours are tested above.)"""
    code = (f"from pathlib import Path; import precheck_helpers; "
            f"precheck_helpers.predecessor_dump(Path({str(tmp_path / 'dump')!r}), 'tensor')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300, env=env)
    (proc_dir,) = (tmp_path / "dump" / "step0").glob("proc*")
    rows = read_rows(run_ut(proc_dir, tmp_path / "out")[0].result_path)
    assert list(rows) == [name.replace("Tensor.mul", "Tensor.__mul__") for name in APIS]
    assert rows.pop("Functional.gelu.0")[:2] == ["error", "pass"]
    assert all(r[:2] == ["pass", "pass"] for r in rows.values()), rows


@pytest.mark.slow
def test_details_read_by_the_predecessors_api_precision_compare(tmp_path, lossy_gelu):
    """Our details CSVs feed the predecessor's own NPU-vs-GPU tool: the lossy run as its "NPU"
    side, a run with the real GELU as its "GPU" side. It reads every row and flags GELU only."""
    rank_dir = helpers.train_step_dump(tmp_path / "dump", "tensor")
    lossy = run_ut(rank_dir, tmp_path / "lossy")[0].details_path
    helpers.uninstall()
    exact = run_ut(rank_dir, tmp_path / "exact")[0].details_path
    msprobe = Path(sys.executable).with_name("msprobe")
    subprocess.run([str(msprobe), "api_precision_compare", "-npu", str(lossy), "-gpu", str(exact),
                    "-o", str(tmp_path / "apc")], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(next((tmp_path / "apc").glob("api_precision_compare_result_*.csv")), newline="",
              encoding="utf-8-sig") as f:
        rows = {row[0]: row[1:3] for row in list(csv.reader(f))[1:]}
    assert list(rows) == APIS
    assert rows.pop("Functional.gelu.0")[0] == "error"
    assert all(r == ["pass", "pass"] for r in rows.values()), rows


def test_one_report_per_rank_and_a_progress_line(tmp_path, capsys):
    import shutil

    rank_dir = helpers.train_step_dump(tmp_path / "single", "statistics")
    for rank in (0, 1):
        shutil.copytree(rank_dir, tmp_path / "dump" / "step0" / f"rank{rank}")
    assert main(["run_ut", "-i", str(tmp_path / "dump"), "-o", str(tmp_path / "out"), "--progress"]) == 0
    for rank in (0, 1):
        (result,) = (tmp_path / "out" / "step0" / f"rank{rank}").glob("accuracy_checking_result_*.csv")
        assert list(read_rows(result)) == APIS
    assert f"{len(APIS)}/{len(APIS)}" in capsys.readouterr().err
