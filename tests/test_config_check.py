"""`config-check`: every monitor run writes environment.json at start; two runs' differences are
listed section by section, first difference first (env vars before config before data and weights)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine import Monitor
from msprobe_engine.analysis.config_check import differences, load_environment
from msprobe_engine.cli import main
from msprobe_engine.frameworks.torch.fingerprint import batch_fingerprint, weight_fingerprints
from tests.monitor_run_helpers import monitored_run


def _run(out, monkeypatch, *, nccl: str, lr_stat: str, seed: int, data_seed: int):
    monkeypatch.setenv("NCCL_ALGO", nccl)
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    config = {"output_dir": str(out), "run_name": "run", "sinks": ["jsonl"], "stats": ["norm", lr_stat], "strict": True}
    g = torch.Generator().manual_seed(data_seed)
    batches = [torch.randn(3, 4, generator=g) for _ in range(3)]

    def record(mon):
        mon.record_environment(hyperparameters={"lr": 0.1, "batch_size": 3}, weights=weight_fingerprints(model))
        mon.record_environment(data={"batches": [batch_fingerprint(b) for b in batches]})
    return monitored_run(model, config, batches, record)


def test_the_same_run_twice_has_no_difference(tmp_path, monkeypatch):
    a = _run(tmp_path / "a", monkeypatch, nccl="Ring", lr_stat="max", seed=0, data_seed=1)
    b = _run(tmp_path / "b", monkeypatch, nccl="Ring", lr_stat="max", seed=0, data_seed=1)
    assert differences(load_environment(a), load_environment(b)) == []
    assert main(["config-check", str(a), str(b)]) == 0
    everything = differences(load_environment(a), load_environment(b), everything=True)
    assert [key for key, *_ in everything] == ["config.output_dir"]


def test_differences_come_in_section_order_first_first(tmp_path, monkeypatch, capsys):
    a = _run(tmp_path / "a", monkeypatch, nccl="Ring", lr_stat="max", seed=0, data_seed=1)
    b = _run(tmp_path / "b", monkeypatch, nccl="Tree", lr_stat="min", seed=1, data_seed=2)
    found = differences(load_environment(a), load_environment(b))
    keys = [key for key, *_ in found]
    assert keys[0] == "env.NCCL_ALGO" and found[0][1:] == ("Ring", "Tree")
    assert keys.index("env.NCCL_ALGO") < keys.index("config.stats") < keys.index("data.batches[0]") \
        < keys.index("weights.weight")
    assert "data.batches[2]" in keys and "hyperparameters.lr" not in keys
    assert main(["config-check", str(a / "rank0"), str(b / "rank0" / "environment.json"),
                 "--json", str(tmp_path / "d.json")]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1].strip() == "env.NCCL_ALGO: Ring | Tree"
    assert json.loads((tmp_path / "d.json").read_text())[0] == {"key": "env.NCCL_ALGO", "a": "Ring", "b": "Tree"}


def test_snapshot_records_versions_env_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run = _run(tmp_path / "a", monkeypatch, nccl="Ring", lr_stat="max", seed=0, data_seed=1)
    env = load_environment(run)
    assert env["packages"]["torch"] == torch.__version__ and env["python"]["version"]
    assert env["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["env"]["NCCL_ALGO"] == "Ring"
    assert "HOME" not in env["env"] and env["config"]["stats"] == ["norm", "max"]
    assert env["hyperparameters"] == {"lr": 0.1, "batch_size": 3}


def test_fingerprints_follow_the_bytes():
    x = torch.arange(6.0)
    assert batch_fingerprint({"x": x, "y": [x.int()]}) == batch_fingerprint({"x": x.clone(), "y": [x.int()]})
    assert batch_fingerprint(x) != batch_fingerprint(x.double()) != batch_fingerprint(x.reshape(2, 3))
    assert batch_fingerprint(x.bfloat16()) != batch_fingerprint(x.half())
    model = nn.Linear(2, 2)
    prints = weight_fingerprints(model)
    with torch.no_grad():
        model.bias[0] += 1
    changed = weight_fingerprints(model.state_dict())
    assert prints["weight"] == changed["weight"] and prints["bias"] != changed["bias"]


def test_a_run_without_the_file_is_a_clear_error(tmp_path, capsys):
    assert main(["config-check", str(tmp_path), str(tmp_path)]) == 1
    assert "no environment.json" in capsys.readouterr().err


def test_a_rank_directory_with_only_the_snapshot_is_not_a_run_yet(tmp_path):
    Monitor({"output_dir": str(tmp_path), "run_name": "r", "sinks": ["jsonl"]}).close()
    Monitor({"output_dir": str(tmp_path), "run_name": "r", "sinks": ["jsonl"]}).close()  # no "already holds a run"
    assert (tmp_path / "r" / "rank0" / "environment.json").is_file()
