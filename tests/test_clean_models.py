"""Clean training of models we did not write (transformers, random init, tiny configs, no
download; bench/clean_runs.py builds and trains them): the shipped configs raise no alert;
injected faults are still caught once each. The goal's 300 steps: `python bench/clean_runs.py
<model> <config> --steps 300` (docs/alerts.md has the figures)."""
from __future__ import annotations

import pytest

from health_models import Faults

pytest.importorskip("transformers")
from bench.clean_runs import MODELS, train  # noqa: E402  (needs transformers)

STEPS = 150


@pytest.mark.slow
@pytest.mark.parametrize("config", ["default", "full.yaml"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clean_training_of_a_model_we_did_not_write_raises_no_alert(tmp_path, name, config):
    monitor, losses = train(name, config, tmp_path, STEPS)
    assert losses[-1] < losses[0]  # it trains
    assert [(e.step, e.rule, e.tag) for e in monitor.alert_log] == []


@pytest.mark.slow
def test_injected_faults_in_a_moe_model_are_caught_once_each(tmp_path):
    layer = "model.layers.1.self_attn.o_proj"
    plan = {50: (layer, "spike"), 80: (layer, "nan")}
    monitor, _ = train("mixtral", "full.yaml", tmp_path, 100, faults=lambda model: Faults(model, plan))
    starts = [(e.step, e.rule) for e in monitor.alert_log if e.phase == "start"]
    assert starts == [(50, "spike"), (80, "non_finite")], starts
    tags = [e.tag for e in monitor.alert_log if e.phase == "start"]
    assert all(layer in tag for tag in tags), tags
