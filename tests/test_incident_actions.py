"""Actions per rule: skip leaves weights and optimizer state unchanged, stop flushes and raises."""
import json
import re

import pytest
import torch

from examples.tiny_gpt import inject, synthetic_batches
from incident_helpers import config, gpt_and_adam, read_incident
from msprobe_engine import Monitor
from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.config import ConfigError
from msprobe_engine.incident import StepDecision, TrainingStopped
from msprobe_integrations.torch import TorchMonitor

def snapshot(model, opt):
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def assert_same(a, b):
    params_a, state_a = a
    params_b, state_b = b
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
    assert all(torch.equal(state_a[n][k], state_b[n][k]) for n in state_a for k in state_a[n])


def train(model, opt, monitor, steps, on_step):
    """A plain loop (no run_step); `on_step(step, phase)` runs before and after optimizer.step()."""
    for step, (tokens, targets) in enumerate(synthetic_batches(model.cfg, steps)):
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        on_step(step, "before")
        opt.step()
        on_step(step, "after")
        monitor.step_end(loss)


def test_skip_leaves_weights_and_optimizer_state_unchanged(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 3, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path))
    class_step = type(opt).step
    seen = {}

    def on_step(step, phase):
        seen[(step, phase)] = snapshot(model, opt)
        if step == 3 and phase == "after":
            assert all(p.grad is not None for p in model.parameters())  # the gradients are back
    train(model, opt, monitor, 6, on_step)
    monitor.close()
    assert_same(seen[(3, "before")], seen[(3, "after")])
    assert all(int(s["step"]) == 3 for s in seen[(3, "after")][1].values())  # Adam's step count too
    for step in (2, 4, 5):  # the other steps train
        assert not torch.equal(seen[(step, "before")][0]["head.weight"], seen[(step, "after")][0]["head.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert type(opt).step is class_step and "step" not in vars(opt)  # nothing was patched
    events = [(e.phase, e.step) for e in monitor.alert_log]
    assert events[0] == ("start", 3) and ("end", 4) in events
    assert read_incident(tmp_path / "incidents" / "step3-rank0-non_finite")["action"] == "skip"


def test_stop_flushes_every_writer_then_raises(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.0.ln2", lambda: monitor.step, 2, "inf")
    monitor = TorchMonitor(model, opt, config(tmp_path, sinks=["jsonl"],
                                              alerts=[{"rule": "non_finite", "action": "stop"}]))
    seen = {}
    with pytest.raises(TrainingStopped) as stopped:
        train(model, opt, monitor, 6, lambda step, phase: seen.__setitem__((step, phase), snapshot(model, opt)))
    error = stopped.value
    assert (error.step, error.rules) == (2, ["non_finite"]) and isinstance(error, RuntimeError)
    assert error.incidents == [tmp_path / "incidents" / "step2-rank0-non_finite"]
    assert read_incident(error.incidents[0])["culprit"]["call"] == "layers.0.ln2"  # on disk already
    lines = (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert (2, "after") not in seen
    assert_same(seen[(2, "before")], snapshot(model, opt))
    monitor.close()


def test_the_decision_is_framework_neutral():
    """Any integration: `before_optimizer_step()` says whether to skip; iterating it lists the rules."""
    monitor = Monitor({"strict": True, "sinks": [], "incidents": {"enabled": False},
                       "alerts": [{"rule": "non_finite", "targets": ["loss"], "action": "skip"}]},
                      backend=torch_backend)
    monitor.report_loss(torch.tensor(1.0))
    calm = monitor.before_optimizer_step()
    assert not calm and not calm.skip and not calm.stop
    monitor.after_optimizer_step()
    monitor.step_end()
    monitor.report_loss(torch.tensor(float("nan")))
    decision = monitor.before_optimizer_step()
    assert isinstance(decision, StepDecision) and decision.skip and not decision.stop
    assert [f.rule for f in decision] == ["non_finite"]
    monitor.close()


@pytest.mark.parametrize("incidents,message", [
    ({"replay": {"level": "L1"}}, "incidents.replay.level: 'L1' is not one of L0, mix"),
    ({"max_incidents": -1}, "incidents.max_incidents: -1 is below the minimum 0"),
    ({"max_incident": 3}, "incidents.max_incident: unknown key (did you mean 'max_incidents'?)"),
    ({"enabled": "yes"}, "incidents.enabled: expected bool, got 'yes' (str)"),
])
def test_bad_incident_config_is_named(incidents, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Monitor({"incidents": incidents})
