"""DeepSpeed integration, with real DeepSpeed 0.19.8 on the CPU (gloo), 1 and 2 ranks.

One launch per world size trains every case (ZeRO 0-3 x fp32/bf16, plus BF16_Optimizer,
fp16 with overflow-skipped steps under a `stop` rule, per-rank records with DeepSpeed's own
monitor, the skip action on ZeRO 0-3 and stop) one engine after the other
(tests/ds_helpers.py); the tests below check what came back.

Tolerances: against DeepSpeed's own full tensors (`safe_get_full_*`, read at the same
points), 1e-5 (the monitor accumulates in float32 per 4096-element chunk, the reference in
float64). fp32 across stages and against the same model trained without DeepSpeed: 1e-5
for activations, loss, gradients and optimizer state; 2e-3 for parameters, where AdamW
turns last-bit gradient differences of near-zero elements into +-lr steps. bf16 across
stages and against fp32: 5e-2 on the first step (bf16 keeps 8 significant bits; stages
reduce in different orders), later steps diverge as DeepSpeed's arithmetic does. fp16
gradient norms against fp32 at the same weights: 5e-3 (measured: 5e-4; a wrong loss scale
would be off by 2^15 or more).
Norms are compared relative to their value; min, max and mean relative to the tensor's
largest magnitude (max(|min|, |max|)), since means and minima can sit at zero.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests import ds_helpers
from tests.ds_helpers import (ACTION_CASES, ACTION_STEPS, CASES, CULPRIT, GAS, MODEL, NAN_AT, SNAPSHOT,
                              SPIKE_AT, STEPS, STOP_AT)
from tests.multiproc import run_ranks
from tests.sink_helpers import untimed

pytestmark = pytest.mark.slow
os.environ.setdefault("DS_ACCELERATOR", "cpu")

LAUNCH_TIMEOUT = 300.0
REPORTED = "train/reported_grad_norm"
FP32_CASES = [f"zero{s}-fp32" for s, d in CASES if d == "fp32"]
BF16_CASES = [f"zero{s}-bf16" for s, d in CASES if d == "bf16"] + ["zero1-bf16-fp32acc"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, tuple[Path, list[dict]]]:
    """world size -> (output dir, what every rank returned)."""
    out = {}
    for world in (1, 2):
        root = tmp_path_factory.mktemp(f"world{world}")
        out[world] = root, run_ranks(ds_helpers.run_launch, world, str(root), timeout=LAUNCH_TIMEOUT,
                                     env={"DS_ACCELERATOR": "cpu"})
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, list[dict]]:
    """world size -> metrics per step of the same model trained without DeepSpeed."""
    return {world: ds_helpers.reference_metrics(world, tmp_path_factory.mktemp(f"plain{world}"))
            for world in (1, 2)}


def cases(world: int) -> list[str]:
    extra = ["zero1-bf16-fp32acc", "per-rank", "zero2-fp16"] if world == 2 else ["zero0-fp16", "zero3-fp16"]
    return [f"zero{s}-{d}" for s, d in CASES] + extra


def measured(record: dict) -> dict:
    """A record without the monitor's own cost (monitor/*), which differs from rank to rank."""
    return {**record, "metrics": {t: v for t, v in record["metrics"].items() if not t.startswith("monitor/")}}


def mismatches(ours: dict[str, float], reference: dict[str, float], tolerance, prefix: str = "") -> list[str]:
    """Tags whose values differ by more than `tolerance(tag)` (see the module docstring)."""
    bad = []
    for tag, expected in untimed(reference).items():
        base, stat = tag.rsplit("/", 1)
        if stat in ("nan_count", "inf_count") or tag.startswith("monitor/"):  # monitor/*: its own cost
            continue
        if prefix + tag not in ours:
            bad.append(f"{prefix}{tag} missing")
            continue
        if stat in ("min", "max", "mean"):
            scale = max(abs(reference.get(f"{base}/min", expected)), abs(reference.get(f"{base}/max", expected)))
        else:
            scale = abs(expected)
        value = ours[prefix + tag]
        if not abs(value - expected) <= tolerance(prefix + tag) * scale:
            bad.append(f"{prefix}{tag}: {value!r} != {expected!r}")
    return bad


def with_stats(summaries: dict[str, dict[str, float]]) -> dict[str, float]:
    """{name: {stat: value}} -> {name/stat: value}."""
    return {f"{name}/{stat}": value for name, stats in summaries.items() for stat, value in stats.items()}


def fp32_tolerance(tag: str) -> float:
    return 2e-3 if tag.startswith("param/") else 1e-5


@pytest.mark.parametrize("world", [1, 2])
def test_statistics_are_those_of_deepspeeds_full_tensors(launches, world):
    """Per-parameter gradients (unscaled for fp16) before the step, fp32 parameters and
    exp_avg/exp_avg_sq after it, every rank, every case: equal to safe_get_full_*."""
    for rank, results in enumerate(launches[world][1]):
        for name in cases(world):
            result = results[name]
            records = result["records"]
            assert len(records) == len(result["grads"]) == len(result["states"])
            for record, grads, state in zip(records, result["grads"], result["states"]):
                metrics = record["metrics"]
                if metrics["train/skipped"]:
                    continue
                bad = mismatches(metrics, with_stats(state), lambda tag: 1e-5)
                if grads is not None:  # fp16: see test_fp16_gradients_are_reported_unscaled
                    bad += mismatches(metrics, with_stats(grads), lambda tag: 1e-5, prefix="grad/")
                assert not bad, f"world {world} rank {rank} {name} step {record['step']}: {bad[:5]}"


@pytest.mark.parametrize("world", [1, 2])
def test_fp32_stages_equal_the_model_trained_without_deepspeed(launches, references, world):
    results = launches[world][1][0]
    for name in FP32_CASES:
        for record, reference in zip(results[name]["records"], references[world], strict=True):
            # plain PyTorch has train/skipped too; DeepSpeed's own norm is the one tag more
            # (ZeRO 1-3: test_deepspeeds_own_grad_norm_is_reported_and_equals_the_merged_one)
            assert set(record["metrics"]) - {REPORTED} == set(reference)
            assert (REPORTED in record["metrics"]) == (not name.startswith("zero0")), name
            bad = mismatches(record["metrics"], reference, fp32_tolerance)
            assert not bad, f"world {world} {name} step {record['step']}: {bad[:5]}"


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_stages_agree_with_each_other_and_with_fp32(launches, references, world):
    results = launches[world][1][0]
    first = {name: results[name]["records"][0]["metrics"] for name in BF16_CASES if name in results}
    watched = ("actv/", "grad/", "optim/", "train/loss")
    for name, metrics in first.items():
        for other in [references[world][0], *first.values()]:
            compared = {tag: value for tag, value in other.items() if tag.startswith(watched)}
            bad = mismatches(metrics, compared, lambda tag: 5e-2)
            assert not bad, f"world {world} {name}: {bad[:5]}"


@pytest.mark.parametrize("world", [1, 2])
def test_steps_follow_gradient_accumulation_with_one_transfer_each(launches, world):
    for results in launches[world][1]:
        for name in cases(world):
            result = results[name]
            steps = len(result["grads"])
            assert [r["step"] for r in result["records"]] == list(range(steps)), name
            assert [r["micro_steps"] for r in result["records"]] == [GAS] * steps, name
            # with a skip/stop rule the last step's post-step rows travel at close()
            assert result["transfers"] == steps + result["decides_early"], name
            assert result["restored"], f"{name}: engine.step/backward not given back on close"


def test_rank0_writes_the_merged_run_to_tensorboard(launches):
    root, results = launches[2]
    for name in FP32_CASES + BF16_CASES:
        assert not (root / name / "rank1").exists()
        events = EventAccumulator(str(root / name / "rank0"), size_guidance={"scalars": 0}).Reload()
        records = results[0][name]["records"]
        assert set(events.Tags()["scalars"]) == set(records[0]["metrics"])
        for tag in ("train/loss", "grad/global/norm", "grad/layers.1.mlp.2.weight/norm",
                    "optim/embed.weight/exp_avg_sq/max", "actv/layers.0.attn/output.0/norm"):
            logged = events.Scalars(tag)
            assert [e.step for e in logged] == [r["step"] for r in records]
            assert [e.value for e in logged] == pytest.approx([r["metrics"][tag] for r in records], rel=1e-6), tag
        # every rank merged the same numbers
        assert [{**r, "metrics": untimed(r["metrics"])} for r in results[1][name]["records"]] == \
            [{**r, "metrics": untimed(r["metrics"])} for r in records]


def test_per_rank_records_keep_each_ranks_own_loss_and_activations(launches):
    root, results = launches[2]
    mine = [results[rank]["per-rank"]["records"] for rank in (0, 1)]
    merged = results[0]["zero1-fp32"]["records"]  # the same training, per_rank off
    for rank in (0, 1):
        assert (root / "per-rank" / f"rank{rank}" / "metrics.jsonl").is_file()
    for step in range(STEPS):
        own = [mine[rank][step]["metrics"] for rank in (0, 1)]
        assert own[0]["train/loss"] != own[1]["train/loss"]
        assert (own[0]["train/loss"] + own[1]["train/loss"]) / 2 == pytest.approx(
            merged[step]["metrics"]["train/loss"], rel=1e-6)
        assert own[0]["actv/head/output/norm"] != own[1]["actv/head/output/norm"]
        for tag in ("grad/head.weight/norm", "optim/pos/exp_avg/norm", "param/embed.weight/max"):
            assert own[0][tag] == own[1][tag] == pytest.approx(merged[step]["metrics"][tag], rel=1e-6)


def test_metrics_also_go_through_deepspeeds_own_monitor(launches):
    root, results = launches[2]
    events = EventAccumulator(str(root / "per-rank" / "deepspeed" / "ds"), size_guidance={"scalars": 0}).Reload()
    records = results[0]["per-rank"]["records"]
    samples_per_step = 2 * GAS * MODEL.batch
    logged = events.Scalars("grad/global/norm")
    assert [e.step for e in logged] == [(r["step"] + 1) * samples_per_step for r in records]
    expected = [r["metrics"]["grad/global/norm"] for r in records]
    assert [e.value for e in logged] == pytest.approx(expected, rel=1e-6)
    assert "Train/Samples/lr" in events.Tags()["scalars"]  # DeepSpeed's own events are still there


@pytest.mark.parametrize("world, name", [(1, "zero3-fp16"), (2, "zero2-fp16")])
def test_fp16_overflow_steps_are_reported_as_skipped_not_as_anomalies(launches, world, name):
    """Under a `stop` rule on the loss, activations, activation gradients and gradients (the
    launch would have failed with TrainingStopped): routine overflows fire nothing."""
    result = launches[world][1][0][name]
    records = result["records"]
    assert result["decides_early"]
    skipped = [r["metrics"]["train/skipped"] for r in records]
    assert skipped == [1.0, 1.0, 0.0, 0.0, 0.0]  # the loss scale starts at 2^17, too high
    assert result["incidents"] == {}
    for record in records:
        assert record["alerts"] == []
        has_grads = any(tag.startswith("grad/") for tag in record["metrics"])
        assert has_grads == (not record["metrics"]["train/skipped"])
        assert math.isfinite(record["metrics"]["train/loss"])
    # applied steps ran with a loss scale of 2^15: the reported gradients are divided by it
    assert result["scales"][2:] == [2.0 ** 15] * 3
    # the loss scale of each step (before DeepSpeed halves it on an overflow), on the landing page
    assert [r["metrics"]["Health/loss_scale"] for r in records] == result["scales"] == [2.0 ** 17, 2.0 ** 16] + \
        [2.0 ** 15] * 3
    assert 1e-3 < records[2]["metrics"]["grad/global/norm"] < 10


def test_ranks_measuring_different_modules_fail_loudly(launches):
    for results in launches[2][1]:
        assert "the ranks of the data-parallel group measured different tensors" in results["different modules"]


@pytest.mark.parametrize("world, name", [(1, "zero0-fp16"), (1, "zero3-fp16"), (2, "zero2-fp16")])
def test_fp16_gradients_are_reported_unscaled(launches, world, name):
    """The first applied step still has the initial weights: its gradients are those of the fp32
    model on the same batch, to fp16 precision, whatever the loss scale was."""
    first = next(r for r in launches[world][1][0][name]["records"] if not r["metrics"]["train/skipped"])
    for param, norm in ds_helpers.initial_gradient_norms(world, first["step"]).items():
        assert first["metrics"][f"grad/{param}/norm"] == pytest.approx(norm, rel=5e-3), param


def test_what_cannot_be_monitored_is_named(launches):
    said = launches[1][1][0]["bad input"]
    assert ("no optimizer: parameter gradients, parameters and optimizer state are not monitored"
            in said["no optimizer"])
    assert "optimizer SGD keeps none of exp_avg, exp_avg_sq" in said["sgd"]
    assert "engine_monitor=True, but the DeepSpeed config enables none of its monitors" in said["sgd"]


def test_statistics_divided_by_a_loss_scale_are_those_of_the_divided_tensor():
    import torch

    from msprobe_engine.frameworks.torch import backend as torch_backend
    from msprobe_engine.stats import divide

    tensors = [torch.randn(5000) * 3e4, torch.randn(7), torch.empty(0)]
    divided = divide(torch_backend.partial_stats(tensors), 2.0 ** 15)
    expected = torch_backend.partial_stats([t / 2.0 ** 15 for t in tensors])
    assert torch.allclose(divided, expected, rtol=1e-6, atol=0, equal_nan=True)


def test_discard_drops_this_steps_rows_of_one_kind_only(tmp_path):
    import torch

    from msprobe_engine import Monitor
    from msprobe_engine.frameworks.torch import backend as torch_backend
    from msprobe_engine.stats.table import MetricKey

    monitor = Monitor({"strict": True, "output_dir": str(tmp_path), "sinks": []}, backend=torch_backend)
    monitor.add_tensors([MetricKey("grad", "w"), MetricKey("actv", "m", "output")], [torch.ones(3), torch.ones(2)])
    monitor.add_tensors([MetricKey("grad", "b")], [torch.ones(1)])
    monitor.discard("grad")
    record = monitor.step_end(1.0)
    monitor.close()
    assert not [tag for tag in record.metrics if tag.startswith("grad/")]
    assert record.metrics["actv/m/output/norm"] == pytest.approx(2 ** 0.5)


def test_a_model_that_is_not_a_deepspeed_engine_is_refused():
    import torch

    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    with pytest.raises(TypeError, match=r"deepspeed.initialize .* got torch.nn.modules.linear.Linear"):
        DeepSpeedMonitor(torch.nn.Linear(2, 2))


# ---- DeepSpeed's own grad norm, cross-checked ----------------------------------------------------------
def _misreported(records: list[dict]) -> list[int]:
    return [a["step"] for r in records for a in r["alerts"]
            if a["rule"] == "misreported_grad_norm" and a["phase"] == "start"]


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeeds_own_grad_norm_is_reported_and_equals_the_merged_one(launches, world):
    """`engine.get_global_grad_norm()` (pre-clip, unscaled) goes to `train/reported_grad_norm` on
    every applied step of ZeRO 1-3 and the bf16/fp16 wrappers, equal to the monitor's merged
    `grad/global/norm` (the rule, at tolerance 1e-5, stays silent); ZeRO-0 fp32 has none. The
    skip cases decide before the step: the rule is evaluated after it all the same."""
    for rank, results in enumerate(launches[world][1]):
        for name in cases(world) + skip_cases(world):
            result = results[name]
            assert not _misreported(result["records"]), (world, rank, name)
            if name.startswith("skip"):
                continue
            for record, ds_norm in zip(result["records"], result["ds_norms"], strict=True):
                metrics = record["metrics"]
                if name == "zero0-fp32":
                    assert ds_norm is None and REPORTED not in metrics
                elif metrics["train/skipped"]:  # an fp16 overflow: the gradients were dropped
                    assert REPORTED not in metrics and "grad/global/norm" not in metrics
                else:
                    assert metrics[REPORTED] == pytest.approx(ds_norm, rel=1e-6), (name, record["step"])
                    assert metrics[REPORTED] == pytest.approx(metrics["grad/global/norm"], rel=1e-5), name
    for record in launches[world][1][0][skip_cases(world)[-1]]["records"]:
        metrics = record["metrics"]
        if math.isfinite(metrics["grad/global/norm"]):  # (a nan step's norms are nan: not checked)
            assert metrics[REPORTED] == pytest.approx(metrics["grad/global/norm"], rel=1e-5)


def test_a_grad_norm_of_one_partition_inside_deepspeed_is_caught(launches):
    """ZeRO-2 on 2 ranks with DeepSpeed's norm reduced over this rank alone (its own partition:
    the local-shard bug): the alert fires at the first step, on both ranks, and the reported
    norm is well below the merged one (about 1/sqrt(2) of it)."""
    for results in launches[2][1]:
        records = results["local-norm"]["records"]
        assert _misreported(records) == [0]
        for record in records:
            metrics = record["metrics"]
            assert 0.3 < metrics[REPORTED] / metrics["grad/global/norm"] < 0.95
        alert = next(a for a in records[0]["alerts"] if a["rule"] == "misreported_grad_norm")
        assert alert["tag"] == REPORTED and alert["threshold"] == pytest.approx(
            records[0]["metrics"]["grad/global/norm"])


# ---- actions: skip, stop, incidents ------------------------------------------------------------------
def skip_cases(world: int) -> list[str]:
    return [f"skip-zero{s}-{d}" for s, d in ACTION_CASES] if world == 1 else ["skip-zero2-fp32"]


@pytest.mark.parametrize("world", [1, 2])
def test_skip_leaves_weights_optimizer_state_and_lr_unchanged(launches, world):
    """A spike (finite gradients: DeepSpeed would apply the step) at SPIKE_AT and a nan at NAN_AT,
    on rank 0 only, both under `action: skip`. Those steps change nothing, bitwise (model weights,
    fp32 masters, exp_avg, exp_avg_sq, the torch optimizer's step counts, the lr and the
    scheduler), on every rank; the steps after them train normally."""
    for rank, results in enumerate(launches[world][1]):
        for name in skip_cases(world):
            result = results[name]
            for step, changed in enumerate(result["changes"], start=1):
                assert changed["finite"], (name, rank, step)
                expected = step not in (SPIKE_AT, NAN_AT)
                assert {k: changed[k] for k in SNAPSHOT} == dict.fromkeys(SNAPSHOT, expected), (name, rank, step)
            metrics = [r["metrics"] for r in result["records"]]
            assert len(metrics) == ACTION_STEPS
            skipped = [float(step in (SPIKE_AT, NAN_AT)) for step in range(ACTION_STEPS)]
            assert [m["train/skipped"] for m in metrics] == skipped
            # the skipped steps' gradients were cleared: the next steps' are as small as the first's
            for step in (SPIKE_AT + 1, NAN_AT + 1):
                assert metrics[step]["grad/global/norm"] < 3 * metrics[0]["grad/global/norm"], (name, step)
            assert math.isnan(metrics[NAN_AT]["grad/global/norm"])  # reported, not hidden
            alerts = {(a["rule"], a["step"]) for r in result["records"] for a in r["alerts"] if a["phase"] == "start"}
            assert alerts == {("spike", SPIKE_AT), ("non_finite", NAN_AT)}, name


@pytest.mark.parametrize("world", [1, 2])
def test_a_nan_leaves_an_incident_naming_the_layer(launches, world):
    """On every rank (the statistics are merged: rank 1 saw the nan of rank 0 too)."""
    for rank, results in enumerate(launches[world][1]):
        for name in skip_cases(world):
            incident = results[name]["incidents"][f"step{NAN_AT}-rank{rank}-non_finite"]
            assert (incident["step"], incident["rule"], incident["action"]) == (NAN_AT, "non_finite", "skip")
            culprit = incident["culprit"]
            assert (culprit["phase"], culprit["call"]) == ("forward", CULPRIT), name
            assert culprit["dump_entry"] == f"Module.{CULPRIT}.Linear.forward.0"


def test_stop_raises_out_of_engine_step_after_flushing(launches):
    """ZeRO-0 on one rank: TrainingStopped before DeepSpeed's step; records up to the stopping
    step and the incident are on disk when it is caught, before monitor.close()."""
    result = launches[1][1][0]["stop-zero0"]
    assert result["stopped"]["step"] == STOP_AT and result["stopped"]["rules"] == ["non_finite"]
    assert result["stopped"]["incidents"][0].endswith(f"step{STOP_AT}-rank0-non_finite")
    assert result["steps_done"] == STOP_AT and result["unchanged"]
    assert result["on_disk"] == list(range(STOP_AT + 1))
    assert result["incidents"][f"step{STOP_AT}-rank0-non_finite"]["culprit"]["call"] == CULPRIT


def test_all_ranks_stop_when_one_rank_decides_with_per_rank_records(launches):
    """per_rank: true keeps each rank's own activations, so only rank 0 sees its nan: one
    all-reduce of the decision makes rank 1 stop too (instead of hanging in DeepSpeed's step)."""
    root, results = launches[2]
    stops = [results[rank]["stop-zero2-per-rank"] for rank in (0, 1)]
    assert stops[0]["stopped"]["rules"] == ["non_finite"] and stops[0]["incidents"]
    assert stops[1]["stopped"]["rules"] == ["(a rule on another data-parallel rank)"]
    assert not stops[1]["incidents"]
    for stop in stops:
        assert stop["stopped"]["step"] == STOP_AT and stop["steps_done"] == STOP_AT and stop["unchanged"]
        assert stop["on_disk"] == list(range(STOP_AT + 1))
