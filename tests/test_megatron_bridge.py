"""The Megatron Bridge callback, driven in the order Bridge's `train()` fires its events, on a
real megatron-core model (0.16.1 on Python 3.11, 0.19.2 in the 3.12 lane).

In the 3.11 environment megatron-bridge cannot be installed (msprobe_integrations/megatron_bridge.py):
contexts carry the fields of Bridge's `CallbackContext` that the callback reads. The 3.12 lane
installs megatron-bridge 0.6.2 without its dependencies: `import megatron.bridge.training.callbacks`
still fails there, because `megatron/bridge/__init__.py` imports every model bridge (transformers,
Transformer Engine), but the callbacks module itself needs only the standard library, so the test
loads that very file and drives the callback through Bridge's own `CallbackManager` and
`CallbackContext`."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow  # a megatron-core process (gloo)

STEPS = 3
LAYER_K = 1


def _context(model, optimizer, step: int, loss=None) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(train_state=SimpleNamespace(step=step)), model=[model],
                           optimizer=optimizer, user_state={}, loss_dict=None if loss is None else {"lm loss": loss},
                           skipped_iter=False)


def bridge_installed() -> bool:
    try:
        importlib.metadata.distribution("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def bridge_callbacks() -> ModuleType:
    """megatron-bridge's own `megatron/bridge/training/callbacks.py`, loaded from its file (the
    package's `__init__` imports every model bridge, which needs transformers and Transformer Engine)."""
    path = importlib.metadata.distribution("megatron-bridge").locate_file("megatron/bridge/training/callbacks.py")
    spec = importlib.util.spec_from_file_location("megatron_bridge_callbacks", str(path))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


class _BridgeDriver:
    """Fires events through Bridge's `CallbackManager` with Bridge's `CallbackContext`s."""

    def __init__(self, callback) -> None:
        self.bridge = bridge_callbacks()
        self.manager = self.bridge.CallbackManager()
        self.manager.add(callback)  # registers the methods by event name, as pretrain() does

    def __getattr__(self, event: str):
        def fire(context: SimpleNamespace) -> None:
            fields = {k: v for k, v in vars(context).items() if k != "user_state"}
            self.manager.fire(event, self.bridge.CallbackContext(user_state=self.manager.user_state, **fields))
        return fire


def bridge_run(rank: int, world: int, out: str, through_bridge: bool = False) -> dict:
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron_bridge import MonitorCallback

    H.init_parallel()
    model = H.wrap_ddp(H.build_gpt())
    optimizer = H.build_optimizer([model])
    callback = MonitorCallback(config={"output_dir": out, "strict": True, "sinks": ["jsonl"],
                                       "alerts": [{"rule": "non_finite", "action": "skip"}]})
    if through_bridge:
        events = _BridgeDriver(callback)
        assert {e for e in events.bridge.VALID_EVENTS if events.manager.has_callbacks(e)} == {
            "on_train_start", "on_train_step_end", "on_train_end"}
        callback = events
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


def _check(result: dict) -> None:
    records = result["records"]
    assert [r["step"] for r in records] == list(range(STEPS))
    for record, norms in zip(records[:-1], result["norms"]):
        for name, norm in norms.items():
            assert record["metrics"][f"grad/{name}/norm"] == pytest.approx(norm, rel=1e-5), name
        assert math.isfinite(record["metrics"]["train/loss"])
    (incident,) = result["incidents"].values()
    assert (incident["step"], incident["action"]) == (STEPS - 1, "skip")
    assert incident["culprit"]["call"] == f"decoder.layers.{LAYER_K}.mlp.linear_fc1"


def test_bridge_callback_monitors_megatron_core_training(tmp_path):
    _check(run_ranks(bridge_run, 1, str(tmp_path), timeout=180)[0])


@pytest.mark.skipif(not bridge_installed(), reason="megatron-bridge 0.6.2 is installed in the Python 3.12 "
                    "lane only (make test-py312); it needs Python >= 3.12")
def test_bridge_callback_through_bridges_own_callback_manager(tmp_path):
    _check(run_ranks(bridge_run, 1, str(tmp_path), True, timeout=180)[0])
