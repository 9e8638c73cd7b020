"""The architecture's promises: layers (import-linter), extension points used from outside the
package through a config file, state that survives a restart, and no crash without a backend."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import tests.plugins.lines_sink  # noqa: F401  (registers the user's components, as a user's module would)
import tests.plugins.loss_above_rule  # noqa: F401
import tests.plugins.rms_statistic  # noqa: F401
from msprobe_engine import ConfigError, Monitor, load_config
from msprobe_engine.dump import load_dump
from msprobe_engine.registry import framework_entry
from msprobe_integrations.torch import TorchMonitor

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    """pyproject's contracts: the core imports no framework, layers only point down, nothing below
    the contract imports it, frameworks are independent of each other."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken" in result.stdout


def test_core_imports_without_any_framework():
    """Importing the engine core (config, rules, sinks, analysis, dump reading) loads no framework."""
    code = ("import sys, msprobe_engine, msprobe_engine.analysis, msprobe_engine.dump, msprobe_engine.cli; "
            "msprobe_engine.load_config({'sinks': ['csv']}); "
            "print(sorted(m for m in ('torch', 'mindspore', 'deepspeed', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


CONFIG = """
plugins: [tests.plugins.rms_statistic, tests.plugins.loss_above_rule, tests.plugins.lines_sink]
output_dir: {out}
strict: true
stats: [norm, rms]
sinks: [{{name: lines, prefix: user}}, jsonl]
alerts:
  - {{rule: loss_above, limit: 2.0, action: continue}}
"""


def _train(monitor, model, opt, losses):
    for target in losses:
        out = model(torch.ones(2, 3)).mean()
        loss = (out - out.detach()) + target  # the loss value is `target`, gradients flow
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step_end(loss.detach())


def test_a_statistic_a_rule_and_a_sink_from_outside_the_package(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text(CONFIG.format(out=tmp_path / "run"))
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TorchMonitor(model, opt, config=str(path))
    _train(monitor, model, opt, [1.0, 3.0, 1.0])
    monitor.close()
    last = monitor.history[-1].metrics
    assert last["actv/0/output/rms"] == pytest.approx(last["actv/0/output/norm"] / (2 * 4) ** 0.5)
    assert last["grad/0.weight/rms"] == pytest.approx(last["grad/0.weight/norm"] / 12 ** 0.5)
    assert [(e.rule, e.phase, e.step) for e in monitor.alert_log] == [("loss_above", "start", 1),
                                                                       ("loss_above", "end", 2)]
    lines = (tmp_path / "run" / "rank0" / "user.txt").read_text().splitlines()
    assert "1 train/loss 3.0" in lines and any(line.startswith("2 actv/1/output/rms ") for line in lines)


@pytest.mark.parametrize("entry, message", [
    ({"rule": "loss_above", "factor": 3}, "alerts[0].factor: unknown key"),
    ({"rule": "non_finite", "factor": 50}, "alerts[0].factor: unknown key"),
    ({"rule": "loss_abov"}, "alerts[0].rule: 'loss_abov' is not a registered rule (did you mean 'loss_above'?)"),
])
def test_a_key_a_rule_does_not_have_is_named(entry, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"alerts": [entry]})


def test_a_plugin_that_cannot_be_imported_is_named():
    with pytest.raises(ConfigError, match=r"plugins\[1\]: cannot import 'no_such_module_here'"):
        load_config({"plugins": ["tests.plugins.rms_statistic", "no_such_module_here"]})


def test_sinks_take_their_own_settings_and_unknown_ones_are_named():
    config = load_config({"sinks": ["tensorboard", {"name": "lines", "prefix": "x", "tags": ["train/*"]}]})
    assert [s.name for s in config.sinks] == ["tensorboard", "lines"] and config.sinks[1].prefix == "x"
    with pytest.raises(ConfigError, match=r"sinks\[0\].prefix: unknown key"):
        load_config({"sinks": [{"name": "jsonl", "prefix": "x"}]})
    with pytest.raises(ConfigError, match=r"sinks\[0\].name: 'wandbb' is not a registered sink"):
        load_config({"sinks": ["wandbb"]})


def _spike_run(out: Path, losses: list[float], state: dict | None = None) -> Monitor:
    config = {"output_dir": str(out), "strict": True, "sinks": ["jsonl"], "resume": state is not None,
              "alerts": [{"rule": "spike", "metrics": ["train/loss"], "warmup": 2, "factor": 3.0}]}
    monitor = Monitor(config)
    if state is not None:
        monitor.load_state_dict(state)
    for loss in losses:
        monitor.step_end(loss)
    return monitor


def test_a_resumed_run_behaves_as_if_it_had_not_stopped(tmp_path):
    losses = [1.0, 1.1, 0.9, 1.0, 9.0, 9.5, 1.0, 1.0, 12.0, 1.0]
    whole = _spike_run(tmp_path / "whole", losses)
    whole.close()
    first = _spike_run(tmp_path / "resumed", losses[:5])  # stops inside the spike's episode
    state = torch.load(_saved(first.state_dict(), tmp_path), weights_only=True)
    first.close()
    second = _spike_run(tmp_path / "resumed", losses[5:], state)
    second.close()

    def events(monitors):
        return [(e.rule, e.phase, e.step, e.value) for m in monitors for e in m.alert_log]

    assert events([first, second]) == events([whole])
    assert [e.phase for e in second.alert_log] == ["end", "start", "end"]  # the open episode went on
    dirs = sorted(p.name for p in (tmp_path / "resumed" / "incidents").iterdir())
    assert dirs == sorted(p.name for p in (tmp_path / "whole" / "incidents").iterdir()) == \
        ["step4-rank0-spike", "step8-rank0-spike"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "rank0" / "metrics.jsonl").open()]
    assert steps == list(range(len(losses)))


def _saved(state: dict, tmp_path: Path) -> Path:
    path = tmp_path / "monitor_state.pt"
    torch.save(state, path)
    return path


def test_the_incident_limit_counts_incidents_of_earlier_runs(tmp_path):
    config = {"output_dir": str(tmp_path), "sinks": [], "incidents": {"max_incidents": 1},
              "alerts": [{"rule": "non_finite"}]}
    first = Monitor(config)
    for loss in (1.0, float("nan"), 1.0):
        first.step_end(loss)
    state = first.state_dict()
    first.close()
    second = Monitor(config)
    second.load_state_dict(state)
    second.step_end(float("nan"))
    second.close()
    assert len(first.incidents.incidents) == 1 and second.incidents.incidents == []
    assert second.incidents.over_limit == 1 and second.step == 4


def test_a_state_from_another_config_is_refused():
    state = Monitor({"sinks": [], "alerts": [{"rule": "spike"}]}).state_dict()
    with pytest.raises(ConfigError, match=r"saved with the rules \['spike'\], but the config has \['non_finite'\]"):
        Monitor({"sinks": [], "alerts": [{"rule": "non_finite"}]}).load_state_dict(state)
    with pytest.raises(ConfigError, match="version 99 is not supported"):
        Monitor({"sinks": []}).load_state_dict({**state, "version": 99})


def test_a_monitor_without_a_framework_measures_numbers(tmp_path):
    """Monitor(config) used without attach: a float loss is measured on the host, never a crash."""
    monitor = Monitor({"output_dir": str(tmp_path), "sinks": ["jsonl"]})
    records = [monitor.step_end(loss) for loss in (0.5, float("nan"))]
    monitor.close()
    assert records[0].metrics["train/loss"] == 0.5
    assert [(e.rule, e.phase) for e in monitor.alert_log] == [("non_finite", "start")]


def test_a_framework_from_outside_the_package(tmp_path):
    """A framework registered by a user's module (`tests/plugins/toy_framework/`, named in
    `plugins:`): `Monitor.attach` picks it from the model's classes, measures with its backend,
    skips its optimizer step on a nan, and its incidents' dump says its own dump format."""
    config = {"plugins": ["tests.plugins.toy_framework"], "output_dir": str(tmp_path), "strict": True,
              "stats": ["norm", "max", "nan_count"], "sinks": ["jsonl"], "watch": {"params": True},
              "alerts": [{"rule": "non_finite", "action": "skip"}]}
    monitor = Monitor(config)  # imports the plugin: the framework is registered from here on
    from tests.plugins.toy_framework import backend as toy_backend
    from tests.plugins.toy_framework.model import SGD, Model, Tensor

    model = Model()
    opt = SGD(model)
    monitor.attach(model, opt)
    assert monitor.backend is toy_backend and framework_entry("toy").dump_format == "mindspore"
    weights = []
    for step in range(3):
        x = np.ones((2, 3), np.float32) * (float("nan") if step == 1 else 1.0)
        y = model(Tensor(x))
        grads = model.backward(y)
        weights.append({n: w.data.copy() for n, w in model.weights.items()})
        opt.step(grads)
        monitor.step_end(float(np.mean(y.data ** 2)))
        if step == 0:
            first = (float(np.linalg.norm(y.data)), float(np.linalg.norm(grads["fc0"].data)))
    monitor.close()
    metrics = monitor.history[0].metrics  # (a skip rule decides early: records come with the next transfer)
    assert (metrics["actv/fc1/output/norm"], metrics["grad/fc0.weight/norm"]) == pytest.approx(first)
    after_skip = {n: w.data for n, w in model.weights.items()}
    assert all(np.array_equal(weights[1][n], weights[2][n]) for n in after_skip)  # step 1 was skipped
    assert [(e.rule, e.phase, e.step) for e in monitor.alert_log][:1] == [("non_finite", "start", 1)]
    dump = load_dump(tmp_path / "incidents" / "step1-rank0-non_finite" / "dump")
    assert [d.framework for d in dump.values()] == ["mindspore"]
    assert not model.forward_hooks and not opt.pre_hooks  # close removed the hooks
