"""DeepSpeed's PipelineEngine under DeepSpeedMonitor (CPU, gloo, one launch of two ranks = two
pipeline stages, `engine.train_batch`, ZeRO-0 and ZeRO-1 one after the other): every layer's
output, output gradient, parameter gradient, weight and Adam moments, on both ranks under the
PipelineModule's global layer names, equal the same model trained unpipelined
(`ds_pipe_helpers.truth`) within 1e-6 relative; one record per train_batch of GAS micro-steps,
the loss from the last stage, DeepSpeed's grad norm (ZeRO-1) the merged one, no rule fires."""
from __future__ import annotations

import math

import pytest

from tests import ds_pipe_helpers as H
from tests.ds_moe_helpers import close
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-6
MERGED = ("actv", "actv_grad", "grad", "param", "optim", "train")
ZERO = [0, 1]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """What each rank returned (`ds_pipe_helpers.run_all`)."""
    return run_ranks(H.run_all, 2, str(tmp_path_factory.mktemp("ds_pipe")), timeout=300,
                     env={"DS_ACCELERATOR": "cpu"})


@pytest.fixture(params=ZERO, ids=lambda zero: f"zero{zero}")
def ranks(launch, request):
    return [rank[request.param] for rank in launch]


def test_each_stage_holds_its_layers_under_their_global_names(ranks):
    assert [rank["names"] for rank in ranks] == [["0.weight", "0.bias"],
                                                 ["2.weight", "2.bias", "3.weight", "3.bias"]]


def test_every_rank_reports_every_stages_statistics_equal_to_the_unpipelined_truth(ranks):
    truth = ranks[0]["truth"]
    # 4 layers x (output, its gradient) + 6 parameters x (gradient, weight, exp_avg, exp_avg_sq)
    assert len(truth) == H.STEPS and len(truth[0]) == (4 * 2 + 6 * 4) * len(H.STATS)
    for rank in ranks:
        records = rank["records"]
        assert [step for step, _, _ in records] == list(range(H.STEPS))  # one record per train_batch
        assert rank["micro_steps"] == [H.GAS] * H.STEPS  # of the engine's micro-batches
        for (step, got, alerts), want in zip(records, truth):
            assert set(want) <= set(got), sorted(set(want) - set(got))[:5]
            bad = [t for t in want if not close(got, want, t, RTOL)]
            assert not bad, (step, bad[:5])
            assert not alerts
    merged = [[{t: v for t, v in m.items() if t.split("/")[0] in MERGED} for _, m, _ in rank["records"]]
              for rank in ranks]
    assert merged[0] == merged[1] and len(merged[0][0]) > len(truth[0])  # every rank the same rows (+ global norms)


def test_the_loss_is_the_last_stages_mean_over_the_micro_batches(ranks):
    for rank in ranks:
        assert [m["train/loss"] for _, m, _ in rank["records"]] == pytest.approx(rank["losses"], rel=1e-6)
        assert [m["train/skipped"] for _, m, _ in rank["records"]] == [0.0] * H.STEPS


def test_deepspeeds_grad_norm_covers_every_stage_as_the_merged_one(launch):
    """ZeRO-1: DeepSpeed's norm over the pipeline (its mpu is the grid) is reported and checked
    (`misreported_grad_norm`: no alert above); ZeRO-0 fp32 has none."""
    for rank in launch:
        assert rank[0]["ds_norms"] == [None] * H.STEPS
        assert all("train/reported_grad_norm" not in m for _, m, _ in rank[0]["records"])
        records, norms = rank[1]["records"], rank[1]["ds_norms"]
        assert [m["train/reported_grad_norm"] for _, m, _ in records] == norms
        assert all(math.isclose(m["grad/global/norm"], norm, rel_tol=1e-6) for (_, m, _), norm in zip(records, norms))
