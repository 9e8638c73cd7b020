"""The odd rank named without a gather: DDP on 4 gloo ranks, a nan in one rank's activations
(step 1) and a 40x gradient on another rank after DDP's all-reduce (step 3, a replica gone wrong):
every rank's `rank_outlier` alert and incident name the rank, from the spread that travels in
the merge's all-reduces; the merge's bytes do not grow with the world."""
from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

NAN_RANK, NAN_STEP, GRAD_RANK, GRAD_STEP, STEPS = 2, 1, 1, 3, 5


def _ddp(rank: int, world: int, out: str) -> dict:
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from msprobe_engine.frameworks.torch import distributed as torch_distributed
    from msprobe_integrations.torch import TorchMonitor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                        torch.nn.Linear(8, 2)).double())
    monitor = None

    def corrupt(module, args, output):
        if monitor.step == NAN_STEP and rank == NAN_RANK:
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output

    model.module[0].register_forward_hook(corrupt)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = {"output_dir": out, "strict": True, "sinks": [],  # the nan step skipped: no nan weights after it
              "alerts": [{"rule": "rank_outlier", "factor": 10.0}, {"rule": "non_finite", "action": "skip"}]}
    monitor = TorchMonitor(model, opt, config)
    calls, sent = [], []
    original = torch_distributed._all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(monitor.step)
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    torch_distributed._all_reduce = counting
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(STEPS):
            x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
            loss = model(x).pow(2).mean()
            loss.backward()
            if step == GRAD_STEP and rank == GRAD_RANK:  # after DDP's all-reduce: this replica only
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.mul_(40.0)
            opt.step()
            opt.zero_grad()
            monitor.step_end(loss.detach())
        monitor.close()
    finally:
        torch_distributed._all_reduce = original
    incidents = {p.parent.name: json.loads(p.read_text()) for p in Path(out).rglob("incident.json")
                 if f"-rank{rank}-" in p.parent.name}
    own = {p.parent.name: [json.loads(line) for line in p.read_text().splitlines()]
           for p in Path(out).rglob("own_rows.jsonl") if f"-rank{rank}-" in p.parent.name}
    dist.destroy_process_group()
    return {"merged_norms": [r.metrics["grad/global/norm"] for r in monitor.history],
            "alerts": [(e.step, e.tag, e.value) for e in monitor.alert_log
                       if e.phase == "start" and e.rule == "rank_outlier"],
            "incidents": {name: (i["tensor"], i.get("ranks", {}).get("said")) for name, i in incidents.items()},
            "calls": calls, "sent": sent,
            "own": {name: {line["step"]: {t: v for t, v in line["metrics"].items()
                                          if t in ("actv/0/output/nan_count", "grad/global/norm")}
                           for line in lines} for name, lines in own.items()}}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(_ddp, 4, str(tmp_path_factory.mktemp("rank_outlier")), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(4))
def test_every_rank_names_the_rank_holding_the_nan_and_the_40x_gradient(four, rank):
    alerts = four[rank]["alerts"]
    assert (NAN_STEP, f"ranks/rank{NAN_RANK}/nonfinite") in [(s, t) for s, t, _ in alerts]
    grad = [(s, v) for s, t, v in alerts if t == f"ranks/rank{GRAD_RANK}/grad_norm"]
    assert grad and grad[0][0] == GRAD_STEP and grad[0][1] == pytest.approx(40.0, rel=1e-6)
    assert len(alerts) == 2, alerts  # one alert per event
    said = {name: words for name, (_, words) in four[rank]["incidents"].items()}
    for rule in ("rank_outlier", "non_finite"):  # any incident of the step names the rank
        nan = said[f"step{NAN_STEP}-rank{rank}-{rule}"]
        assert nan[0].startswith(f"rank {NAN_RANK} of 4 holds the nan"), nan
    grad_said = said[f"step{GRAD_STEP}-rank{rank}-rank_outlier"]
    assert any(w.startswith(f"rank {GRAD_RANK}'s gradient norm is 40x the mean of the 2 ranks between the extremes")
               for w in grad_said), grad_said


@pytest.mark.slow
def test_two_all_reduces_per_monitored_step_of_a_size_independent_of_the_world(four):
    calls = four[0]["calls"]
    assert [calls.count(step) for step in range(STEPS)] == [2] * STEPS
    assert len(set(four[0]["sent"][:2])) == 2 and four[0]["sent"][:2] == four[3]["sent"][:2]


@pytest.mark.slow
def test_the_named_rank_alone_writes_its_own_rows_into_its_incident(four):
    for rank in range(4):
        own = four[rank]["own"]
        named = {f"step{NAN_STEP}-rank{rank}-rank_outlier"} if rank == NAN_RANK else set()
        named |= {f"step{GRAD_STEP}-rank{rank}-rank_outlier"} if rank == GRAD_RANK else set()
        assert {name for name in own if "rank_outlier" in name} == named, own.keys()
    nan_rows = four[NAN_RANK]["own"][f"step{NAN_STEP}-rank{NAN_RANK}-rank_outlier"]
    assert nan_rows[NAN_STEP]["actv/0/output/nan_count"] == 1  # its own rows: the nan is its
    grad_rows = four[GRAD_RANK]["own"][f"step{GRAD_STEP}-rank{GRAD_RANK}-rank_outlier"]
    merged = four[0]["merged_norms"][GRAD_STEP]
    assert grad_rows[GRAD_STEP]["grad/global/norm"] == pytest.approx(40 * merged, rel=1e-9)  # the 40x copy
