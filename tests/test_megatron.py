"""MegatronMonitor on real megatron-core (0.16.1; 0.19.2 in the 3.12 lane; CPU, gloo, tiny GPTModel;
see megatron_helpers).

Two process launches: world 1 (the single-process references, with and without self-attention,
Megatron's nan check in both re-run modes, bad input) and world 2 (TP=2, DP=2 with and without the
distributed optimizer, torch FSDP2 (0.19.2), PP=2, CP=2 without self-attention, the EP x CP
refusal), each running several configurations in turn. Tolerances: statistics are
accumulated in float32 and merged in float64, so norms of the same gradients
computed from a different split agree to a relative 1e-5.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.multiproc import run_ranks
from tests.sink_helpers import EVERY_TAG_TENSORBOARD, untimed

pytestmark = pytest.mark.slow

STEPS = 3
LAYER_K = 1  # the layer the nan is injected into (global number, 0-based)
RTOL = 1e-5
STATS = ["min", "max", "mean", "norm", "nan_count", "inf_count", "numel"]
FULL_WATCH = {"activation_grads": True, "params": True,
              "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]}
#: Megatron's own grad norm (what `optimizer.step()` returns) checked against the merged one
MISREPORTED = {"rule": "misreported_grad_norm", "tolerance": 1e-5}
DEFAULT_RULES = [{"rule": "non_finite"}, {"rule": "spike"}]  # the config's default alerts
REPORTED = "train/reported_grad_norm"


# ---- what runs in the ranks -------------------------------------------------------------------

def _config(out: str, name: str, **extra) -> dict:
    return {"output_dir": str(Path(out) / name), "strict": True, "sinks": ["jsonl", EVERY_TAG_TENSORBOARD], "stats": STATS,
            "watch": FULL_WATCH, "alerts": [*DEFAULT_RULES, MISREPORTED], **extra}


def _batches(step: int) -> list:
    from tests import megatron_helpers as H
    return H.micro_batches(H.TinySpec(), 2, seed=step)


def _full(tensor):
    """The whole tensor: a DTensor (torch FSDP2's shards) gathered, in float64."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).double()


def _grad_reference(model) -> dict:
    """Full-precision statistics of every parameter's reduced gradient (DDP's main_grad, FSDP2's
    sharded .grad gathered)."""
    out = {}
    for name, p in model.module.named_parameters():
        g = _full(p.main_grad if hasattr(p, "main_grad") else p.grad)
        out[name] = {"norm": g.norm().item(), "numel": g.numel(), "min": g.min().item(), "max": g.max().item()}
    return out


def _exp_avg_reference(model, optimizer) -> dict:
    inner = optimizer.chained_optimizers[0].optimizer
    return {name: _full(inner.state[p]["exp_avg"]).norm().item() for name, p in model.module.named_parameters()}


def _after_step_reference(model, optimizer) -> dict:
    """The norms of every weight and of Adam's exp_avg_sq after the step, gathered."""
    inner = optimizer.chained_optimizers[0].optimizer
    return {name: {"param": _full(p.detach()).norm().item(), "exp_avg_sq": _full(inner.state[p]["exp_avg_sq"]).norm().item()}
            for name, p in model.module.named_parameters()}


@contextlib.contextmanager
def _counting_gathers() -> Iterator[list[int]]:
    """Count the monitor's merges over a group (two all-reduces each: the only collectives it
    issues); `calls[0]` is the count of merges once the block ends."""
    from msprobe_engine.frameworks.torch import distributed as torch_distributed
    calls = [0]
    original = torch_distributed._all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    torch_distributed._all_reduce = counting
    try:
        yield calls
    finally:
        torch_distributed._all_reduce = original
        calls[0] //= 2


def _train(out: str, name: str, batches_of, *, distributed_optimizer: bool = False,
           reference: bool = False, nan_step: int | None = None, local_norm: bool = False,
           torch_fsdp: bool = False, spec=None) -> dict:
    """Train STEPS (+1 with `nan_step`) steps of the tiny GPT under a MegatronMonitor.
    `local_norm`: Megatron's grad norm is reduced over a group of this rank alone (the
    tensor-parallel group, of size 1 here) instead of every rank: with the distributed
    optimizer, the norm of this rank's shard only. `torch_fsdp`: wrapped in Megatron's
    TorchFullyShardedDataParallel instead of its DDP. `spec`: the model (default `TinySpec()`)."""
    from megatron.core import parallel_state
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    gpt = H.build_gpt(spec or H.TinySpec())
    model = H.wrap_torch_fsdp(gpt) if torch_fsdp else H.wrap_ddp(gpt, distributed_optimizer=distributed_optimizer)
    optimizer = H.build_optimizer([model])
    if local_norm:
        optimizer.chained_optimizers[0].grad_stats_parallel_group = parallel_state.get_tensor_model_parallel_group()
    monitor = MegatronMonitor([model], optimizer, config=_config(out, name))
    steps = []
    with _counting_gathers() as gathers:
        for step in range(STEPS + (nan_step is not None)):
            if step == nan_step:
                H.inject_nan(model, LAYER_K)
            ref: dict = {}
            after = (lambda: ref.update(grads=_grad_reference(model))) if reference else None
            loss, grad_norm, _ = H.train_step(model, optimizer, batches_of(step), after_backward=after)
            record = monitor.step_end(loss)
            steps.append({"metrics": record.metrics, "alerts": [a.as_dict() for a in record.alerts],
                          "micro_steps": record.micro_steps, "megatron_grad_norm": grad_norm,
                          "loss": None if loss is None else float(loss), **ref,
                          **({"exp_avg": _exp_avg_reference(model, optimizer),
                              "after_step": _after_step_reference(model, optimizer)} if reference else {})})
    monitor.close()
    return {"steps": steps, "gathers": gathers[0]}


def _nan_check_run(out: str) -> dict:
    """Megatron's own nan check raises on the nan loss: the step must be on disk by then."""
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.fresh_rerun_engine()
    model = H.wrap_ddp(H.build_gpt(), check_for_nan_in_grad=True)
    optimizer = H.build_optimizer([model])
    config = _config(out, "nan_check", alerts=[{"rule": "non_finite", "action": "stop"}, MISREPORTED])
    monitor = MegatronMonitor([model], optimizer, config=config)
    jsonl = Path(out) / "nan_check" / "rank0" / "metrics.jsonl"
    result = {"error": None}
    for step in range(STEPS):
        if step == STEPS - 1:
            H.inject_nan(model, LAYER_K)
        try:
            loss, _, _ = H.train_step(model, optimizer, _batches(step), check_nan=True)
        except RuntimeError as error:
            incidents = Path(out) / "nan_check" / "incidents"
            result = {"error": str(error), "on_disk": jsonl.read_text().splitlines(),
                      "incidents": sorted(p.name for p in incidents.iterdir()) if incidents.is_dir() else []}
            break
        monitor.step_end(loss)
    monitor.close()
    return result


def _rerun_exit_run(out: str) -> dict:
    """Megatron's re-run engine (Megatron-LM's default --rerun-mode validate_results) re-runs
    the nan step and asks train_step to exit: the step must be on disk when train_step returns."""
    from megatron.core.rerun_state_machine import RerunMode
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.fresh_rerun_engine(RerunMode.VALIDATE_RESULTS)
    model = H.wrap_ddp(H.build_gpt())
    optimizer = H.build_optimizer([model])
    monitor = MegatronMonitor([model], optimizer, config=_config(out, "rerun_exit"))
    jsonl = Path(out) / "rerun_exit" / "rank0" / "metrics.jsonl"
    result: dict = {"exit_step": None}
    for step in range(STEPS):
        if step == STEPS - 1:
            H.inject_nan(model, LAYER_K)
        loss, _, should_exit = H.train_step(model, optimizer, _batches(step), check_nan=True)
        if should_exit:
            result = {"exit_step": step, "on_disk": jsonl.read_text().splitlines()}
        monitor.step_end(loss)
        if should_exit:
            break
    monitor.close()
    return result


def _skip_run(out: str) -> dict:
    """A `skip` rule: the nan step's update is skipped through Megatron's own prepare_grads."""
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.fresh_rerun_engine()
    model = H.wrap_ddp(H.build_gpt())
    optimizer = H.build_optimizer([model])
    config = _config(out, "skip", alerts=[{"rule": "non_finite", "targets": ["grad"], "action": "skip"}, MISREPORTED])
    monitor = MegatronMonitor([model], optimizer, config=config)
    weight = model.module.output_layer.weight
    changed, norms = [], []
    for step in range(STEPS):
        if step == STEPS - 1:
            H.inject_nan(model, LAYER_K)
        before = weight.detach().clone()
        _, grad_norm, _ = H.train_step(model, optimizer, _batches(step))
        monitor.step_end()
        changed.append(not bool((weight == before).all()))
        norms.append(grad_norm)
    monitor.close()
    return {"changed": changed, "megatron_grad_norms": norms,
            "skipped": [r.metrics["train/skipped"] for r in monitor.history],
            "metrics": [r.metrics for r in monitor.history],
            "alerts": [(e.rule, e.step) for e in monitor.alert_log if e.phase == "start"]}


def _bad_input(out: str) -> dict:
    import torch
    from megatron.core.optimizer import MegatronOptimizer
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    errors = {}
    model = H.wrap_ddp(H.build_gpt())
    optimizer = H.build_optimizer([model])
    for case, args in {"not a module": ("gpt", optimizer), "no chunks": ([], optimizer),
                       "not an optimizer": ([model], object())}.items():
        try:
            MegatronMonitor(*args, config=_config(out, "bad"))
        except (TypeError, ValueError) as error:
            errors[case] = f"{type(error).__name__}: {error}"
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("msprobe_engine").addHandler(handler)
    MegatronMonitor([torch.nn.Linear(4, 4)], None, config=_config(out, "bad")).close()
    half = [p for _, p in list(model.named_parameters())[::2]]
    MegatronMonitor([model], torch.optim.SGD(half, lr=0.1), config=_config(out, "bad")).close()
    abstract = {name: (lambda *a, **k: None) for name in MegatronOptimizer.__abstractmethods__}
    custom = type("CustomOptimizer", (MegatronOptimizer,), abstract)(None, optimizer.config)
    MegatronMonitor([model], custom, config=_config(out, "bad")).close()
    return {"errors": errors, "warnings": warnings}


def _expert_context_error(out: str) -> str:
    """Expert parallelism with context parallelism: refused when the monitor is built."""
    from tests import megatron_helpers as H
    from msprobe_integrations.megatron import MegatronMonitor

    H.init_parallel(cp=2, ep=2)
    model = H.wrap_ddp(H.build_gpt(H.TinySpec(hidden=32, experts=2, attention=False)))
    try:
        MegatronMonitor([model], H.build_optimizer([model]), config=_config(out, "ep_cp"))
    except ValueError as error:
        return str(error)
    return ""


def world1(rank: int, world: int, out: str) -> dict:
    from tests import megatron_helpers as H
    H.init_parallel()
    return {"main": _train(out, "world1", _batches, reference=True),
            "attention_free": _train(out, "attention_free", _batches, reference=True, spec=H.TinySpec(attention=False)),
            "nan_check": _nan_check_run(out),
            "rerun_exit": _rerun_exit_run(out), "skip": _skip_run(out), "bad_input": _bad_input(out)}


def world2(rank: int, world: int, out: str) -> dict:
    from tests import megatron_helpers as H
    results = {}
    H.init_parallel(tp=2)
    results["tp2"] = _train(out, "tp2", _batches)
    H.init_parallel()
    results["dp2_distributed"] = _train(out, "dp2_distributed", lambda s: _batches(s)[rank:rank + 1],
                                        distributed_optimizer=True)
    results["dp2_replicated"] = _train(out, "dp2_replicated", lambda s: _batches(s)[rank:rank + 1])
    results["dp2_local_norm"] = _train(out, "dp2_local_norm", lambda s: _batches(s)[rank:rank + 1],
                                       distributed_optimizer=True, local_norm=True)
    if H.torch_fsdp_trains():
        results["torch_fsdp2"] = _train(out, "torch_fsdp2", lambda s: _batches(s)[rank:rank + 1],
                                        reference=True, torch_fsdp=True)
    H.init_parallel(pp=2)
    results["pp2"] = _train(out, "pp2", _batches, nan_step=STEPS)
    H.init_parallel(cp=2)  # each rank half of every sequence (Megatron's attention needs TE under CP)
    results["cp2"] = _train(out, "cp2", _batches, spec=H.TinySpec(attention=False))
    results["ep_cp_error"] = _expert_context_error(out)
    return results


# ---- the launches (once per module) ------------------------------------------------------------

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def single(out) -> dict:
    return run_ranks(world1, 1, str(out), timeout=180)[0]


@pytest.fixture(scope="module")
def pair(out) -> list[dict]:
    return run_ranks(world2, 2, str(out), timeout=240)


# ---- helpers ----------------------------------------------------------------------------------

def _grads(metrics: dict, stat: str = "norm") -> dict[str, float]:
    return {tag[len("grad/"):-len(stat) - 1]: value for tag, value in metrics.items()
            if tag.startswith("grad/") and tag.endswith(f"/{stat}") and tag != "grad/global/norm"}


def _actv_paths(metrics: dict) -> set[str]:
    return {tag.split("/")[1] for tag in metrics if tag.startswith("actv/")}


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)


def _assert_matches_reference(run: dict, reference: dict, names: set[str] | None = None) -> None:
    """Per-parameter gradient statistics and Adam's exp_avg equal the single-process run's."""
    for step, (got, ref) in enumerate(zip(run["steps"], reference["steps"])):
        metrics = got["metrics"]
        for name in names or ref["grads"]:
            full = ref["grads"][name]
            assert metrics[f"grad/{name}/numel"] == full["numel"], (step, name)
            for stat in ("norm", "min", "max"):
                assert _close(metrics[f"grad/{name}/{stat}"], full[stat]), (step, name, stat)
            assert _close(metrics[f"optim/{name}/exp_avg/norm"], ref["exp_avg"][name]), (step, name)


def _assert_same_activations(run: dict, reference: dict, kinds: tuple[str, ...] = ("actv",)) -> None:
    """Activation statistics (merged over TP/DP shards and micro-batches) equal the reference's."""
    for got, ref in zip(run["steps"], reference["steps"]):
        tags = [t for t in got["metrics"] if t.split("/")[0] in kinds and t.endswith(("/norm", "/numel"))]
        assert tags
        for tag in tags:
            assert _close(got["metrics"][tag], ref["metrics"][tag]), tag


def _reference_norm(step: dict) -> float:
    return math.sqrt(sum(g["norm"] ** 2 for g in step["grads"].values()))


# ---- tests ------------------------------------------------------------------------------------

def test_single_process_grad_norm_equals_reference(single):
    for step in single["main"]["steps"]:
        reference = _reference_norm(step)
        assert _close(step["metrics"]["grad/global/norm"], reference)
        assert _close(step["megatron_grad_norm"], reference)
    _assert_matches_reference(single["main"], single["main"])
    assert all(s["micro_steps"] == 2 for s in single["main"]["steps"])


def test_tensor_parallel_equals_single_process(single, pair):
    ref = single["main"]["steps"]
    for rank_result in pair:
        run = rank_result["tp2"]
        for got, want in zip(run["steps"], ref):
            assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
            assert _close(got["metrics"]["grad/global/norm"], _reference_norm(want))
            assert _close(got["megatron_grad_norm"], _reference_norm(want))
        _assert_matches_reference(run, single["main"])  # partitioned merged, replicated counted once
        _assert_same_activations(run, single["main"], ("actv", "actv_grad"))
        assert run["gathers"] == STEPS  # one merge per step over the TP group, nothing else
        assert all(s["micro_steps"] == 2 for s in run["steps"])
    assert untimed(pair[0]["tp2"]["steps"][-1]["metrics"]) == untimed(pair[1]["tp2"]["steps"][-1]["metrics"])


@pytest.mark.parametrize("variant", ["dp2_distributed", "dp2_replicated"])
def test_data_parallel_equals_single_process(single, pair, variant):
    for rank_result in pair:
        run = rank_result[variant]
        for got, want in zip(run["steps"], single["main"]["steps"]):
            assert _close(got["metrics"]["grad/global/norm"], _reference_norm(want))
            assert _close(got["megatron_grad_norm"], _reference_norm(want))
            assert got["metrics"]["train/loss"] == pytest.approx(want["loss"], rel=RTOL)
        _assert_matches_reference(run, single["main"])  # DP shards merged, replicas counted once
        _assert_same_activations(run, single["main"])  # each rank's micro-batch merged over DP
        assert run["gathers"] == STEPS
        assert all(s["micro_steps"] == 1 for s in run["steps"])


def test_torch_fsdp2_equals_the_gathered_truth(single, pair):
    """Megatron's TorchFullyShardedDataParallel (torch FSDP2 over DP=2, each rank one micro-batch):
    every parameter's gradient, weight and Adam moments, measured on this rank's DTensor shard and
    merged, equal the same tensors gathered whole (`full_tensor`) and the single-process run;
    activations merged over the two ranks' micro-batches equal the single-process ones."""
    if "torch_fsdp2" not in pair[0]:
        pytest.skip("megatron-core 0.16.1's finalize_model_grads calls TorchFullyShardedDataParallel."
                    "finish_grad_sync(force_all_reduce=...), which it does not take (TypeError)")
    for rank_result in pair:
        run = rank_result["torch_fsdp2"]
        _assert_matches_reference(run, run)  # against its own shards gathered
        _assert_matches_reference(run, single["main"])
        _assert_same_activations(run, single["main"])  # (each rank's loss is its micro-batch's mean)
        for got, want in zip(run["steps"], single["main"]["steps"]):
            metrics = got["metrics"]
            assert _close(metrics["grad/global/norm"], _reference_norm(want))
            assert _close(got["megatron_grad_norm"], _reference_norm(want))
            assert metrics["train/loss"] == pytest.approx(want["loss"], rel=RTOL)
            assert metrics["train/skipped"] == 0.0
            for name, truth in got["after_step"].items():
                assert _close(metrics[f"param/{name}/norm"], truth["param"], 1e-6), name
                assert _close(metrics[f"optim/{name}/exp_avg_sq/norm"], truth["exp_avg_sq"], 1e-6), name
        assert not _misreported(run)
        assert run["gathers"] == STEPS
        assert all(s["micro_steps"] == 1 for s in run["steps"])
    assert untimed(pair[0]["torch_fsdp2"]["steps"][-1]["metrics"]) == untimed(pair[1]["torch_fsdp2"]["steps"][-1]["metrics"])


def test_context_parallel_equals_the_full_sequence(single, pair):
    """CP=2 (each rank holds half of every sequence, cut as Megatron-LM's get_batch_on_this_cp_rank
    does) on a GPT whose layers have no self-attention: gradients, Adam's exp_avg, activations and
    the loss equal the single-process run on whole sequences; activation gradients are twice the
    single process's (each CP rank's loss is the mean over its half, as Megatron-LM's loss_func
    makes it; DDP then averages the parameter gradients over CP), with the same counts. A bias
    returned apart (`output.1`, the same on both CP ranks) is taken once."""
    ref = single["attention_free"]
    for rank_result in pair:
        run = rank_result["cp2"]
        _assert_matches_reference(run, ref)
        _assert_same_activations(run, ref)
        for got, want in zip(run["steps"], ref["steps"]):
            metrics = got["metrics"]
            assert any(tag.endswith("/output.1/norm") for tag in metrics if tag.startswith("actv/"))
            assert _close(metrics["grad/global/norm"], _reference_norm(want))
            assert _close(got["megatron_grad_norm"], _reference_norm(want))
            assert metrics["train/loss"] == pytest.approx(want["loss"], rel=RTOL)
            grads = [tag for tag in metrics if tag.startswith("actv_grad/") and tag.endswith("/norm")]
            assert grads
            for tag in grads:
                assert _close(metrics[tag], 2 * want["metrics"][tag]), tag
                assert metrics[tag[:-len("norm")] + "numel"] == want["metrics"][tag[:-len("norm")] + "numel"], tag
        assert not _misreported(run)
        assert run["gathers"] == STEPS
        assert all(s["micro_steps"] == 2 for s in run["steps"])
    assert untimed(pair[0]["cp2"]["steps"][-1]["metrics"]) == untimed(pair[1]["cp2"]["steps"][-1]["metrics"])
    assert "expert parallelism (2) with context parallelism (2): not supported" in pair[0]["ep_cp_error"]


def _misreported(run: dict) -> list[int]:
    return [step for step, s in enumerate(run["steps"]) for a in s["alerts"]
            if a["rule"] == "misreported_grad_norm" and a["phase"] == "start"]


def test_megatrons_own_grad_norm_is_reported_and_equals_the_merged_one(single, pair):
    """The norm `optimizer.step()` returns (pre-clip, over the main gradients) goes to
    `train/reported_grad_norm`, equal to the merged `grad/global/norm` on one rank, TP=2 and DP=2
    (distributed optimizer or not): the rule (tolerance 1e-5) stays silent. Under PP=2 Megatron's
    norm covers both stages and the monitor's one: it is not reported."""
    runs = [single["main"]] + [r[v] for r in pair for v in ("tp2", "dp2_distributed", "dp2_replicated")]
    for run in runs:
        assert not _misreported(run)
        for step in run["steps"]:
            assert step["metrics"][REPORTED] == pytest.approx(step["megatron_grad_norm"], rel=1e-6)
            assert _close(step["metrics"][REPORTED], step["metrics"]["grad/global/norm"])
    assert not any(REPORTED in s["metrics"] for r in pair for s in r["pp2"]["steps"])
    # a skip rule decides before the step; the norm, known after it, is checked all the same
    skip = single["skip"]
    assert not [a for a in skip["alerts"] if a[0] == "misreported_grad_norm"]
    assert [REPORTED in m for m in skip["metrics"]] == [True] * (STEPS - 1) + [False]  # skipped: no norm
    for metrics in skip["metrics"][:-1]:
        assert _close(metrics[REPORTED], metrics["grad/global/norm"])


def test_a_grad_norm_of_one_shard_inside_megatron_is_caught(pair):
    """DP=2 with the distributed optimizer and Megatron's norm reduced over this rank alone (the
    local-shard bug, in Megatron's own `get_grad_norm`): the alert fires at the first step on
    both ranks. Each rank's Megatron norm is that of its own shard; the record holds their mean
    (training scalars merge over data-parallel ranks as the loss does)."""
    for rank_result in pair:
        run = rank_result["dp2_local_norm"]
        assert _misreported(run) == [0]
        for step, *others in zip(*(r["dp2_local_norm"]["steps"] for r in pair)):
            ratio = step["metrics"][REPORTED] / step["metrics"]["grad/global/norm"]
            shards = [step["megatron_grad_norm"]] + [o["megatron_grad_norm"] for o in others]
            assert 0.3 < ratio < 0.95 and step["metrics"][REPORTED] == pytest.approx(sum(shards) / 2)
            assert math.isclose(math.hypot(*shards), step["metrics"]["grad/global/norm"], rel_tol=RTOL)


def test_pipeline_stages_report_their_layers_under_global_names(single, pair, out):
    assert all((out / "pp2" / f"rank{r}" / "metrics.jsonl").is_file() for r in (0, 1))  # one writer per stage
    assert not (out / "tp2" / "rank1").exists()  # TP/DP: the merged run is written once
    ref = single["main"]["steps"]
    stage0, stage1 = (pair[r]["pp2"] for r in (0, 1))
    names0, names1 = set(_grads(stage0["steps"][0]["metrics"])), set(_grads(stage1["steps"][0]["metrics"]))
    assert not names0 & names1 and names0 | names1 == set(ref[0]["grads"])
    assert any(n.startswith("decoder.layers.1.") for n in names1)
    assert not any(n.startswith("decoder.layers.0.") for n in names1)
    for stage in (stage0, stage1):
        compared = {"steps": stage["steps"][:STEPS]}
        _assert_matches_reference(compared, single["main"], set(_grads(stage["steps"][0]["metrics"])))
        _assert_same_activations(compared, single["main"], ("actv", "actv_grad"))
        assert stage["gathers"] == 0  # nothing is merged across stages
        assert all(s["micro_steps"] == 2 for s in stage["steps"])
    for step in range(STEPS):
        norms = [s["steps"][step]["metrics"]["grad/global/norm"] for s in (stage0, stage1)]
        assert _close(math.hypot(*norms), _reference_norm(ref[step]))
        assert stage1["steps"][step]["loss"] == pytest.approx(ref[step]["loss"], rel=RTOL)


def test_activation_names_unique_and_stable(single, pair):
    steps = single["main"]["steps"]
    names = _actv_paths(steps[0]["metrics"])
    assert all(_actv_paths(s["metrics"]) == names for s in steps)
    assert f"decoder.layers.{LAYER_K}.mlp.linear_fc1" in names
    assert not any("cross_attention" in n for n in names)  # Megatron's IdentityOp placeholders
    for run in ("tp2", "dp2_distributed", "dp2_replicated"):
        assert all(_actv_paths(s["metrics"]) == names for r in pair for s in r[run]["steps"])
    stage0, stage1 = (_actv_paths(pair[r]["pp2"]["steps"][0]["metrics"]) for r in (0, 1))
    assert not stage0 & stage1 and stage0 | stage1 == names


def test_nan_in_layer_k_names_layer_k(pair):
    alerts = pair[1]["pp2"]["steps"][STEPS]["alerts"]  # the stage holding global layer k
    assert [a["tag"] for a in alerts if a["rule"] == "non_finite" and a["phase"] == "start"] == [
        f"actv/decoder.layers.{LAYER_K}.mlp.linear_fc1/output.0/nan_count"]


def test_megatron_nan_check_raises_after_the_step_is_written(single):
    result = single["nan_check"]
    assert "found NaN in local forward loss calculation" in result["error"]
    records = [json.loads(line) for line in result["on_disk"]]
    assert [r["step"] for r in records] == list(range(STEPS))
    last = records[-1]
    assert math.isnan(last["metrics"]["train/megatron_rejected"])
    starts = [a for a in last["alerts"] if a["rule"] == "non_finite" and a["phase"] == "start"]
    assert starts and starts[0]["tag"] == f"actv/decoder.layers.{LAYER_K}.mlp.linear_fc1/output.0/nan_count"
    assert any(name.startswith(f"step{STEPS - 1}-rank0-non_finite") for name in result["incidents"])


def test_skip_rule_skips_megatrons_update(single):
    result = single["skip"]
    assert result["changed"] == [True] * (STEPS - 1) + [False]
    assert result["megatron_grad_norms"][-1] is None  # Megatron's step returned (False, None, None)
    assert result["skipped"] == [0.0] * (STEPS - 1) + [1.0]


def test_megatron_rerun_exit_comes_after_the_step_is_written(single):
    result = single["rerun_exit"]
    assert result["exit_step"] == STEPS - 1
    last = json.loads(result["on_disk"][-1])
    assert last["step"] == STEPS - 1 and last["micro_steps"] == 4  # the nan step, run twice
    starts = [a for a in last["alerts"] if a["rule"] == "non_finite" and a["phase"] == "start"]
    assert starts and starts[0]["tag"] == f"actv/decoder.layers.{LAYER_K}.mlp.linear_fc1/output.0/nan_count"


def test_tensorboard_events_read_back(single, out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "world1" / "rank0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    steps = single["main"]["steps"]
    for tag in ("grad/global/norm", "train/loss", f"actv/decoder.layers.{LAYER_K}/output.0/norm",
                "optim/decoder.layers.0.mlp.linear_fc1.weight/exp_avg/norm"):
        assert tag in tags
        values = [e.value for e in events.Scalars(tag)]
        assert values == pytest.approx([s["metrics"][tag] for s in steps], rel=1e-6)


def test_bad_input_is_named(single):
    errors, warnings = single["bad_input"]["errors"], single["bad_input"]["warnings"]
    assert "model chunk 0 is a str" in errors["not a module"]
    assert errors["no chunks"].startswith("ValueError")
    assert "optimizer is a object" in errors["not an optimizer"]
    joined = "\n".join(warnings)
    assert "model chunk 0 (Linear) is not a Megatron module" in joined
    assert "no optimizer: parameter gradients, weights and optimizer state are not monitored" in joined
    assert "trainable parameters are not updated by the optimizer" in joined
    assert "optimizer CustomOptimizer is not supported" in joined


def test_the_helpers_import_with_only_the_repository_on_the_path():
    """examples/megatron_train.py and bench/megatron_overhead.py import tests.megatron_helpers
    outside pytest, which puts no tests/ directory on the path."""
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", "import tests.megatron_helpers"], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
