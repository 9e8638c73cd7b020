"""Megatron-core's router with a capacity and a load-balancing loss (one gloo rank): every top-k
choice is an expert's load or dropped by the capacity, exactly, and the router's `aux_loss` is the
value Megatron's own tracker logs for the layer (`save_to_aux_losses_tracker`), per micro-batch."""
from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow
EXPERTS, TOP_K, MICRO, STEPS, COEFF = 4, 2, 2, 3, 0.01


def _train(rank: int, world: int, out: str) -> dict:
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    from msprobe_integrations.megatron import MegatronMonitor
    from tests import megatron_helpers as H

    H.init_parallel()
    spec = H.TinySpec(experts=EXPERTS, capacity=0.5, aux_loss=COEFF)
    model = H.wrap_ddp(H.build_gpt(spec))
    optimizer = H.build_optimizer([model])
    monitor = MegatronMonitor([model], optimizer, config={"output_dir": out, "strict": True, "sinks": []})
    logged = []
    for step in range(STEPS):
        clear_aux_losses_tracker()
        loss, _, _ = H.train_step(model, optimizer, H.micro_batches(spec, MICRO, seed=step))
        monitor.step_end(loss)
        values = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
        logged.append([float(v) / MICRO for v in values])  # the tracker adds the micro-batches up
    monitor.close()
    return {"metrics": [dict(r.metrics) for r in monitor.history], "logged": logged,
            "tokens": spec.batch * spec.seq * MICRO, "layers": spec.layers}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_ranks(_train, 1, str(tmp_path_factory.mktemp("router_losses")), timeout=240)[0]


def test_every_choice_is_a_load_or_dropped_by_the_capacity(run):
    for metrics in run["metrics"]:
        for layer in range(run["layers"]):
            base = f"router/decoder.layers.{layer}.mlp.router"
            loads = [metrics[f"{base}/load/{e}"] for e in range(EXPERTS)]
            assert sum(loads) + metrics[f"{base}/dropped"] == run["tokens"] * TOP_K  # exactly
            assert metrics[f"{base}/dropped"] > 0  # half the even share per expert: some cannot be served
            assert metrics[f"{base}/tokens"] == run["tokens"]


def test_aux_loss_is_what_megatron_logs_for_the_layer(run):
    for metrics, logged in zip(run["metrics"], run["logged"]):
        for layer in range(run["layers"]):
            assert metrics[f"router/decoder.layers.{layer}.mlp.router/aux_loss"] == pytest.approx(logged[layer],
                                                                                                rel=1e-6)
