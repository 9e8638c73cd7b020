"""Which debugger tasks the MindSpore session implements: overflow_check, free_benchmark and grad_probe
are made (tests/test_mindspore_tasks.py runs them); diff_check and summary_mode xor are refused
when the session is made, with the tasks it does support named."""
from __future__ import annotations

import pytest

from msprobe_engine.errors import ConfigError
from msprobe_engine.frameworks.mindspore.capture.session import MINDSPORE_TASKS, MindSporePrecisionDebugger


@pytest.mark.parametrize("config,message", [
    ({"task": "diff_check", "diff_check": {"bench_path": "."}}, "task: 'diff_check' is not supported on MindSpore yet"),
    ({"level": "L0", "summary_mode": "xor"}, "summary_mode: 'xor' is not supported on MindSpore yet"),
])
def test_mindspore_refuses_what_it_does_not_implement(tmp_path, config, message):
    with pytest.raises(ConfigError) as err:
        MindSporePrecisionDebugger({"dump_path": str(tmp_path), **config})
    assert message in str(err.value)
    if "task" in config:
        assert "MindSpore supports statistics, tensor, overflow_check, free_benchmark, grad_probe" in str(err.value)


@pytest.mark.parametrize("config", [{"task": "overflow_check", "level": "L0"}, {"task": "overflow_check", "level": "L1"},
                                    {"task": "free_benchmark", "level": "L1"}, {"task": "grad_probe"}])
def test_mindspore_makes_the_tasks_it_implements(tmp_path, config):
    debugger = MindSporePrecisionDebugger({"dump_path": str(tmp_path), **config})
    assert debugger.config.task in MINDSPORE_TASKS and debugger.task_results == []
