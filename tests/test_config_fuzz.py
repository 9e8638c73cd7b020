"""Seeded mutations of the shipped configs: every one loads or raises `ConfigError`, and what
loads can be used (the objects attach builds from it are built here without a model)."""
import copy
import json
import random
from collections import deque
from pathlib import Path

import pytest
import yaml

from msprobe_engine.collect.selection import ModuleFilter
from msprobe_engine.config import ConfigError, load_config
from msprobe_engine.config.loader import MAX_MESSAGE
from msprobe_engine.rules import build_rules

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MUTATIONS = 1200
#: this many of the configs that load are also attached to a model and run for two steps
ATTACHED = 25

BAD_VALUES = [None, True, 0, -1, 5, 2 ** 63, 2 ** 1030, 10 ** 400, -10 ** 400, 1e308, float("nan"), float("inf"),
              float("-inf"), 0.5, "", "x", "(", "[a-", "*", "x" * 5000, [], ["("], [5], [None], {}, {"x": 1},
              {"rule_name": "AnomalyTurbulence", "args": {"threshold": "x"}}, [{"rule": "spike"}],
              [{"rule": "spike", "factor": float("nan")}], [{"rule": "trend", "window": 10 ** 400}]]


def _deep(levels: int):
    value: object = 1
    for _ in range(levels):
        value = {"a": [value]}
    return value


def _paths(node, depth=0):
    """Every (container, key) position of a config, down to 6 levels (not into deep values)."""
    if depth > 6:
        return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield node, key
        yield from _paths(value, depth + 1)


def mutate(base: dict, rng: random.Random) -> dict:
    data = copy.deepcopy(base)
    for _ in range(rng.randint(1, 3)):
        spots = list(_paths(data))
        if not spots:
            break
        container, key = rng.choice(spots)
        move = rng.random()
        if move < 0.6:
            container[key] = rng.choice(BAD_VALUES + [_deep(rng.choice([40, 1000]))])
        elif move < 0.75 and isinstance(container, dict):
            del container[key]
        elif move < 0.9 and isinstance(container, dict):
            container[rng.choice(["x", "ur_distribution", "end_step", "factor", "threshold"])] = \
                rng.choice(BAD_VALUES)
        else:
            container[key] = [container[key]]
    return data


def usable(config) -> None:
    """What attach builds from a config: rules, the module filter, the ring buffer, the schedule."""
    build_rules(config.alerts)
    ModuleFilter(config.modules)("layers.0", "Linear")
    deque(maxlen=config.ring_buffer)
    config.schedule.is_monitored(3)


def attached(data: dict, out: Path) -> None:
    """A config that loaded, run for real: a monitor (strict: any error raises) on a small model."""
    import torch

    from health_models import Teacher, build, train
    from msprobe_engine.monitor import Monitor

    model = build()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    config = {**data, "output_dir": str(out), "strict": True, "sinks": ["jsonl"]}
    config.pop("format", None)  # the predecessor's spelling of sinks
    monitor = Monitor(config).attach(model, optimizer)
    train(model, monitor, 2, optimizer, teacher=Teacher())
    monitor.close()


@pytest.mark.parametrize("name", ["full.yaml", "predecessor_monitor.json"])
def test_mutated_configs_load_or_raise_config_error_only(name, tmp_path):
    path = CONFIGS / name
    base = yaml.safe_load(path.read_text()) if path.suffix == ".yaml" else json.loads(path.read_text())
    rng = random.Random(16)
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(MUTATIONS):
        data = mutate(base, rng)
        try:
            config = load_config(data)
        except ConfigError as exc:
            outcomes["refused"] += 1
            for line in str(exc).splitlines():
                assert len(line) <= MAX_MESSAGE, line
            continue
        usable(config)
        if outcomes["loaded"] < ATTACHED:
            attached(data, tmp_path / str(outcomes["loaded"]))
        outcomes["loaded"] += 1
    assert outcomes["refused"] > MUTATIONS // 2 and outcomes["loaded"] > ATTACHED, outcomes


@pytest.mark.parametrize("seed", [16, 28, 2801])
@pytest.mark.parametrize("name", ["full.yaml", "predecessor_monitor.json"])
def test_no_mutation_escapes_as_another_error_whatever_the_seed(name, seed):
    """Every mutation loads or raises `ConfigError` (no OSError, ValueError, TypeError...),
    the paths included: a 5,000-character or NUL output_dir is refused at load."""
    path = CONFIGS / name
    base = yaml.safe_load(path.read_text()) if path.suffix == ".yaml" else json.loads(path.read_text())
    rng = random.Random(seed)
    for _ in range(MUTATIONS // 2):
        data = mutate(base, rng)
        try:
            usable(load_config(data))
        except ConfigError:
            continue


@pytest.mark.parametrize("data, key", [
    ({"ur_distribution": "yes"}, "ur_distribution"), ({"mv_distribution": 3}, "mv_distribution"),
    ({"ur_distribution": True, "watch": {"optimizer_state": ["exp_avg"]}}, "ur_distribution"),
    ({"collect_times": 0}, "collect_times"), ({"collect_times": -2.5}, "collect_times"),
    ({"collect_times": 2.5}, "collect_times"), ({"collect_times": True}, "collect_times"),
    ({"output_dir": "x" * 5000}, "output_dir"), ({"output_dir": "a\0b"}, "output_dir"),
    ({"output_dir": "/tmp/" + "y" * 300}, "output_dir"), ({"run_name": "z" * 300}, "run_name"),
    ({"incidents": {"dir": "a\0"}}, "incidents.dir"), ({"control": {"file": "c" * 5000}}, "control.file"),
])
def test_errors_name_the_key_the_user_wrote(data, key):
    with pytest.raises(ConfigError) as exc:
        load_config(data)
    assert str(exc.value).startswith(f"config: {key}:"), str(exc.value)


def test_collect_times_sets_the_end_step_and_the_predecessor_default_sets_none():
    assert load_config({"start_step": 2, "step_interval": 3, "collect_times": 4}).schedule.end_step == 14
    assert load_config({"collect_times": 1e8}).schedule.end_step is None


def test_a_billion_laughs_yaml_is_refused_at_once(tmp_path):
    import time

    from msprobe_engine.cli import main

    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    began = time.monotonic()
    with pytest.raises(ConfigError, match="aliases .* expand to more than"):
        load_config(tmp_path / "bomb.yaml")
    assert main(["check-config", str(tmp_path / "bomb.yaml")]) == 1
    assert time.monotonic() - began < 5
    (tmp_path / "ok.yaml").write_text("alerts:\n  - &s {rule: spike, metrics: [train/loss]}\n  - *s\n")
    assert len(load_config(tmp_path / "ok.yaml").alerts) == 2  # a few aliases are fine
