"""task diff_check: each call compared with a reference dump while training; the first divergent one is named."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import PrecisionDebugger, load_dump
from msprobe_engine.dump.live_compare import SUMMARY_JSON


class Net(nn.Module):
    """linear -> round(decimals) -> tanh -> linear: `decimals` is the one operator's precision."""

    def __init__(self, decimals: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 2)
        self.decimals = decimals

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.round(self.fc1(x), decimals=self.decimals)
        return self.fc2(torch.tanh(h)).sum()


def _run(config, decimals, steps=2):
    torch.manual_seed(0)
    model, x = Net(decimals), torch.randn(4, 8)
    with PrecisionDebugger({"strict": True, "level": "L1", **config}) as debugger:
        for _ in range(steps):
            with debugger.step_scope(model):
                model(x).backward()
    return debugger


@pytest.mark.parametrize("summary_mode", ["statistics", "md5"])
def test_the_first_divergent_call_is_named_and_dumped(tmp_path, summary_mode):
    reference = tmp_path / "reference"
    _run({"dump_path": str(reference), "summary_mode": summary_mode}, decimals=6)
    live = tmp_path / "live"
    debugger = _run({"task": "diff_check", "dump_path": str(live),
                     "diff_check": {"bench_path": str(reference), "diff_nums": 2, "rtol": 1e-4,
                                    "summary_mode": summary_mode}}, decimals=1)
    assert debugger.task_results == [(0, "Torch.round.0.forward"), (1, "Torch.round.0.forward")]
    rank = load_dump(live)[(0, None)]
    assert list(rank.data) == ["Torch.round.0.forward", "Torch.tanh.0.forward"]  # the first diff_nums=2
    summary = json.loads((rank.path / SUMMARY_JSON).read_text())
    assert summary["first_divergent"] == "Torch.round.0.forward" and summary["reason"].startswith("output.0: ")
    out = rank.data["Torch.round.0.forward"]["output"][0]
    saved = torch.load(rank.path / "dump_tensor_data" / out["data_name"])
    assert torch.equal(saved, torch.round(saved, decimals=1))  # the real tensor of the divergent call


def test_identical_runs_dump_nothing(tmp_path):
    reference = tmp_path / "reference"
    _run({"dump_path": str(reference)}, decimals=3)
    debugger = _run({"task": "diff_check", "dump_path": str(tmp_path / "live"),
                     "diff_check": {"bench_path": str(reference)}}, decimals=3)
    assert debugger.task_results == [] and not (tmp_path / "live").exists()


def test_tolerances_decide(tmp_path):
    reference = tmp_path / "reference"
    _run({"dump_path": str(reference)}, decimals=6, steps=1)
    loose = _run({"task": "diff_check", "dump_path": str(tmp_path / "live"),
                  "diff_check": {"bench_path": str(reference), "rtol": 0.5, "atol": 0.5}}, decimals=1, steps=1)
    assert loose.task_results == []


@pytest.mark.parametrize("section,message", [
    ({}, "diff_check.bench_path: required"),
    ({"bench_path": "/nonexistent/ref"}, "diff_check.bench_path: '/nonexistent/ref' is not a directory"),
    ({"bench_path": ".", "diff_nums": 0}, "diff_check.diff_nums: expected a positive integer or -1"),
    ({"bench_path": ".", "rtol": -1}, "diff_check.rtol: expected a finite number >= 0"),
])
def test_bad_diff_check_config(tmp_path, section, message):
    with pytest.raises(ConfigError) as err:
        PrecisionDebugger({"task": "diff_check", "dump_path": str(tmp_path), "diff_check": section})
    assert message in str(err.value)


def test_a_directory_that_is_no_dump_is_refused_before_training(tmp_path):
    debugger = PrecisionDebugger({"task": "diff_check", "dump_path": str(tmp_path / "d"),
                                  "diff_check": {"bench_path": str(tmp_path)}})
    with pytest.raises(ConfigError, match="diff_check.bench_path: .* is not a usable dump"):
        debugger.start()
    debugger.close()
