"""Held-out alert checks with the shipped config (configs/full.yaml) on a model written for
these tests (tests/health_models.py): spikes and nans injected at random layers and steps
are each exactly one alert episode, named after the layer they were injected in; a clean
training whose loss falls raises no alert in 300 steps; a run made to diverge (learning rate
raised mid-run) is caught by the trend rule before any value is non-finite."""
import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from health_models import INPUTS, Faults, Teacher, build, train
from msprobe_engine.monitor import Monitor
from msprobe_engine.rules.tags import innermost

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = 300
#: where faults may be injected: layers, an activation, and parents of other modules
PLACES = ["inp", "blocks.0.fc", "blocks.1.fc", "blocks.1.act", "blocks.2", "blocks.2.fc", "head"]


def shipped_config(out: Path, **changes) -> dict:
    config = yaml.safe_load((CONFIGS / "full.yaml").read_text())
    config.update(output_dir=str(out), **changes)
    return config


def run(out: Path, plan: dict[int, tuple[str, str]] | None = None, steps: int = STEPS):
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    faults = Faults(model, plan) if plan else None  # before the monitor: its hooks see the fault
    monitor = Monitor(shipped_config(out)).attach(model, optimizer)
    losses = train(model, monitor, steps, optimizer, faults)
    monitor.close()
    return monitor, losses


def fault_plan(seed: int) -> dict[int, tuple[str, str]]:
    """Five faults at random steps (at least 35 apart, after the spike rule's warm-up)."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(40, STEPS - 20, 35), 5))
    return {step + rng.randint(0, 5): (rng.choice(PLACES), rng.choice(["spike", "nan"])) for step in steps}


@pytest.mark.slow
def test_a_clean_training_raises_no_alert_in_300_steps(tmp_path):
    monitor, losses = run(tmp_path)
    assert sum(losses[-20:]) < 0.1 * sum(losses[:20])  # it learns: the loss falls normally
    assert list(monitor.alert_log) == []
    assert monitor.records_written == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_each_injected_fault_is_one_episode_named_after_its_layer(tmp_path, seed):
    plan = fault_plan(seed)
    monitor, _ = run(tmp_path, plan)
    starts = [e for e in monitor.alert_log if e.phase == "start"]
    assert [e.step for e in starts] == sorted(plan), (plan, [(e.rule, e.step, e.tag) for e in starts])
    for event in starts:
        place, kind = plan[event.step]
        stat = "norm" if kind == "spike" else "nan_count"
        assert (event.rule, event.tag) == ("spike" if kind == "spike" else "non_finite",
                                           f"actv/{place}/output/{stat}"), (event, plan)
    spikes = [e for e in starts if e.rule == "spike"]
    lines = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").open()]
    logged = [a for line in lines for a in line["alerts"] if a["phase"] == "start"]
    assert len(logged) == len(starts)
    for event in spikes:  # the other modules of the event are listed with it, not alerted apart
        assert event.also and f"actv/{plan[event.step][0]}/output/norm" not in event.also


def test_the_innermost_related_module_names_the_event():
    tags = ["actv/blocks.1/output/norm", "actv/blocks.1.fc/output/norm", "actv/blocks.1.fc.inner/output/norm",
            "actv/blocks.10.fc.x.y/output/norm", "grad/blocks.1.fc.inner.weight/norm"]
    assert innermost(tags) == 2  # blocks.10... is no child of blocks.1; grad rows are another statistic
    assert innermost(["actv/a:1/output/norm", "actv/a.b/output/norm"]) == 1  # a second call of `a`


def test_a_series_rising_from_zero_warms_up_before_it_can_spike():
    """Optimizer moments start at zero and grow for many steps: no spike while they do, but a
    x10 jump once they have settled is one."""
    from msprobe_engine.config import load_config
    from msprobe_engine.rules import build_rules

    rule, = build_rules(load_config({"alerts": [{"rule": "spike", "metrics": ["optim/*"]}]}).alerts)
    beta2 = 0.999
    moment = [0.0, 0.0] + [math.sqrt(1 - beta2 ** t) for t in range(1, 200)]  # norm of exp_avg_sq, roughly
    fired = [i for i, value in enumerate(moment) if rule.evaluate(None, {}, {"optim/w/exp_avg_sq/norm": value})]
    assert fired == []
    assert rule.evaluate(None, {}, {"optim/w/exp_avg_sq/norm": 10 * moment[-1]})


def _diverging_run(out: Path, trend: dict) -> tuple[Monitor, list[float]]:
    """Linear regression trained by SGD; at step 60 the learning rate goes past the stable
    limit: the weights then grow by a steady factor per step until they overflow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, 1))
    optimizer = torch.optim.SGD(model.parameters(), 0.05)
    config = shipped_config(out, sinks=[], incidents={"enabled": False})
    config["alerts"] = [a for a in config["alerts"] if a["rule"] != "trend"] + [{"rule": "trend", **trend}]
    monitor = Monitor(config).attach(model, optimizer)
    losses = train(model, monitor, 200, optimizer, lr_at={60: 1.3}, teacher=Teacher())
    monitor.close()
    return monitor, losses


@pytest.mark.parametrize("trend", [{}, {"method": "zscore", "z": 6.0, "steps": 3}], ids=["slope", "zscore"])
def test_the_trend_rule_warns_before_the_first_non_finite_value(tmp_path, trend):
    monitor, losses = _diverging_run(tmp_path, trend)
    first_bad = next(i for i, loss in enumerate(losses) if not math.isfinite(loss))  # it did diverge
    events = [e for e in monitor.alert_log if e.phase == "start"]
    trend_starts = [e.step for e in events if e.rule == "trend"]
    non_finite = [e.step for e in events if e.rule == "non_finite"]
    assert trend_starts and non_finite, events
    assert 60 < trend_starts[0] < first_bad <= non_finite[0]
    assert math.isfinite(next(e for e in events if e.rule == "trend").value)


def test_one_nan_under_run_step_is_one_non_finite_episode(tmp_path):
    """The nan shows in the activations before the optimizer step and, once the step applied
    it, in the parameters and the optimizer state: one event, one start and one end."""
    import torch

    from health_models import Faults, Teacher, build
    from msprobe_engine.monitor import Monitor

    model = build()
    optimizer = torch.optim.SGD(model.parameters(), 1e-2)
    faults = Faults(model, {5: ("blocks.1.fc", "nan")})
    monitor = Monitor({"output_dir": str(tmp_path), "sinks": [], "incidents": {"enabled": True},
                       "alerts": [{"rule": "non_finite"}], "watch": {"params": True}}).attach(model, optimizer)
    teacher = Teacher()

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # applied: the nan reaches the weights
        return loss

    for n in range(8):
        faults.step = n
        loss = monitor.run_step(step, *teacher.batch())
        monitor.step_end(loss)
    with torch.no_grad():  # a clean model again: the episode can end
        for p, fresh in zip(model.parameters(), build().parameters()):
            p.copy_(fresh)
    for n in range(8, 11):
        faults.step = n
        monitor.step_end(monitor.run_step(step, *teacher.batch()))
    monitor.close()
    events = [(e.rule, e.phase, e.step) for e in monitor.alert_log]
    assert [e for e in events if e[1] == "start"] == [("non_finite", "start", 5)], events
    assert len([e for e in events if e[1] == "end"]) == 1, events


def test_a_trend_blames_the_growing_rows_even_below_3x_their_average():
    """A steady growth (x1.15 a step) is never 3x its running average on one step: the rows
    the trend fired on are blamed, so its incident names a culprit."""
    from types import SimpleNamespace

    import numpy as np

    from msprobe_engine.rules.trend import TrendRule
    from msprobe_engine.stats.table import MetricKey

    rule = TrendRule(TrendRule.Config(rule="trend"))
    firing = []
    for step in range(25):
        firing = rule.evaluate(None, None, {"grad/fc.weight/norm": 1.15 ** step, "grad/fc.bias/norm": 1.0})
    assert firing and firing[0].tag == "grad/fc.weight/norm"
    table = SimpleNamespace(keys=[MetricKey("grad", "fc.bias", ""), MetricKey("grad", "fc.weight", "")])
    assert rule.blame(table, np.array([1.0, 1.2])).tolist() == [False, True]


def test_a_trend_incident_names_a_culprit(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, 1))
    optimizer = torch.optim.SGD(model.parameters(), 0.05)
    config = shipped_config(tmp_path, sinks=[], incidents={"enabled": True, "replay": {"enabled": False}})
    monitor = Monitor(config).attach(model, optimizer)
    train(model, monitor, 200, optimizer, lr_at={60: 1.3}, teacher=Teacher())
    monitor.close()
    trend = [i for i in monitor.incidents.incidents if i.report["rule"] == "trend"]
    assert trend and trend[0].report["culprit"] is not None, [i.report["culprit"] for i in trend]
    assert trend[0].report["culprit"]["first_bad"].startswith(("grad/", "actv/"))


def _spike_rule(**options):
    from msprobe_engine.config import load_config
    from msprobe_engine.rules import build_rules

    rule, = build_rules(load_config({"alerts": [{"rule": "spike", "metrics": ["grad/*/norm", "actv/*/norm"],
                                                 "warmup": 3, **options}]}).alerts)
    return rule


def _episodes(series: list[dict[str, float]], **options) -> list[tuple[str, str, int, float]]:
    """(phase, tag, step, value) of the alert events of the spike rule over `series`."""
    from msprobe_engine.rules import AlertTracker

    rule, tracker, events = _spike_rule(**options), AlertTracker(), []
    for step, metrics in enumerate(series):
        events += tracker.update(step, rule.evaluate(None, {}, metrics))
    return [(e.phase, e.tag, e.step, e.value) for e in events]


def _steady(steps: int, **spikes: dict[int, float]) -> list[dict[str, float]]:
    """Two series near 1.0 (grad/a and actv/b, in that order); `spikes[tag]`: step -> value."""
    series = []
    for step in range(steps):
        metrics = {"grad/a/norm": 1.0 + 0.01 * (step % 3), "actv/b/norm": 1.0 - 0.01 * (step % 2)}
        for name, at in spikes.items():
            if step in at:
                metrics[f"{name.replace('_', '/')}/norm"] = at[step]
        series.append(metrics)
    return series


def test_a_spike_on_another_tag_during_an_episode_s_cooldown_is_a_new_alert():
    """The issue's case: a (false) gradient spike's episode waits out its cooldown of 20 when a
    real activation spike comes: that is a new event, alerted; each end names its own tag and
    carries that tag's value (the old tracker absorbed the second and ended the first with it)."""
    events = _episodes(_steady(60, grad_a={12: 7.0}, actv_b={20: 13.0}), cooldown=20)
    assert events == [("start", "grad/a/norm", 12, 7.0), ("start", "actv/b/norm", 20, 13.0),
                      ("end", "grad/a/norm", 33, 7.0), ("end", "actv/b/norm", 41, 13.0)], events


def test_an_episode_s_end_carries_its_own_tag_s_value_when_a_later_step_leads_with_another():
    """Step 12: grad/a spikes (the episode's tag); step 13 it spikes again, with actv/b (first
    in execution order, so that step's firing leads with actv/b): one event, whose end names
    grad/a with grad/a's last value, not actv/b's."""
    series = _steady(40, grad_a={12: 7.0})
    series[13] = {"actv/b/norm": 11.0, "grad/a/norm": 8.0}  # actv/b first in the step's metrics
    events = _episodes(series, cooldown=2)
    assert events == [("start", "grad/a/norm", 12, 7.0), ("end", "grad/a/norm", 16, 8.0)], events


def test_an_episode_s_own_tags_firing_again_in_its_cooldown_continue_it():
    events = _episodes(_steady(60, grad_a={12: 7.0, 18: 9.0}), cooldown=20)
    assert events == [("start", "grad/a/norm", 12, 7.0), ("end", "grad/a/norm", 39, 9.0)], events


def test_per_tag_episodes_survive_a_restart():
    """Two open episodes saved and restored: each ends on time, with its own tag and value."""
    from msprobe_engine.rules import AlertTracker

    series = _steady(60, grad_a={12: 7.0}, actv_b={20: 13.0})
    rule, tracker, events = _spike_rule(cooldown=20), AlertTracker(), []
    for step, metrics in enumerate(series):
        if step == 25:  # a restart: a new rule and tracker from the saved state
            rule_state, tracker_state = json.loads(json.dumps([rule.state_dict(), tracker.state_dict()]))
            rule, tracker = _spike_rule(cooldown=20), AlertTracker()
            rule.load_state_dict(rule_state)
            tracker.load_state_dict(tracker_state)
        events += tracker.update(step, rule.evaluate(None, {}, metrics))
    assert [(e.phase, e.tag, e.step, e.value) for e in events] == [
        ("start", "grad/a/norm", 12, 7.0), ("start", "actv/b/norm", 20, 13.0),
        ("end", "grad/a/norm", 33, 7.0), ("end", "actv/b/norm", 41, 13.0)]


def test_a_second_collapsing_router_during_a_collapse_s_cooldown_is_a_new_alert():
    """expert_collapse and dead_experts list their hits too: a router collapsing while another
    router's episode cools down is its own alert (the step's hits are the new event's: the
    first episode ends on time, 6 steps after its last own firing)."""
    from msprobe_engine.rules import AlertTracker, Firing

    def collapse(*layers: str) -> list[Firing]:
        tags = [f"router/{layer}/load/0" for layer in layers]
        return [Firing("expert_collapse", "expert_collapse", tags[0], 0.95, 0.9, "continue", also=tuple(tags[1:]),
                       cooldown=5, parts=tuple((tag, 0.95, 0.9) for tag in tags))] if layers else []

    tracker = AlertTracker()
    plan = {3: ("l1",), 4: ("l1",), 6: ("l1", "l2"), 7: ("l2",)}
    events = [e for step in range(20) for e in tracker.update(step, collapse(*plan.get(step, ())))]
    assert [(e.phase, e.tag, e.step) for e in events] == [
        ("start", "router/l1/load/0", 3), ("start", "router/l2/load/0", 6),
        ("end", "router/l1/load/0", 10), ("end", "router/l2/load/0", 13)], events


def test_a_real_spike_during_another_spike_s_cooldown_is_alerted_and_named(tmp_path):
    """full.yaml (cooldown 20): a spike at the head, then 7 steps later one upstream of it (which
    shows at the head too): two alerts, each named after its layer, each ending with its own tag."""
    plan = {45: ("head", "spike"), 52: ("blocks.0.fc", "spike")}
    monitor, _ = run(tmp_path, plan, steps=80)
    spikes = [(e.phase, e.step, e.tag) for e in monitor.alert_log if e.rule == "spike"]
    assert [s for s in spikes if s[0] == "start"] == [("start", 45, "actv/head/output/norm"),
                                                        ("start", 52, "actv/blocks.0.fc/output/norm")], spikes
    ends = {tag: step for phase, step, tag in spikes if phase == "end"}
    assert ends == {"actv/head/output/norm": 66, "actv/blocks.0.fc/output/norm": 73}, spikes


def _reference_trend_hits(histories: dict, metrics: dict, window: int, factor: float, min_r2: float) -> dict:
    """The slope method as its docstring states it, one tag at a time: the last `window` log
    norms (finite, positive values only), their least-squares slope and R^2."""
    import numpy as np

    hits = {}
    for tag, value in metrics.items():
        if not (math.isfinite(value) and value > 0):
            continue
        history = histories.setdefault(tag, [])
        history.append(math.log(value))
        del history[:-window]
        if len(history) < window:
            continue
        y = np.array(history)
        x = np.arange(window) - (window - 1) / 2
        slope = float((y - y.mean()) @ x / (x @ x))
        spread = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 if spread == 0 else slope * slope * float(x @ x) / spread
        if slope * (window - 1) >= math.log(factor) and r2 >= min_r2:
            hits[tag] = math.exp(history[0] + math.log(factor))
    return hits


def test_the_trend_slope_on_all_tags_at_once_is_the_per_tag_fit_with_gaps_new_tags_and_a_resume():
    """Series that grow, stay flat or are noisy; values that are not observations (nan, inf, 0,
    negative); tags that appear late, vanish for a while and come back; the rule's state saved
    and loaded into a fresh rule half-way: every step's hits (tags and thresholds) are those of
    the per-tag least-squares fit."""
    import numpy as np

    from msprobe_engine.rules.trend import TrendRule

    config = TrendRule.Config(rule="trend", metrics=["grad/*/norm"], window=6, factor=3.0, min_r2=0.8)
    rule, histories = TrendRule(config), {}
    gen = np.random.default_rng(4)
    fired = 0
    for step in range(60):
        metrics = {}
        for i in range(12):
            if i >= 8 and step < 10 * (i - 7) or (i == 3 and 20 <= step < 30):
                continue  # appears late / vanishes for a while
            value = [1.4 ** step, 1.0, float(gen.lognormal(0, 0.5)), 1.3 ** (step % 17)][i % 4] * (i + 1)
            if (step + i) % 11 == 0:
                value = [float("nan"), float("inf"), 0.0, -value][(step + i) % 4]
            metrics[f"grad/layer{i}.weight/norm"] = value
        metrics["train/loss"] = 1.0  # not watched
        want = _reference_trend_hits(histories, metrics, config.window, config.factor, config.min_r2)
        firing = rule.evaluate(None, None, metrics)
        got = {tag: threshold for tag, _, threshold in firing[0].parts} if firing else {}
        assert got.keys() == want.keys(), (step, sorted(got), sorted(want))
        for tag, threshold in want.items():
            assert math.isclose(got[tag], threshold, rel_tol=1e-9), (step, tag)
        fired += len(got)
        if step == 30:
            state = json.loads(json.dumps(rule.state_dict()))
            assert state["history"]["grad/layer0.weight/norm"] == histories["grad/layer0.weight/norm"]
            rule = TrendRule(config)
            rule.load_state_dict(state)
    assert fired > 30
