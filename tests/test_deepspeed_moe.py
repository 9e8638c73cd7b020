"""Router health of DeepSpeed MoE layers under DeepSpeedMonitor, on a real DeepSpeed engine
(CPU, gloo, one rank): every top-k choice is an expert's load or dropped by the capacity,
exactly; the gate's l_aux is the aux_loss; a collapse injected at step N raises one alert at
N naming the gate; a clean run none."""
from __future__ import annotations

import math

import pytest

from tests import ds_moe_helpers as H
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow
ROUTER = f"router/{H.GATE}"
TOKENS = H.BATCH * H.SEQ * H.GAS  # per step: one rank, GAS micro-batches


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(H.run_cases, 1, str(tmp_path_factory.mktemp("ds_moe")), timeout=600)[0]


def _loads(metrics: dict) -> list[float]:
    return [metrics[f"{ROUTER}/load/{e}"] for e in range(H.EXPERTS)]


@pytest.mark.parametrize("case", ["capacity", "no capacity"])
def test_every_choice_is_a_load_or_dropped_and_a_clean_run_raises_nothing(runs, case):
    records = runs[case]["records"]
    assert len(records) == H.STEPS
    for _, m, alerts in records:
        dropped = m.get(f"{ROUTER}/dropped", 0.0)
        assert sum(_loads(m)) + dropped == TOKENS * H.TOP_K  # exactly: counts
        assert m[f"{ROUTER}/tokens"] == TOKENS
        assert 0.0 < m[f"{ROUTER}/entropy"] <= 1.0
        assert 1.0 / H.EXPERTS < m[f"{ROUTER}/topk_prob"] < 1.0
        assert m[f"{ROUTER}/z_loss"] > 0.0 and math.isfinite(m[f"{ROUTER}/z_loss"])
        assert not alerts
    if case == "capacity":  # 0.5 x the even share per expert: about half the choices cannot be served
        assert all(m[f"{ROUTER}/dropped"] >= TOKENS * H.TOP_K / 4 for _, m, _ in records)
    else:
        assert all(f"{ROUTER}/dropped" not in m for _, m, _ in records)  # no capacity, no drop tag


def test_aux_loss_is_the_gates_l_aux_averaged_over_micro_batches(runs):
    run = runs["capacity"]
    for (step, m, _) in run["records"]:
        expected = sum(run["aux"][step * H.GAS:(step + 1) * H.GAS]) / H.GAS
        assert m[f"{ROUTER}/aux_loss"] == pytest.approx(expected, rel=1e-6)


def test_a_collapsed_gate_raises_one_alert_at_that_step_naming_it(runs):
    records = runs["collapse"]["records"]
    starts = [(step, tag) for step, _, alerts in records for rule, phase, tag in alerts
              if rule == "expert_collapse" and phase == "start"]
    assert starts == [(H.FAULT_STEP, f"{ROUTER}/load/1")]
    assert records[H.FAULT_STEP][1][f"{ROUTER}/load/1"] == TOKENS  # every token's first choice
