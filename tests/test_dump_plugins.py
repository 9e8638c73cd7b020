"""A dump task from outside the package (tests/plugins/big_values_task.py): registered with its
own Config and a PyTorch recorder, chosen by the config alone (``plugins:``)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine.config import ConfigError
from msprobe_engine.dump import PrecisionDebugger, load_dump, load_dump_config


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 1000.0  # relu's output is small, the product's is big


def _config(tmp_path, **section) -> dict:
    return {"plugins": ["tests.plugins.big_values_task"], "task": "big_values", "dump_path": str(tmp_path),
            "level": "L1", "strict": True, "big_values": section}


def test_a_task_from_a_plugin_dumps_from_the_config_alone(tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.rand(2, 3) + 1.0
    file = tmp_path / "config.json"
    file.write_text(json.dumps(_config(tmp_path / "dump", threshold=10.0)))
    with PrecisionDebugger(str(file)) as debugger:
        with debugger.step_scope(model):
            out = model(x)
    rank = load_dump(tmp_path / "dump")[(0, None)]
    assert rank.task == "big_values"
    # a statistics dump records linear, relu and the product; only the product exceeds 10
    assert list(rank.data) == ["Tensor.__mul__.0.forward"]
    assert rank.data["Tensor.__mul__.0.forward"]["output"][0]["Max"] == pytest.approx(out.max().item())


def test_its_keys_are_validated_like_the_builtin_tasks(tmp_path):
    assert load_dump_config(_config(tmp_path, threshold=5)).options.threshold == 5.0
    with pytest.raises(ConfigError) as err:
        load_dump_config(_config(tmp_path, treshold=5))
    assert "big_values.treshold: unknown key (did you mean 'threshold'?)" in str(err.value)
    with pytest.raises(ConfigError, match="big_values.threshold: -1.0 is below the minimum 0.0"):
        load_dump_config(_config(tmp_path, threshold=-1))
    with pytest.raises(ConfigError, match="level: 'L2' is a predecessor option"):
        load_dump_config({**_config(tmp_path), "level": "L2"})


def test_a_task_no_framework_records_is_refused_before_training(tmp_path):
    config = {**_config(tmp_path), "plugins": ["tests.plugins.big_values_task"]}
    from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger

    with pytest.raises(ConfigError, match="task: 'big_values' is not supported on MindSpore yet"):
        MindSporePrecisionDebugger(config)
