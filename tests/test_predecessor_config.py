"""The predecessor's config keys (mindstudio-probe 26.2): its dump config.json and its monitor JSON load.

Every key is accepted and mapped, accepted where it changes nothing here, or rejected with a
message naming the key, saying it is not supported and what to use (docs/predecessor.md).
"""
from __future__ import annotations

import json
import logging

import pytest

from msprobe_engine.errors import ConfigError
from msprobe_engine.config.loader import load_config
from msprobe_engine.dump import load_dump_config

#: a monitor config using every key its monitor reads (msprobe/pytorch/monitor/module_hook.py)
MONITOR_ALL = {
    "targets": {}, "all_xy": True, "xy_distribution": True, "forward_only": False, "backward_only": False,
    "mv_distribution": True, "ur_distribution": True, "wg_distribution": True, "param_distribution": True,
    "mg_direction": True, "cc_distribution": {"enable": False}, "print_struct": False, "module_ranks": [],
    "ops": ["min", "max", "norm", "zeros", "nans", "id", "mean", "shape", "dtype"], "eps": 1e-8, "ndigits": 6,
    "format": "csv", "start_step": 2, "step_interval": 3, "collect_times": 4, "stack_info": False,
    "monitor_mbs_grad": False, "squash_name": False, "step_count_per_record": 1,
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
                        {"rule_name": "AnomalyNan", "args": {"threshold": None}}], "dump": False},
}


def test_its_full_monitor_config_loads_and_maps(tmp_path, caplog):
    file = tmp_path / "monitor_all.json"
    file.write_text(json.dumps(MONITOR_ALL))
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        cfg = load_config(file)
    assert cfg.stats == ["min", "max", "norm", "zero_frac", "nan_count", "mean"]
    assert [r.rule for r in cfg.alerts] == ["non_finite", "spike"] and cfg.alerts[1].factor == 1.5
    assert (cfg.schedule.start_step, cfg.schedule.interval, cfg.schedule.end_step) == (2, 3, 14)
    assert cfg.watch.params and cfg.watch.activation_grads and cfg.watch.optimizer_state == [
        "exp_avg", "exp_avg_sq", "update", "ratio"]
    assert [s.name for s in cfg.sinks] == ["csv"] and cfg.incidents.enabled is False  # alert.dump: false
    warned = caplog.text
    assert cfg.watch.health.mg_direction and not cfg.watch.health.micro_batch_grads  # measured now (model health)
    assert "mg_direction" not in warned
    assert "op 'id' is accepted but not a statistic here" in warned
    assert "cc_distribution" not in warned and "eps" not in warned  # at their defaults: silent


@pytest.mark.parametrize("change, message", [
    ({"module_ranks": [0, 1]}, "module_ranks: [0, 1] is not supported here; rank 0 writes, or every rank with "
                               "per_rank: true"),
    ({"ops": ["min", "p99"]}, "ops[1]: 'p99' is not one of min, max, mean, norm, nans, zeros, id, shape, dtype"),
    ({"alert": {"rules": [{"rule_name": "AnomalyJump"}]}},
     "alert.rules[0].rule_name: 'AnomalyJump' is not one of AnomalyTurbulence, AnomalyNan"),
])
def test_its_monitor_keys_that_cannot_be_honoured_are_named(change, message):
    with pytest.raises(ConfigError, match="^config: " + message.replace("[", r"\[").replace("]", r"\]")):
        load_config({**MONITOR_ALL, **change})


def test_its_dump_config_keys_load(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({
        "task": "statistics", "dump_path": str(tmp_path / "dump"), "rank": [], "step": [0], "level": "L1",
        "enable_dataloader": False, "async_dump": False, "precision": "high", "risk_level": "CORE",
        "extra_info": True, "dump_enable": None, "custom_op_namespaces": [], "framework": "pytorch",
        "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics",
                       "slice": [], "diff_nums": 1, "tensor_list": []},
    }))
    cfg = load_dump_config(file)
    assert (cfg.risk_level, cfg.level, cfg.steps, cfg.predecessor_format, cfg.stack) == (
        "CORE", "L1", {0}, "26.2", True)
    assert load_dump_config({"dump_path": "d", "predecessor_format": "1.x"}).predecessor_format == "1.x"


@pytest.mark.parametrize("change, message", [
    ({"risk_level": "HIGH"}, "risk_level: 'HIGH' is not one of CORE, FOCUS, ALL"),
    ({"precision": "max"}, "precision: 'max' is not supported here (accepted: \"low\", \"high\"); statistics "
                           "are accumulated in float64 here whatever the precision"),
    ({"dump_enable": True}, "dump_enable: True is not supported here (accepted: null); switch the dump with "
                            "start()/stop() and the step/rank lists"),
    ({"statistics": {"slice": [[0, 2]]}}, "statistics.slice: [[0, 2]] is not supported here (accepted: null, []); "
                                          "whole tensors are dumped; slice them after loading"),
    ({"predecessor_format": "2.0"}, "predecessor_format: '2.0' is not one of 26.2, 1.x"),
])
def test_its_dump_keys_that_cannot_be_honoured_are_named(change, message):
    with pytest.raises(ConfigError) as err:
        load_dump_config({"dump_path": "d", **change})
    assert str(err.value) == f"config: {message}"


def test_its_cc_distribution_turns_on_the_collective_counts(caplog):
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        cfg = load_config({**MONITOR_ALL, "cc_distribution": {"enable": True, "cc_log_only": True}})
    assert cfg.watch.health.collectives and cfg.watch.health.mg_direction
    assert "cc_distribution.cc_log_only=True is accepted but not applied here" in caplog.text
    assert not load_config(MONITOR_ALL).watch.health.collectives
    with pytest.raises(ConfigError, match=r"cc_distribution\.cc_hook: not one of enable, cc_codeline"):
        load_config({**MONITOR_ALL, "cc_distribution": {"cc_hook": True}})
