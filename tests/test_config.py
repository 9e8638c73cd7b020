"""Config loading from dict/JSON/YAML, validation errors that name the key, predecessor keys."""
import json
from pathlib import Path

import pytest

from msprobe_engine.config import ConfigError, MonitorConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("*.json")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), MonitorConfig)


def test_dict_json_and_yaml_give_the_same_config(tmp_path):
    data = {"output_dir": "out", "stats": ["min", "norm"], "schedule": {"start_step": 3, "interval": 2}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text("output_dir: out\nstats: [min, norm]\nschedule: {start_step: 3, interval: 2}\n")
    configs = [load_config(data), load_config(tmp_path / "c.json"), load_config(str(tmp_path / "c.yaml"))]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].schedule.is_monitored(5) and not configs[0].schedule.is_monitored(4)


def test_defaults_without_a_config():
    config = load_config(None)
    assert config.watch.param_grads and config.watch.module_outputs and not config.watch.module_inputs
    assert [r.rule for r in config.alerts] == ["non_finite", "spike"]


@pytest.mark.parametrize("data, message", [
    ({"stats": ["min", "max", "nrom"]},
     "stats[2]: 'nrom' is not one of min, max, mean, norm, nan_count, inf_count, zero_frac, numel"),
    ({"schedul": {}}, "schedul: unknown key (did you mean 'schedule'?)"),
    ({"schedule": {"interval": 0}}, "schedule.interval: 0 is below the minimum 1"),
    ({"watch": {"params": "yes"}}, "watch.params: expected bool, got 'yes' (str)"),
    ({"alerts": [{"rule": "spike", "factor": "x"}]}, "alerts[0].factor: expected float, got 'x' (str)"),
    ({"alerts": [{"factor": 2.0}]}, "alerts[0].rule: required key is missing"),
    ({"alerts": [{"rule": "spike", "action": "explode"}]},
     "alerts[0].action: 'explode' is not one of continue, skip, stop"),
    ({"sinks": "tensorboard"}, "sinks: expected a list, got 'tensorboard' (str)"),
    ({"writer": {"when_full": "block"}}, "writer.when_full: 'block' is not one of drop, wait"),
    ({"watch": {"optimizer_state": ["exp_avg", "momentum"]}},
     "watch.optimizer_state[1]: 'momentum' is not one of exp_avg, exp_avg_sq, update, ratio"),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(data, message):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert message in str(err.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: cannot parse"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("watch:\n  param_grad: true\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: watch.param_grad: unknown key \(did you mean 'param_grads'\?\)"):
        load_config(typo)


def test_predecessor_monitor_keys_map_onto_ours():
    config = load_config(CONFIGS / "predecessor_monitor.json")
    assert config.modules.names == ["layers.0", "layers.1"]
    assert config.watch.module_outputs and config.watch.activation_grads and config.watch.param_grads
    assert config.watch.optimizer_state == ["exp_avg", "exp_avg_sq"] and not config.watch.params
    assert config.stats == ["min", "max", "norm", "nan_count"] and [s.name for s in config.sinks] == ["tensorboard"]
    spike = [r for r in config.alerts if r.rule == "spike"]
    assert len(spike) == 1 and spike[0].factor == 1.5


def test_predecessor_schedule_keys_and_conflicts():
    config = load_config({"start_step": 10, "step_interval": 5, "collect_times": 3})
    assert (config.schedule.start_step, config.schedule.interval, config.schedule.end_step) == (10, 5, 25)
    with pytest.raises(ConfigError, match="wg_distribution: the predecessor key and 'watch.param_grads' are both set"):
        load_config({"wg_distribution": True, "watch": {"param_grads": False}})
    with pytest.raises(ConfigError, match="ops\\[1\\]: 'p99' is not one of"):  # 'id': accepted, not measured
        load_config({"ops": ["min", "p99"]})


def test_check_config_verb(tmp_path, capsys):
    from msprobe_engine.cli import main

    assert main(["check-config", str(CONFIGS / "full.yaml")]) == 0
    assert "full.yaml: ok" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("stats: [nrom]\n")
    assert main(["check-config", str(bad)]) == 1
    assert "bad.yaml: stats[0]: 'nrom' is not one of" in capsys.readouterr().err


def test_the_shipped_configs_are_in_the_package_and_chosen_by_name(tmp_path, monkeypatch):
    from msprobe_engine.config import shipped

    table = shipped.names()
    for name in ("full", "minimal", "grads_optimizer", "deepspeed", "megatron", "mindspore",
                 "mindspore/graph_mode", "predecessor_monitor"):
        assert table[name].is_relative_to(shipped.FOLDER), name
    assert not any(name.startswith("deepspeed/zero") for name in table)  # DeepSpeed's own configs: files only
    monkeypatch.chdir(tmp_path)  # outside the repository
    assert load_config("full") == load_config(CONFIGS / "full.yaml")
    assert load_config("configs/deepspeed/monitor.yaml") == load_config(CONFIGS / "deepspeed" / "monitor.yaml")
    (tmp_path / "full").write_text("output_dir: mine\n")  # a file of that name wins
    assert load_config("full").output_dir == "mine"
    with pytest.raises(ConfigError, match=r"minimall: config file not found, and not a shipped config's name "
                                          r"\(did you mean 'minimal'\?\); the shipped configs: .*grads_optimizer"):
        load_config("minimall")
