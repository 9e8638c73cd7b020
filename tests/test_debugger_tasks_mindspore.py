"""The debugger tasks are PyTorch-only so far: the MindSpore session refuses them when it is made."""
from __future__ import annotations

import pytest

from msprobe_engine.config.errors import ConfigError
from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger


@pytest.mark.parametrize("config,message", [
    ({"task": "overflow_check", "level": "L0"}, "task: 'overflow_check' is not supported on MindSpore yet"),
    ({"task": "grad_probe"}, "task: 'grad_probe' is not supported on MindSpore yet"),
    ({"task": "free_benchmark"}, "task: 'free_benchmark' is not supported on MindSpore yet"),
    ({"level": "L0", "summary_mode": "xor"}, "summary_mode: 'xor' is not supported on MindSpore yet"),
])
def test_mindspore_refuses_what_it_does_not_implement(tmp_path, config, message):
    with pytest.raises(ConfigError) as err:
        MindSporePrecisionDebugger({"dump_path": str(tmp_path), **config})
    assert message in str(err.value)
