"""The Megatron Bridge callback, driven in the order Bridge's `train()` fires its events, on a
real megatron-core 0.16.1 model (megatron-bridge itself cannot be installed here: see
msprobe_integrations/megatron_bridge.py). Contexts carry the fields of Bridge's
`CallbackContext` that the callback reads."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow  # a megatron-core process (gloo)

STEPS = 3
LAYER_K = 1


def _context(model, optimizer, step: int, loss=None) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(train_state=SimpleNamespace(step=step)), model=[model],
                           optimizer=optimizer, user_state={}, loss_dict=None if loss is None else {"lm loss": loss},
                           skipped_iter=False)


def bridge_run(rank: int, world: int, out: str) -> dict:
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron_bridge import MonitorCallback

    H.init_parallel()
    model = H.wrap_ddp(H.build_gpt())
    optimizer = H.build_optimizer([model])
    callback = MonitorCallback(config={"output_dir": out, "strict": True, "sinks": ["jsonl"],
                                       "alerts": [{"rule": "non_finite", "action": "skip"}]})
    callback.on_train_start(_context(model, optimizer, 0))
    norms = []
    for step in range(STEPS):
        if step == STEPS - 1:
            H.inject_nan(model, LAYER_K)
        grads = {}

        def reduced_grads() -> None:  # Megatron's reduced gradients, final before its step
            grads.update({n: p.main_grad.double().norm().item() for n, p in model.module.named_parameters()})

        loss, _, _ = H.train_step(model, optimizer, H.micro_batches(H.TinySpec(), 2, seed=step),
                                  after_backward=reduced_grads)
        norms.append(grads)
        callback.on_train_step_end(_context(model, optimizer, step + 1, loss))
    callback.on_train_end(_context(model, optimizer, STEPS))
    records = [json.loads(line) for line in (Path(out) / "rank0" / "metrics.jsonl").read_text().splitlines()]
    incidents = {p.parent.name: json.loads(p.read_text()) for p in Path(out).glob("incidents/*/incident.json")}
    return {"records": records, "norms": norms, "incidents": incidents}


def test_bridge_callback_monitors_megatron_core_training(tmp_path):
    (result,) = run_ranks(bridge_run, 1, str(tmp_path), timeout=180)
    records = result["records"]
    assert [r["step"] for r in records] == list(range(STEPS))
    for record, norms in zip(records[:-1], result["norms"]):
        for name, norm in norms.items():
            assert record["metrics"][f"grad/{name}/norm"] == pytest.approx(norm, rel=1e-5), name
        assert math.isfinite(record["metrics"]["train/loss"])
    (incident,) = result["incidents"].values()
    assert (incident["step"], incident["action"]) == (STEPS - 1, "skip")
    assert incident["culprit"]["call"] == f"decoder.layers.{LAYER_K}.mlp.linear_fc1"
