"""The seams of the monitor's parts: the `Reducer` base and how the monitor calls it, the hook
error policy, the step closers."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from msprobe_engine import Monitor
from msprobe_engine.hook_errors import HookErrors
from msprobe_engine.reducer import Reducer


class Doubling(Reducer):
    """A reducer that doubles every sum (a stand-in for a collective); only `merge` is written."""

    def __init__(self) -> None:
        self.merged = 0

    def merge(self, keys, rows):
        self.merged += 1
        rows = np.array(rows, dtype=np.float64)
        rows[:, 2:4] *= 2  # sum and sum of squares (columns: min, max, sum, sumsq, nan, inf, zero, numel)
        return rows


class Agreeing(Doubling):
    def __init__(self) -> None:
        super().__init__()
        self.agreed = 0

    def agree(self, decision):
        self.agreed += 1
        return decision


def test_the_reducer_base_supplies_agree_and_replays_together():
    reducer = Doubling()
    decision = object()
    assert reducer.agree(decision) is decision and reducer.replays_together is False
    with pytest.raises(NotImplementedError):
        Reducer().merge([], None)


@pytest.mark.parametrize("action", ["continue", "skip"])
def test_the_monitor_merges_once_per_transfer_and_agrees_when_a_rule_can_skip(tmp_path, action):
    reducer = Agreeing()
    monitor = Monitor({"output_dir": str(tmp_path), "sinks": [], "strict": True, "stats": ["mean", "norm"],
                       "alerts": [{"rule": "non_finite", "action": action}]}, reducer=reducer)
    for loss in (1.0, 2.0, 3.0):
        monitor.before_optimizer_step()
        monitor.after_optimizer_step()
        monitor.step_end(loss)
    monitor.close()
    assert [r.metrics["train/loss"] for r in monitor.history] == [2.0, 4.0, 6.0]  # the merged rows
    assert reducer.merged == monitor.transfers
    assert reducer.agreed == (3 if action == "skip" else 0)  # the decision, made the same on every rank


def test_the_hook_error_policy_counts_logs_once_and_disables(caplog):
    errors = HookErrors(False, step=lambda: 7)
    with caplog.at_level(logging.ERROR, logger="msprobe_engine"):
        for _ in range(3):
            with errors.guard("forward hook of x"):
                raise RuntimeError("boom")
    assert errors.counts == {"forward hook of x": 3} and errors.disabled == {"forward hook of x"}
    assert [r.getMessage() for r in caplog.records] == [
        "msprobe: error in forward hook of x (step 7): RuntimeError: boom; it is reported once and disabled"]
    strict = HookErrors(True)
    with pytest.raises(RuntimeError, match="boom"), strict.guard("x"):
        raise RuntimeError("boom")


def test_a_dump_recorder_uses_the_same_policy_with_its_own_message(caplog, tmp_path):
    """`DumpRecorder.skipped` is `HookErrors.swallowed`: counted per key, logged once with the
    caller's head and note; strict mode answers False (the caller re-raises)."""
    from msprobe_engine.dump.config import load_dump_config
    from msprobe_engine.dump.recorder import DumpRecorder, RecorderContext

    def recorder(strict: bool) -> DumpRecorder:
        config = load_dump_config({"dump_path": str(tmp_path), "strict": strict})
        return DumpRecorder(RecorderContext(config, 0, None, lambda tensors: None))

    lenient = recorder(False)
    with caplog.at_level(logging.ERROR, logger="msprobe_engine"):
        assert all(lenient.skipped("API", RuntimeError("boom"), "msprobe dump: error in API Tensor.add")
                   for _ in range(3))
        assert lenient.skipped("grad_probe", ValueError("bad"), "msprobe grad_probe: step 2 not probed",
                               " (reported once)")
    assert lenient.hook_errors == {"API": 3, "grad_probe": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "msprobe dump: error in API Tensor.add: RuntimeError: boom; it is reported once and skipped",
        "msprobe grad_probe: step 2 not probed: ValueError: bad (reported once)"]
    strict = recorder(True)
    assert not strict.skipped("API", RuntimeError("boom"), "x") and strict.hook_errors == {}


class Closer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def close_step(self, loss):
        self.calls.append(f"close {loss}")
        return None if loss is None else loss * 10

    def step_closed(self) -> None:
        self.calls.append("closed")


def test_step_closers_run_around_each_step_end_until_detached(tmp_path):
    monitor = Monitor({"output_dir": str(tmp_path), "sinks": [], "strict": True})
    closer = Closer()
    monitor.add_step_closer(closer)
    record = monitor.step_end(1.0)
    monitor.detach()
    monitor.step_end(2.0)
    monitor.close()
    assert record.metrics["train/loss"] == 10.0  # the loss the closer returned is the one reported
    assert closer.calls == ["close 1.0", "closed"]


@pytest.mark.parametrize("name", ["torch", "mindspore"])
def test_a_framework_object_says_what_its_registration_says(name):
    """One name per framework: the registry's key is the object's `name`, and the dump format
    its incidents write is the object's `dump_format` (torch: "pytorch", the predecessor's)."""
    from msprobe_engine.registry import framework_entry, load_framework

    framework, entry = load_framework(name), framework_entry(name)
    assert (framework.name, framework.dump_format) == (name, entry.dump_format)
    assert (framework.precheck() is not None) == entry.precheck
