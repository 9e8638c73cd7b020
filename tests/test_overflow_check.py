"""task overflow_check: the first calls whose outputs hold nan/inf are dumped, a clean step dumps nothing."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import PrecisionDebugger, load_dump
from msprobe_engine.frameworks.torch.capture.overflow import SUMMARY_JSON


class Net(nn.Module):
    """linear -> log -> linear; `poison` makes the log's input negative in one row (nan)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.fc1(x)) + 0.5
        if self.poison:
            h = h - torch.tensor([[2.0], [0.0], [0.0]])
        return self.fc2(torch.log(h)).relu()


def _train(tmp_path, poisoned_steps, steps=3, **section):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    config = {"task": "overflow_check", "dump_path": str(tmp_path), "level": "L1", "strict": True,
              "overflow_check": section}
    with PrecisionDebugger(config) as debugger:
        for step in range(steps):
            model.poison = step in poisoned_steps
            with debugger.step_scope(model):
                model(x).sum().backward()  # no optimizer step: nan gradients leave the weights clean
    return debugger


def test_the_injected_call_is_dumped_first_and_clean_steps_dump_nothing(tmp_path):
    debugger = _train(tmp_path, poisoned_steps={1}, overflow_nums=1)
    dump = load_dump(tmp_path)
    assert sorted(dump) == [(1, None)]  # steps 0 and 2 are clean: no files
    rank = dump[(1, None)]
    assert list(rank.data) == ["Torch.log.0.forward"]
    entry = rank.data["Torch.log.0.forward"]
    assert entry["output"][0]["Min"] != entry["output"][0]["Min"]  # nan
    saved = torch.load(rank.path / "dump_tensor_data" / entry["output"][0]["data_name"])
    assert torch.isnan(saved[0]).all() and torch.isfinite(saved[1:]).all()
    inp = torch.load(rank.path / "dump_tensor_data" / entry["input_args"][0]["data_name"])
    assert (inp[0] < 0).all()  # the input as it was: its first row made negative
    summary = json.loads((rank.path / SUMMARY_JSON).read_text())
    assert summary["first_overflow"] == "Torch.log.0.forward" and summary["step"] == 1
    assert debugger.task_results == [(1, "Torch.log.0.forward")]
    assert debugger.transfers == 3  # statistics: one device-to-host copy per step


def test_all_overflowing_calls_in_execution_order(tmp_path):
    _train(tmp_path, poisoned_steps={0}, steps=1, overflow_nums=-1)
    rank = load_dump(tmp_path)[(0, None)]
    names = list(rank.data)
    assert names[0] == "Torch.log.0.forward"
    assert "Functional.linear.1.forward" in names and "Torch.sub.0.forward" not in names
    assert any(n.endswith(".backward") for n in names)  # nan gradients flow back too
    assert json.loads((rank.path / SUMMARY_JSON).read_text())["overflowed"] == names


def test_training_is_unchanged(tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    plain = model(x).sum().item()
    with PrecisionDebugger({"task": "overflow_check", "dump_path": str(tmp_path)}) as debugger:
        with debugger.step_scope(model):
            checked = model(x).sum().item()
    assert checked == plain


@pytest.mark.parametrize("config,message", [
    ({"level": "mix"}, "level: 'mix' is not supported by task overflow_check; use one of L0, L1"),
    ({"overflow_check": {"overflow_nums": 0}}, "overflow_check.overflow_nums: expected a positive integer or -1"),
    ({"overflow_check": {"check_mode": "aicore"}}, "overflow_check.check_mode: 'aicore' checks kernels"),
    ({"overflow_check": {"overflow_num": 1}}, "overflow_check.overflow_num: unknown key (did you mean 'overflow_nums'?)"),
])
def test_bad_overflow_config(tmp_path, config, message):
    with pytest.raises(ConfigError, match=None) as err:
        PrecisionDebugger({"task": "overflow_check", "dump_path": str(tmp_path), **config})
    assert message in str(err.value)


def test_an_infinite_fill_value_is_not_an_overflow_but_a_nan_is(tmp_path):
    scores = torch.randn(4, 4)
    mask = torch.ones(4, 4).triu(1).bool()

    def step(poison: bool):
        masked = scores.masked_fill(mask, float("-inf"))  # a causal mask: -inf on purpose
        probs = torch.softmax(masked, dim=-1)
        return torch.sqrt(probs - 1.0) if poison else probs  # sqrt of negatives: nan

    with PrecisionDebugger({"task": "overflow_check", "dump_path": str(tmp_path), "strict": True,
                            "overflow_check": {"overflow_nums": -1}}) as debugger:
        for poison in (False, True):
            with debugger.step_scope():
                step(poison)
    dump = load_dump(tmp_path)
    assert sorted(dump) == [(1, None)]
    assert list(dump[(1, None)].data) == ["Torch.sqrt.0.forward"]


def test_level_l0_dumps_the_overflowing_module(tmp_path):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), torch.randn(3, 4)
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
    with PrecisionDebugger({"task": "overflow_check", "dump_path": str(tmp_path), "level": "L0", "strict": True,
                            "overflow_check": {"overflow_nums": 1}}) as debugger:
        with debugger.step_scope(model):
            model(x).sum().backward()
    data = load_dump(tmp_path)[(0, None)].data
    assert list(data) == ["Module.2.Linear.forward.0"]
    assert "weight" in data["Module.2.Linear.forward.0"]["parameters"]
