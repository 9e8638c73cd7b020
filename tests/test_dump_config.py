"""The dump config: the predecessor's keys, and clear errors before training."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine.config import ConfigError
from msprobe_engine.dump import PrecisionDebugger, load_dump_config


def test_predecessor_config_file(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({
        "task": "tensor", "dump_path": "./dump", "rank": [], "step": [0, 2, "4-6"], "level": "mix",
        "enable_dataloader": False,
        "tensor": {"scope": ["Module.a.Linear.forward.0", "Module.b.Linear.backward.0"],
                   "list": ["relu", "Tensor.add.1.forward"], "data_mode": ["forward", "input"]},
        "run_ut": {"white_list": []},
    }))
    cfg = load_dump_config(file)
    assert (cfg.task, cfg.level, cfg.ranks, cfg.steps) == ("tensor", "mix", None, frozenset({0, 2, 4, 5, 6}))
    assert cfg.scope == ("Module.a.Linear.forward.0", "Module.b.Linear.backward.0")
    assert cfg.api_list == ("relu", "Tensor.add.1.forward") and cfg.data_mode == {"forward", "input"}
    assert (cfg.summary_mode, cfg.when_full, cfg.stack) == ("statistics", "wait", True)  # stack.json by default
    assert (cfg.risk_level, cfg.predecessor_format) == ("FOCUS", "26.2")
    assert PrecisionDebugger(config_path=file, step=[1]).config.steps == {1}  # the predecessor's keyword
    flat = load_dump_config({"dump_path": "d"}, level="L0", step=["3"], summary_mode="md5")
    assert (flat.task, flat.level, flat.steps, flat.summary_mode) == ("statistics", "L0", {3}, "md5")


@pytest.mark.parametrize("config,message", [
    ({"task": "run_ut"}, "task: 'run_ut' is a predecessor option this dump does not implement; "
                         "use one of statistics, tensor, overflow_check"),
    ({"task": "stats"}, "task: 'stats' is not one of statistics, tensor, overflow_check"),
    ({"level": "L2"}, "level: 'L2' is a predecessor option this dump does not implement"),
    ({"level": "l1"}, "level: 'l1' is not one of L0, L1, mix"),
    ({"step": ["6-4"]}, "step[0]: range '6-4' is inverted (start 6 > end 4); write \"4-6\""),
    ({"rank": [-1]}, "rank[0]: -1 is negative"),
    ({"step": "0-3"}, "step: expected a list"),
    ({"step": [1.5]}, "step[0]: 1.5 is neither a non-negative integer nor a range"),
    ({"scope": ["Module.b.Linear.forward.0"]}, "scope: expected two full names"),
    ({"scope": ["relu", "gelu"], "level": "L1"}, "scope[0]: 'relu' is not a full name"),
    ({"scope": ["Tensor.add.3.forward", "Tensor.add.1.forward"], "level": "L1"},
     "scope: inverted: call 3 of Tensor.add.forward comes after call 1"),
    ({"scope": ["Module.a.A.backward.0", "Module.b.B.forward.0"], "level": "L0"},
     "scope: inverted: 'Module.a.A.backward.0' (backward) runs after 'Module.b.B.forward.0' (forward)"),
    ({"scope": ["Tensor.add.0.forward", "Tensor.add.1.forward"], "level": "L0"},
     "scope[0]: 'Tensor.add.0.forward' is an API name but level is L0"),
    ({"data_mode": ["all", "forward"]}, "data_mode: 'all' must be given alone"),
    ({"data_mode": ["fwd"]}, "data_mode[0]: 'fwd' is not one of all, forward, backward, input, output"),
    ({"summary_mode": "sha"}, "summary_mode: 'sha' is not one of statistics, md5"),
    ({"levle": "L0"}, "levle: unknown key (did you mean 'level'?)"),
    ({"statistics": {"scopes": []}}, "statistics.scopes: unknown key (did you mean 'scope'?)"),
    ({"list": [], "statistics": {"list": []}}, "list: given both at the top level and in 'statistics'"),
    ({"enable_dataloader": True}, "enable_dataloader: only false is supported"),
    ({"when_full": "block"}, "when_full: 'block' is not one of wait, drop"),
    ({"queue_size": 0}, "queue_size: expected a positive integer, got 0"),
])
def test_bad_config_is_a_clear_error(config, message):
    with pytest.raises(ConfigError) as err:
        load_dump_config({"dump_path": "d", **config})
    assert message in str(err.value)


def test_missing_dump_path_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="dump_path: required key is missing"):
        load_dump_config({"task": "statistics"})
    file = tmp_path / "c.json"
    file.write_text("{")
    with pytest.raises(ConfigError, match=f"{file}: cannot parse"):
        load_dump_config(file)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("config,message", [
    ({"rank": [1]}, "rank: 1 does not exist: this run has 1 process (ranks 0-0)"),
    ({"level": "L0", "scope": ["Module.fc.Linear.forward.0", "Module.fc2.Linear.forward.0"]},
     "scope[1]: 'Module.fc2.Linear.forward.0': the model has no module Module.fc2.Linear; "
     "modules of that class: Module.fc.Linear"),
    ({"level": "L1", "list": ["Functional.relux.0.forward"]},
     "list[0]: 'Functional.relux.0.forward': Functional.relux is not an API this dump records"),
    ({"level": "L1", "list": ["Module.fc.Linear.forward.0"]}, "names a module but level is L1"),
])
def test_errors_against_the_run_come_at_start_before_any_step(tmp_path, config, message):
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), **config})
    with pytest.raises(ConfigError) as err:
        debugger.start(Net())
    assert message in str(err.value)
    debugger.close()
    assert not any(tmp_path.iterdir())


def test_module_levels_need_the_model(tmp_path):
    with pytest.raises(ConfigError, match=r"level L0 dumps modules: pass the model, start\(model\)"):
        PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0"}).start()
