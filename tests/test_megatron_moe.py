"""Mixture of experts on real megatron-core (0.16.1 on 3.11, 0.19.2 in the 3.12 lane; CPU, gloo):
a tiny GPT whose MLPs are 4 experts with top-2 routing, trained with expert parallelism 1
(one rank, both micro-batches) and 2 (two ranks, one micro-batch each, experts 0-1 on rank 0
and 2-3 on rank 1). Every expert's gradient, weight and Adam moments are reported under its
global number, merged over the expert-parallel group, and equal in both layouts; the routers'
loads add up to tokens x top-k exactly and are the same in both."""
from __future__ import annotations

import math

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow

STEPS = 3
EXPERTS, TOP_K, LAYERS = 4, 2, 2
RTOL = 1e-6
CONFIG = {"strict": True, "sinks": ["jsonl"], "stats": ["min", "max", "mean", "norm", "numel"],
          "watch": {"params": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
          "alerts": [{"rule": "non_finite"}, {"rule": "expert_collapse"}]}


def _spec():
    from tests import megatron_helpers as H
    return H.TinySpec(hidden=32, experts=EXPERTS)


def _train(rank: int, world: int, out: str) -> dict:
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.init_parallel(ep=world)
    model = H.wrap_ddp(H.build_gpt(_spec()))
    optimizer = H.build_optimizer([model])
    monitor = MegatronMonitor([model], optimizer, config={**CONFIG, "output_dir": out})
    steps = []
    for step in range(STEPS):
        batches = H.micro_batches(_spec(), 2, seed=step)
        loss, _, _ = H.train_step(model, optimizer, batches[rank:rank + 1] if world > 1 else batches)
        record = monitor.step_end(loss)
        steps.append({"metrics": record.metrics, "alerts": [a.as_dict() for a in record.alerts]})
    monitor.close()
    return {"steps": steps, "local": sorted({n.split(".local_experts.")[1].split(".")[0]
                                             for n, _ in model.module.named_parameters() if ".local_experts." in n})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_moe")
    return {"ep1": run_ranks(_train, 1, str(out / "ep1"), timeout=180),
            "ep2": run_ranks(_train, 2, str(out / "ep2"), timeout=240)}


def _expert_tags(metrics: dict) -> dict[str, float]:
    return {t: v for t, v in metrics.items() if ".experts.local_experts." in t and t.split("/")[0] in ("grad", "param", "optim")}


def test_expert_parallel_ranks_hold_their_experts_and_report_all_under_global_numbers(runs):
    assert [r["local"] for r in runs["ep2"]] == [["0", "1"], ["0", "1"]]  # local positions on each rank
    tags = _expert_tags(runs["ep2"][0]["steps"][0]["metrics"])
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for kind in ("grad", "param"):
                assert f"{kind}/decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight/norm" in tags
            assert f"optim/decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight/exp_avg/norm" in tags


def _tolerance(metrics: dict, tag: str) -> float:
    """Norms and counts: 1e-6 of the value. Min, max and mean: 1e-6 of the tensor's rms (an
    element near zero, or a mean of values of both signs, is a difference of rounded numbers)."""
    base, _, stat = tag.rpartition("/")
    if stat not in ("min", "max", "mean"):
        return 0.0
    base += "/"
    return RTOL * metrics[base + "norm"] / math.sqrt(metrics[base + "numel"])


def test_per_expert_statistics_equal_in_both_layouts(runs):
    """EP=2 (merged over the expert-parallel group) equals EP=1 within 1e-6 relative: the two
    layouts differ only in the order float32 sums run in (an expert sees both micro-batches in
    one pass under EP=2)."""
    for rank_result in runs["ep2"]:
        for got, want in zip(rank_result["steps"], runs["ep1"][0]["steps"]):
            reference = _expert_tags(want["metrics"])
            assert reference and set(_expert_tags(got["metrics"])) == set(reference)
            for tag, value in reference.items():
                assert math.isclose(got["metrics"][tag], value, rel_tol=RTOL,
                                    abs_tol=_tolerance(want["metrics"], tag)), tag
            assert math.isclose(got["metrics"]["grad/global/norm"], want["metrics"]["grad/global/norm"], rel_tol=RTOL)


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
