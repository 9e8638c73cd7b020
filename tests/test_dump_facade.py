"""`msprobe_engine.dump.PrecisionDebugger` serves both frameworks: by `framework`, the config's
``framework`` key, or the model."""
from __future__ import annotations

import json

import pytest
import torch

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import PrecisionDebugger, load_dump
from msprobe_engine.frameworks.torch.capture.session import PrecisionDebugger as TorchDebugger

ms = pytest.importorskip("mindspore")
from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger  # noqa: E402


def test_a_torch_model_or_no_hint_gets_the_pytorch_session(tmp_path):
    model = torch.nn.Linear(2, 2)
    for debugger in (PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0"}, model=model),
                     PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0"})):
        assert type(debugger) is TorchDebugger
        debugger.start(model)
        model(torch.ones(1, 2)).sum().backward()
        debugger.stop()
        debugger.step()
        debugger.close()
    assert sorted(load_dump(tmp_path)) == [(0, None)]


def test_the_config_framework_or_a_cell_gets_the_mindspore_session(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"dump_path": str(tmp_path / "d"), "level": "L1", "framework": "mindspore"}))
    sessions = [PrecisionDebugger(str(config)), PrecisionDebugger(config_path=str(config)),
                PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0"}, model=ms.nn.Dense(2, 2)),
                PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1"}, framework="mindspore")]
    assert all(type(s) is MindSporePrecisionDebugger for s in sessions)
    for session in sessions:
        session.close()


def test_an_unknown_framework_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="framework: 'jax'"):
        PrecisionDebugger({"dump_path": str(tmp_path), "framework": "jax"})
