"""Grouped-GEMM experts on real megatron-core 0.16.1 (`GroupedMLP`, `moe_grouped_gemm`; gone in 0.19,
so not in the 3.12 lane): a tiny GPT whose MLPs are 4 experts held as one `weight1` and one
`weight2` per layer, trained with expert parallelism 2 on two gloo CPU ranks (experts 0-1 on
rank 0, 2-3 on rank 1; `grouped_gemm`'s CUDA kernel replaced by a plain-torch one, see
tests/megatron_helpers.py patch 7). Every expert's gradient, weight and Adam moment is reported
under its global number on both ranks and equals the statistics of that expert's piece, taken
on the rank holding it and gathered."""
from __future__ import annotations

import math

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow

STEPS, EXPERTS, LAYERS = 2, 4, 2
RTOL = 1e-6
CONFIG = {"strict": True, "sinks": ["jsonl"], "stats": ["min", "max", "mean", "norm"],
          "watch": {"params": True, "optimizer_state": ["exp_avg"]}}
PARTS = {"weight1": "linear_fc1.weight", "weight2": "linear_fc2.weight"}
NUMEL = 32 * 128  # the values of one expert's piece: hidden x ffn (4 x hidden) of the tiny GPT


def _truth(model, optimizer) -> dict[str, float]:
    """min, max, mean and norm of each local expert's piece of the grouped weights, their
    gradients and Adam's exp_avg, under the expert's global name, computed here in float64."""
    state = optimizer.chained_optimizers[0].optimizer.state
    out = {}
    for layer in model.module.decoder.layers:
        experts = layer.mlp.experts
        for attr, part in PARTS.items():
            weight = getattr(experts, attr)
            tensors = {"param": weight.detach(), "grad": weight.main_grad, "optim": state[weight]["exp_avg"]}
            for kind, tensor in tensors.items():
                for piece, expert in zip(tensor.reshape(experts.num_local_experts, -1), layer.mlp.local_expert_indices):
                    role = "/exp_avg" if kind == "optim" else ""
                    base = f"{kind}/decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{expert}.{part}{role}/"
                    values = piece.double()
                    out.update({base + "min": values.min().item(), base + "max": values.max().item(),
                                base + "mean": values.mean().item(), base + "norm": values.norm().item()})
    return out


def _train(rank: int, world: int, out: str) -> dict:
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.init_parallel(ep=world)
    spec = H.TinySpec(hidden=32, experts=EXPERTS, grouped=True)
    model = H.wrap_ddp(H.build_gpt(spec))
    optimizer = H.build_optimizer([model])
    monitor = MegatronMonitor([model], optimizer, config={**CONFIG, "output_dir": out})
    steps = []
    for step in range(STEPS):
        loss, _, _ = H.train_step(model, optimizer, H.micro_batches(spec, 2, seed=step)[rank:rank + 1])
        record = monitor.step_end(loss)
        steps.append({"metrics": record.metrics, "truth": _truth(model, optimizer)})
    monitor.close()
    return {"steps": steps, "local": [list(layer.mlp.local_expert_indices) for layer in model.module.decoder.layers]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_train, 2, str(tmp_path_factory.mktemp("megatron_grouped")), timeout=240)


def test_grouped_experts_are_reported_per_expert_under_global_numbers(ranks):
    assert [r["local"] for r in ranks] == [[[0, 1]] * LAYERS, [[2, 3]] * LAYERS]
    for rank in ranks:
        tags = rank["steps"][0]["metrics"]
        assert not [t for t in tags if ".experts.weight" in t]  # never the grouped weight as a whole
        for layer in range(LAYERS):
            for expert in range(EXPERTS):
                for kind, part in (("grad", "linear_fc1.weight"), ("param", "linear_fc2.weight")):
                    assert f"{kind}/decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{part}/norm" in tags


def test_per_expert_statistics_equal_the_gathered_truth(ranks):
    for step in range(STEPS):
        truth = {**ranks[0]["steps"][step]["truth"], **ranks[1]["steps"][step]["truth"]}  # gathered over EP
        assert len(truth) == LAYERS * EXPERTS * len(PARTS) * 3 * 4
        for rank in ranks:
            got = rank["steps"][step]["metrics"]
            for tag, want in truth.items():
                base, _, stat = tag.rpartition("/")
                rms = truth[base + "/norm"] / math.sqrt(NUMEL)
                assert math.isclose(got[tag], want, rel_tol=RTOL, abs_tol=RTOL * rms if stat == "mean" else 0.0), tag

