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
