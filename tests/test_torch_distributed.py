"""TorchMonitor under PyTorch's own data parallelism, on CPU with gloo.

The layout invariance test trains the same float64 model on the same batch on 1 rank, with
DDP on 2 ranks, FSDP2 on 2 ranks and HSDP on a 2x2 mesh (4 ranks): at step 0 every
statistic (per-parameter gradients, parameters, AdamW moments, activations, the loss and the
global grad norm) must equal the single-process one within 1e-6 relative, with the same tags.
The same runs also check the `misreported_grad_norm` rule (a loop that reports the norm of
its local shards at step 1) and the `replica_drift` rule (one replica's weight perturbed after
step 0); the 2-rank run also wraps the model in FSDP1 and in a custom wrapper, which the
monitor does not understand: a warning, nothing merged.
"""
from __future__ import annotations

import math

import pytest

from tests.multiproc import run_ranks

BATCH, STEPS = 8, 2


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()


def _config(out: str) -> dict:
    return {"output_dir": out, "strict": True, "sinks": [], "incidents": {"enabled": False},
            "watch": {"params": True, "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
            "alerts": [{"rule": "misreported_grad_norm"}, {"rule": "replica_drift", "every": 1, "bucket_numel": 1}]}


def _local_shard_norm(model):
    """The classic bug: the norm of this rank's shards only (no reduction over the ranks)."""
    import torch
    from msprobe_engine.frameworks.torch.fsdp import local_tensor
    return torch.linalg.vector_norm(torch.stack([local_tensor(p.grad).norm() for p in model.parameters()]))


def _full_grad_norms(model) -> dict:
    """Each parameter's gradient norm from the whole gradient (gathered: the independent truth)."""
    return {name: float(getattr(p.grad, "full_tensor", lambda: p.grad)().norm())
            for name, p in model.named_parameters() if p.grad is not None}


def _train(model, out: str, rank: int, dp: int, misreport: bool = False, perturb: str = "", micro: int = 1) -> dict:
    """Two steps on this rank's slice of a fixed batch (in `micro` micro-batches); rank 0's
    records and alerts."""
    import torch
    from msprobe_engine.frameworks.torch.fsdp import local_tensor
    from msprobe_integrations.torch import TorchMonitor

    gen = torch.Generator().manual_seed(1)
    data, target = (torch.randn(BATCH, 4, generator=gen, dtype=torch.float64),
                    torch.randn(BATCH, 2, generator=gen, dtype=torch.float64))
    part = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TorchMonitor(model, opt, _config(out))
    dtype = next(model.parameters()).dtype
    data, target = data.to(dtype), target.to(dtype)
    truth = {}
    merge_calls = _MergeCalls()
    for step in range(STEPS):
        for i, (x, y) in enumerate(zip(data[part].chunk(micro), target[part].chunk(micro))):
            if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last one
                model.set_requires_gradient_sync(i == micro - 1)
            loss = (model(x) - y).pow(2).mean() / micro
            loss.backward()
        truth = truth or _full_grad_norms(monitor.wrapping.inner)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=100.0)
        monitor.report_grad_norm(_local_shard_norm(model) if misreport and step == 1 else norm, max_norm=100.0)
        opt.step()
        opt.zero_grad()
        monitor.step_end(loss.detach())
        if step == 0 and perturb:  # this rank's copy only (a DTensor op would be a collective)
            with torch.no_grad():
                local_tensor(dict(monitor.wrapping.inner.named_parameters())[perturb]).view(-1)[0] += 1e-3
    merge_calls.close()
    monitor.close()
    return {"metrics": [r.metrics for r in monitor.history], "transfers": monitor.transfers, "truth": truth,
            "merge_calls": merge_calls.calls,
            "alerts": [(e.rule, e.step, e.tag, e.also) for e in monitor.alert_log if e.phase == "start"],
            "warnings": sorted(monitor._warned), "reducer": type(monitor.reducer).__name__}


class _MergeCalls:
    """Counts the statistics merge's collectives (`distributed._all_reduce`) until `close`."""

    def __init__(self) -> None:
        from msprobe_engine.frameworks.torch import distributed
        self.module, self.original, self.calls = distributed, distributed._all_reduce, 0

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        distributed._all_reduce = counting

    def close(self) -> None:
        self.module._all_reduce = self.original


def _rank_batch(rank: int, dp: int):
    """This data-parallel rank's part of the float64 batch the incident tests share."""
    import torch

    gen = torch.Generator().manual_seed(1)
    data, target = (torch.randn(BATCH, 4, generator=gen, dtype=torch.float64),
                    torch.randn(BATCH, 2, generator=gen, dtype=torch.float64))
    part = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    return data[part], target[part]


def _nan_at_step1_on_rank0(model, rank: int, step_of) -> None:
    """On rank 0, one element of the first layer's output turns nan while `step_of()` is 1 (the
    step and its replay; a hook registered before the monitor's: they see the nan)."""
    def corrupt(module, args, output):
        if step_of() == 1 and rank == 0:
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output

    getattr(model, "module", model)[0].register_forward_hook(corrupt)


def _replay(model, out: str, rank: int, dp: int) -> dict:
    """Three steps through `monitor.run_step`; at step 1 one element of the first layer's output
    (row 0 of the batch: rank 0's) turns nan, a `skip` rule fires and the step is replayed.
    The incident's replay checks, and what each step changed."""
    import json
    from pathlib import Path

    import torch
    from msprobe_integrations.torch import TorchMonitor

    data, target = _rank_batch(rank, dp)
    monitor = None
    _nan_at_step1_on_rank0(model, rank, lambda: monitor.step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"output_dir": out, "strict": True, "sinks": [], "watch": {"params": True},
              "alerts": [{"rule": "non_finite", "action": "skip"}]}
    monitor = TorchMonitor(model, opt, config)

    def train_step(x, y):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for _ in range(3):
        monitor.run_step(train_step, data, target)
    monitor.close()
    folder = Path(out) / "incidents" / f"step1-rank{rank}-non_finite"
    incident = json.loads((folder / "incident.json").read_text())
    dumped = json.loads(next(folder.glob("replay/step1/*/dump.json")).read_text())["data"]
    return {"replay": incident["replay"], "culprit": incident["culprit"]["first_bad"], "dumped": sorted(dumped),
            "metrics": [r.metrics for r in monitor.history]}


def _per_rank_skip(model, out: str, rank: int, world: int) -> dict:
    """DDP with `per_rank: true` (each rank's rules see its own activations) and a `skip` rule:
    a nan in rank 0's activations at step 1 only. What each rank decided, its weights after
    three steps and the replica check's alerts."""
    import torch
    from msprobe_integrations.torch import TorchMonitor

    data, target = _rank_batch(rank, world)
    monitor = None
    _nan_at_step1_on_rank0(model, rank, lambda: monitor.step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"output_dir": out, "strict": True, "sinks": [], "per_rank": True,
              "alerts": [{"rule": "non_finite", "targets": ["actv"], "action": "skip"},
                         {"rule": "replica_drift", "every": 1, "bucket_numel": 1}]}
    monitor = TorchMonitor(model, opt, config)
    for _ in range(3):
        loss = (model(data) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step_end(loss.detach())
    monitor.close()
    return {"skipped": [r.metrics["train/skipped"] for r in monitor.history],
            "alerts": [(e.rule, e.step) for e in monitor.alert_log if e.phase == "start"],
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            "warnings": sorted(monitor._warned)}


def _two_ranks(rank: int, world: int, out: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    results = {"ddp": _train(DistributedDataParallel(_model()), f"{out}/ddp", rank, world,
                             perturb="2.weight" if rank == 1 else "")}
    results["ddp_per_rank_skip"] = _per_rank_skip(DistributedDataParallel(_model()), f"{out}/per_rank", rank,
                                                  world)
    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    results["fsdp2"] = _train(model, f"{out}/fsdp2", rank, world, misreport=True)
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results["fsdp2_replay"] = _replay(model, f"{out}/fsdp2_replay", rank, world)
    model = _model().float()  # bf16 compute, fp32 shards and reduce-scatter, 2 micro-batches
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    results["fsdp2_mp"] = _train(model, f"{out}/fsdp2_mp", rank, world, micro=2)

    class Wrapper(torch.nn.Module):  # a wrapper the monitor does not know
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    results["custom"] = _train(Wrapper(_model()), f"{out}/custom", rank, world)
    results["fsdp1"] = _train(FullyShardedDataParallel(_model(), device_id=torch.device("cpu")), f"{out}/fsdp1",
                              rank, world)
    dist.destroy_process_group()
    return results


def _four_ranks(rank: int, world: int, out: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    model = _model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    # rank 3 holds the same shards as rank 1 (coordinates (1, 1) and (0, 1)): perturb its copy
    results = {"hsdp": _train(model, f"{out}/hsdp", rank, world, perturb="0.bias" if rank == 3 else "")}
    # tensor parallel over "tp" (a column- then a row-parallel Linear), FSDP2 over "dp"; the two
    # ranks of a TP pair see the same half of the batch
    model = _model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    results["tp_fsdp2"] = _train(model, f"{out}/tp_fsdp2", rank // 2, 2)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("torch_distributed")
    two = run_ranks(_two_ranks, 2, str(out / "two"), timeout=240)
    return {"single": _train(_model(), str(out / "single"), 0, 1), **two[0],
            "single_replay": _replay(_model(), str(out / "single_replay"), 0, 1),
            "fsdp2_replay_rank1": two[1]["fsdp2_replay"],
            "per_rank_skip": [two[r]["ddp_per_rank_skip"] for r in (0, 1)],
            **run_ranks(_four_ranks, 4, str(out / "four"), timeout=240)[0]}


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b)) or abs(a - b) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "hsdp", "tp_fsdp2"])
def test_statistics_equal_the_single_process_ones(runs, layout):
    reference, got = runs["single"]["metrics"][0], runs[layout]["metrics"][0]
    assert set(got) == set(reference)
    assert {t.split("/")[0] for t in got} >= {"grad", "param", "optim", "actv", "train"}
    # the step's update (after - before, on the shards under FSDP2) and update/param ratio too
    assert {"optim/0.weight/update/norm", "optim/0.weight/ratio", "optim/2.bias/ratio"} <= set(got)
    timings = {t for t in reference if t.endswith("_ms")}  # the monitor's host time (Health/monitor_ms)
    wrong = {t: (got[t], reference[t]) for t in set(reference) - timings if not _close(got[t], reference[t])}
    assert not wrong, wrong
    assert runs[layout]["reducer"] == "DataParallelMerge"
    assert runs[layout]["transfers"] == STEPS  # one packed transfer per step
    assert runs[layout]["merge_calls"] == 2 * STEPS  # one SUM and one MAX all-reduce, with one group or two


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp2", "fsdp2_mp", "hsdp", "tp_fsdp2"])
def test_gradient_norms_equal_those_of_the_gathered_gradients(runs, layout):
    """Merged from shards (or taken once from copies), each gradient's norm is the full one's."""
    metrics, truth = runs[layout]["metrics"][0], runs[layout]["truth"]
    assert len(truth) == 4
    wrong = {n: (metrics[f"grad/{n}/norm"], v) for n, v in truth.items() if not _close(metrics[f"grad/{n}/norm"], v)}
    assert not wrong, wrong
    if layout == "fsdp2_mp":  # and clip_grad_norm_'s norm of bf16-computed grads is the merged one
        assert not runs[layout]["alerts"] and runs[layout]["metrics"][0]["train/reported_grad_norm"] > 0


@pytest.mark.slow
def test_fsdp2_gradients_are_sharded_yet_merged(runs):
    """The local shard norm differs from the merged one: the merge is what makes them equal."""
    metrics = runs["fsdp2"]["metrics"][1]
    assert metrics["train/reported_grad_norm"] < 0.9 * metrics["grad/global/norm"]


@pytest.mark.slow
def test_a_loop_reporting_its_local_shard_norm_is_caught(runs):
    assert [(rule, step) for rule, step, *_ in runs["fsdp2"]["alerts"]] == [("misreported_grad_norm", 1)]
    for layout in ("single", "ddp", "hsdp", "tp_fsdp2"):  # clip_grad_norm_'s own return is the true norm
        assert not [a for a in runs[layout]["alerts"] if a[0] == "misreported_grad_norm"], layout


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_an_fsdp2_step_replay_reproduces_the_single_process_one(runs, rank):
    """Both ranks replay the step whose merged rows fired (the nan was in rank 0's data only);
    the replay's statistics are merged like the step's, so they equal the single process's."""
    single, fsdp2 = runs["single_replay"], runs["fsdp2_replay" if rank == 0 else "fsdp2_replay_rank1"]
    assert single["replay"]["status"] == fsdp2["replay"]["status"] == "reproducible"
    assert fsdp2["culprit"] == single["culprit"] == "actv/0/output"
    checks = [(c["tag"], c["value"], c["replay_value"], c["identical"]) for c in fsdp2["replay"]["checks"]]
    assert checks == [(c["tag"], c["value"], c["replay_value"], c["identical"]) for c in single["replay"]["checks"]]
    # the replay's dump: every module's forward and backward, as on one rank (FSDP2 puts the
    # reduce-scattered gradients on the shards by assignment, which fires no parameters_grad hook)
    assert [n.replace("FSDPLinear", "Linear") for n in fsdp2["dumped"]] == [
        n for n in single["dumped"] if ".parameters_grad." not in n]
    assert [m["train/skipped"] for m in fsdp2["metrics"]] == [0.0, 1.0, 0.0]
    after = fsdp2["metrics"][2]  # the skipped step left no trace: the next step is the single process's
    wrong = {t: v for t, v in after.items() if t.startswith(("grad/", "param/", "train/loss"))
             and not _close(v, single["metrics"][2][t])}
    assert not wrong, wrong


@pytest.mark.slow
def test_per_rank_skip_decisions_are_made_collectively(runs):
    """per_rank: only rank 0's own rules see its nan; one all-reduce of the decision makes rank 1
    skip the same step, so the replicas stay bit-identical (the replica check stays silent)."""
    ranks = runs["per_rank_skip"]
    for rank, result in enumerate(ranks):
        assert result["skipped"] == [0.0, 1.0, 0.0], rank
        assert ("replica_drift", 1) not in result["alerts"] and ("replica_drift", 2) not in result["alerts"]
    assert [a for a in ranks[0]["alerts"] if a[0] == "non_finite"] == [("non_finite", 1)]
    assert not [a for a in ranks[1]["alerts"] if a[0] == "non_finite"]  # rank 1's own rows were clean
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert all(math.isfinite(w) for w in ranks[1]["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("layout, rank, param", [("ddp", 1, "2.weight"), ("hsdp", 3, "0.bias")])
def test_a_perturbed_replica_raises_an_alert_naming_it(runs, layout, rank, param):
    drift = [a for a in runs[layout]["alerts"] if a[0] == "replica_drift"]
    assert drift == [("replica_drift", 1, f"train/replica_drift/rank{rank}/{param}", ())]
    assert not [a for a in runs["fsdp2"]["alerts"] if a[0] == "replica_drift"]


@pytest.mark.slow
@pytest.mark.parametrize("layout, named", [("custom", "test_torch_distributed.Wrapper"),
                                           ("fsdp1", "FullyShardedDataParallel (FSDP1) at the root")])
def test_an_unknown_wrapper_is_warned_about_and_not_merged(runs, layout, named):
    result = runs[layout]
    assert result["reducer"] == "NoneType"
    warning = next(w for w in result["warnings"] if "NOTHING is merged" in w)
    assert named in warning and "rank 0's own local numbers" in warning
    # rank 0's own half batch: its loss differs from the whole batch's
    assert result["metrics"][0]["train/loss"] != runs["single"]["metrics"][0]["train/loss"]


def test_single_process_without_distributed_has_no_reducer(tmp_path):
    result = _train(_model(), str(tmp_path), 0, 1)
    assert result["reducer"] == "NoneType"
    assert any("no replicas to compare" in w for w in result["warnings"])
    assert not result["alerts"]


def test_the_misreported_norm_rule_allows_for_clipping():
    import numpy as np
    from msprobe_engine.rules.misreported_grad_norm import MisreportedGradNormRule
    from msprobe_engine.stats.table import StatTable

    rule = MisreportedGradNormRule(MisreportedGradNormRule.Config(rule="misreported_grad_norm"))
    table = StatTable([], np.zeros((0, 8)))
    clipped = {"grad/global/norm": 1.0, "train/reported_grad_norm": 7.0, "train/grad_clip_max_norm": 1.0}
    assert rule.evaluate(table, {}, clipped) == []
    assert rule.evaluate(table, {}, {"grad/global/norm": 1.0, "train/reported_grad_norm": 7.0})
    low = rule.evaluate(table, {}, {**clipped, "train/reported_grad_norm": 0.5})
    assert [(f.value, f.threshold) for f in low] == [(0.5, 1.0)]


def test_drift_is_named_against_the_majority_of_the_replicas():
    import torch
    from msprobe_engine.frameworks.torch.replica_drift import checksum, drifting

    hashes = torch.tensor([[1, 2], [1, 3], [1, 2]])
    assert drifting(hashes, [()] * 3) == {1: [1]}
    assert drifting(torch.tensor([[5], [6]]), [()] * 2) == {1: [0]}  # a tie: the lowest rank's value
    # HSDP 2x2: ranks 0/2 and 1/3 hold the same shards; rank 0 and 1 differ from each other legitimately
    assert drifting(torch.tensor([[1], [9], [1], [8]]), [(0,), (1,), (0,), (1,)]) == {3: [0]}
    weights = torch.randn(64)
    flipped = weights.clone()
    flipped.view(torch.int32)[7] ^= 1  # one flipped low mantissa bit
    assert checksum(weights) != checksum(flipped) and checksum(weights) == checksum(weights.clone())


def test_a_norm_known_only_after_the_step_is_checked_when_a_skip_rule_decides_before_it(tmp_path):
    """DeepSpeed's and Megatron's norms come after their optimizer step, while a skip rule makes
    the monitor decide before it: misreported_grad_norm (a whole-step rule) is evaluated after
    the step on the step's rows together, so a norm reported then is still checked; its `stop`
    takes effect at the next step's decision."""
    import torch
    from msprobe_engine.incident import TrainingStopped
    from msprobe_integrations.torch import TorchMonitor

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {**_config(str(tmp_path)), "alerts": [{"rule": "non_finite", "action": "skip"},
                                                    {"rule": "misreported_grad_norm", "action": "stop"}]}
    monitor = TorchMonitor(model, opt, config)
    assert monitor.monitor.decide_early
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 4, generator=gen).double(), torch.randn(BATCH, 2, generator=gen).double()
    steps_done = 0
    with pytest.raises(TrainingStopped, match="misreported_grad_norm") as stopped:
        for step in range(4):
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            opt.step()
            monitor.report_grad_norm(norm * (2.0 if step == 1 else 1.0))  # after the step; wrong at step 1
            opt.zero_grad()
            monitor.step_end(loss.detach())
            steps_done += 1
    monitor.close()
    assert stopped.value.step == 2 and steps_done == 2  # in step 2's optimizer.step(), before the update
    assert [(e.rule, e.step) for e in monitor.alert_log if e.phase == "start"] == [("misreported_grad_norm", 1)]
    assert [r.step for r in monitor.history][:2] == [0, 1]
    assert all(r.metrics["train/reported_grad_norm"] > 0 for r in list(monitor.history)[:2])
