"""Mixture of experts on real megatron-core (0.16.1 on 3.11, 0.19.2 in the 3.12 lane; CPU, gloo):
a tiny GPT whose MLPs are 4 experts with top-2 routing, trained with expert parallelism 1
(one rank, both micro-batches) and 2 (two ranks, one micro-batch each, experts 0-1 on rank 0
and 2-3 on rank 1). Every expert's gradient, weight and Adam moments are reported under its
global number, merged over the expert-parallel group, and equal in both layouts; the routers'
loads add up to tokens x top-k exactly and are the same in both.

On megatron-core 0.16 the EP=2 run's experts are grouped GEMMs (`GroupedMLP`, one `weight1` and
`weight2` per layer; `grouped_gemm`'s CUDA kernel replaced by plain torch, tests/megatron_helpers.py
patch 7; 0.19 has no GroupedMLP, its EP=2 run keeps `SequentialMLP`): every expert's piece is
reported as that expert's `linear_fc1`/`linear_fc2` weight, equal to EP=1's `SequentialMLP`
experts (the same weights, transposed) and to the statistics of the piece itself, taken on the
rank holding it and gathered.
"""
from __future__ import annotations

import math

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow

STEPS = 3
EXPERTS, TOP_K, LAYERS = 4, 2, 2
RTOL = 1e-6
#: EP=1's SequentialMLP against EP=2's GroupedMLP: each expert's gradient comes from other float32
#: matmuls (one per expert's rows, of the transposed weight), not only from sums in another order
RTOL_GROUPED = 1e-5
CONFIG = {"strict": True, "sinks": ["jsonl"], "stats": ["min", "max", "mean", "norm", "numel"],
          "watch": {"params": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
          "alerts": [{"rule": "non_finite"}, {"rule": "expert_collapse"}]}


def _spec(grouped: bool = False):
    from tests import megatron_helpers as H
    return H.TinySpec(hidden=32, experts=EXPERTS, grouped=grouped)


def _grouped_available() -> bool:
    from megatron.core.transformer.moe import experts
    return hasattr(experts, "GroupedMLP")


def _truth(model, optimizer) -> dict[str, float]:
    """min, max, mean and norm of each local expert's weights, their gradients and Adam's exp_avg
    (a GroupedMLP's: each expert's piece of its weights), under the expert's global name,
    computed here in float64."""
    state = optimizer.chained_optimizers[0].optimizer.state
    out = {}
    for layer in model.module.decoder.layers:
        experts, indices = layer.mlp.experts, layer.mlp.local_expert_indices
        if hasattr(experts, "weight1"):
            parts = {part: [(w, piece) for piece in range(len(indices))] for part, w in
                     (("linear_fc1.weight", experts.weight1), ("linear_fc2.weight", experts.weight2))}
        else:
            parts = {part: [(getattr(e, part.split(".")[0]).weight, None) for e in experts.local_experts]
                     for part in ("linear_fc1.weight", "linear_fc2.weight")}
        for part, weights in parts.items():
            for expert, (weight, piece) in zip(indices, weights):
                name = f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{expert}.{part}"
                for kind, tensor in (("param", weight.detach()), ("grad", weight.main_grad),
                                     ("optim", state[weight]["exp_avg"])):
                    values = (tensor if piece is None else tensor.reshape(len(indices), -1)[piece]).double()
                    base = f"{kind}/{name}/exp_avg/" if kind == "optim" else f"{kind}/{name}/"
                    out.update({base + "min": values.min().item(), base + "max": values.max().item(),
                                base + "mean": values.mean().item(), base + "norm": values.norm().item()})
    return out


def _train(rank: int, world: int, out: str, grouped: bool = False) -> dict:
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.init_parallel(ep=world)
    model = H.wrap_ddp(H.build_gpt(_spec(grouped)))
    optimizer = H.build_optimizer([model])
    monitor = MegatronMonitor([model], optimizer, config={**CONFIG, "output_dir": out})
    steps = []
    for step in range(STEPS):
        batches = H.micro_batches(_spec(), 2, seed=step)
        loss, _, _ = H.train_step(model, optimizer, batches[rank:rank + 1] if world > 1 else batches)
        record = monitor.step_end(loss)
        steps.append({"metrics": record.metrics, "alerts": [a.as_dict() for a in record.alerts],
                      "truth": _truth(model, optimizer)})
    monitor.close()
    return {"steps": steps, "local": [list(layer.mlp.local_expert_indices) for layer in model.module.decoder.layers],
            "grouped": [n for n, _ in model.module.named_parameters() if ".experts.weight" in n]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_moe")
    return {"ep1": run_ranks(_train, 1, str(out / "ep1"), timeout=180),
            "ep2": run_ranks(_train, 2, str(out / "ep2"), _grouped_available(), timeout=240)}


def _expert_tags(metrics: dict) -> dict[str, float]:
    return {t: v for t, v in metrics.items() if ".experts.local_experts." in t and t.split("/")[0] in ("grad", "param", "optim")}


def test_expert_parallel_ranks_hold_their_experts_and_report_all_under_global_numbers(runs):
    assert [r["local"] for r in runs["ep2"]] == [[[0, 1]] * LAYERS, [[2, 3]] * LAYERS]
    assert bool(runs["ep2"][0]["grouped"]) == _grouped_available()  # GroupedMLP's weight1/weight2 where it exists
    tags = _expert_tags(runs["ep2"][0]["steps"][0]["metrics"])
    assert not [t for t in tags if ".experts.weight" in t]  # never a grouped weight as a whole
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for kind in ("grad", "param"):
                assert f"{kind}/decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight/norm" in tags
            assert f"optim/decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight/exp_avg/norm" in tags


def _tolerance(metrics: dict, tag: str, rtol: float = RTOL) -> float:
    """Norms and counts: `rtol` of the value. Min, max and mean: `rtol` of the tensor's rms (an
    element near zero, or a mean of values of both signs, is a difference of rounded numbers)."""
    base, _, stat = tag.rpartition("/")
    if stat not in ("min", "max", "mean"):
        return 0.0
    base += "/"
    return rtol * metrics[base + "norm"] / math.sqrt(metrics[base + "numel"])


def test_per_expert_statistics_equal_in_both_layouts(runs):
    """EP=2 (merged over the expert-parallel group) equals EP=1 within 1e-6 relative: the two
    layouts differ only in the order float32 sums run in (an expert sees both micro-batches in
    one pass under EP=2); 1e-5 where EP=2's experts are grouped GEMMs (`RTOL_GROUPED`); twice that for
    `exp_avg_sq`, a square of the gradient."""
    for rank_result in runs["ep2"]:
        layout_rtol = RTOL_GROUPED if rank_result["grouped"] else RTOL
        for got, want in zip(rank_result["steps"], runs["ep1"][0]["steps"]):
            reference = _expert_tags(want["metrics"])
            assert reference and set(_expert_tags(got["metrics"])) == set(reference)
            for tag, value in reference.items():
                # Adam's second moment is the gradient squared: twice the gradient's relative difference
                rtol = 2 * layout_rtol if "/exp_avg_sq/" in tag else layout_rtol
                assert math.isclose(got["metrics"][tag], value, rel_tol=rtol,
                                    abs_tol=_tolerance(want["metrics"], tag, rtol)), tag
            assert math.isclose(got["metrics"]["grad/global/norm"], want["metrics"]["grad/global/norm"],
                                rel_tol=layout_rtol)


def test_router_loads_add_up_to_tokens_times_top_k_in_both_layouts(runs):
    spec = _spec()
    tokens = spec.batch * spec.seq * 2  # two micro-batches: one rank, or one on each of two
    for run in (runs["ep1"][0], *runs["ep2"]):
        for step, want in zip(run["steps"], runs["ep1"][0]["steps"]):
            m = step["metrics"]
            for layer in range(LAYERS):
                router = f"router/decoder.layers.{layer}.mlp.router"
                loads = [m[f"{router}/load/{e}"] for e in range(EXPERTS)]
                assert sum(loads) == tokens * TOP_K and m[f"{router}/tokens"] == tokens
                assert loads == [want["metrics"][f"{router}/load/{e}"] for e in range(EXPERTS)]
                assert math.isclose(m[f"{router}/entropy"], want["metrics"][f"{router}/entropy"], rel_tol=1e-5)
            assert not step["alerts"]


def test_per_expert_statistics_equal_the_gathered_truth(runs):
    """Each expert's statistics on every rank equal those of its tensors (a GroupedMLP's: its
    piece), computed on the rank holding it, gathered over the expert-parallel group."""
    for run in runs.values():
        for step in range(STEPS):
            truth = {k: v for rank in run for k, v in rank["steps"][step]["truth"].items()}
            assert len(truth) == LAYERS * EXPERTS * 2 * 3 * 4  # layers x experts x weights x kinds x stats
            for rank in run:
                got = rank["steps"][step]["metrics"]
                for tag, want in truth.items():
                    base, _, stat = tag.rpartition("/")
                    assert math.isclose(got[tag], want, rel_tol=RTOL, abs_tol=_tolerance(got, tag)), tag
