"""The trainer callbacks (HF Trainer, Lightning) as the trainers' own: a config problem raised
when the callback is built, a shipped config by name, `train/skipped` and `Health/skipped`
under `action: skip`, the alert count in the trainers' logs, the run directory said once, the
alerts printed through the progress bar's `tqdm.write`."""
from __future__ import annotations

import logging

import pytest

from msprobe_engine.config import ConfigError
from tests.trainer_helpers import GAS, action_config, hf_run, lightning_run

pytestmark = pytest.mark.slow  # the real Trainers (a few seconds each)


def _environment(callback) -> dict:
    import json

    return json.loads((callback.monitor.run_dir / "environment.json").read_text())


def _skip_config(tmp_path):
    return action_config(tmp_path, "skip", sinks=["jsonl", "tensorboard"], run_name="demo")


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_config_problem_is_raised_when_the_callback_is_built(trainer, tmp_path):
    if trainer == "hf":
        from msprobe_integrations.hf import MonitorCallback
    else:
        from msprobe_integrations.lightning import MonitorCallback
    with pytest.raises(ConfigError, match="fulll: config file not found.*did you mean 'full'.*grads_optimizer"):
        MonitorCallback(config="fulll")
    with pytest.raises(ConfigError, match="schedule.interval: 0 is below the minimum"):
        MonitorCallback(config={"schedule": {"interval": 0}})
    assert MonitorCallback(config="full").config == "full"


def test_hf_skip_is_recorded_alerts_reach_log_history_and_the_run_is_announced_once(tmp_path, capfd):
    callback, trainer = hf_run(tmp_path, _skip_config(tmp_path), faults={1}, logging_steps=1)
    records = list(callback.monitor.history)
    assert [r.metrics["train/skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert [r.metrics["Health/skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert [r.metrics["Health/alerts"] for r in records] == [0.0, 1.0, 1.0]  # cumulative: the one-step alert stays
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [r.step for r in records] == [entry["step"] for entry in logged] == [1, 2, 3]  # HF's global_step
    assert [r.metrics["Health/lr"] for r in records] == pytest.approx([e["learning_rate"] for e in logged])
    # throughput from the second step on (since the previous step's end): 2 micro-batches of 2 rows of 16 tokens
    assert "Health/tokens_per_s" not in records[0].metrics
    rates = [(r.metrics["Health/tokens_per_s"], r.metrics["Health/samples_per_s"]) for r in records[1:]]
    assert all(tokens == pytest.approx(16 * samples) and samples > 0 for tokens, samples in rates), rates
    assert all(r.metrics["Health/memory/cpu_rss_mb"] > 10 for r in records)  # the peak RSS of this process
    # counted once the step's record is written (here during the next step: read a step late)
    assert [entry["msprobe/alerts"] for entry in logged] == [0, 0, 1]
    hyper = _environment(callback)["hyperparameters"]  # for config-check, without the run's paths
    assert hyper["trainer"]["learning_rate"] == 1e-3 and hyper["trainer"]["gradient_accumulation_steps"] == GAS
    assert "output_dir" not in hyper["trainer"] and hyper["model"]["n_layer"] == 2
    assert (hyper["optimizer"]["type"], hyper["optimizer"]["lr"]) == ("AdamW", 1e-3)
    err = capfd.readouterr().err
    assert err.count("msprobe: writing the run to") == 1
    assert f"{tmp_path / 'demo'}" in err and f"msprobe-engine tensorboard --logdir {tmp_path}" in err


def test_lightning_skip_is_recorded_and_alerts_reach_callback_metrics(tmp_path, capfd):
    import lightning.pytorch as pl

    seen = []  # trainer.global_step after each optimizer step (the batch that ends one)

    class GlobalStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % GAS == GAS - 1:
                seen.append(trainer.global_step)

    from lightning.pytorch.loggers import CSVLogger

    callback, trainer = lightning_run(tmp_path, _skip_config(tmp_path), faults={1}, callbacks=[GlobalStep()],
                                      logger=CSVLogger(tmp_path / "csv", name="", version=""))
    records = list(callback.monitor.history)
    assert [r.step for r in records] == seen == [1, 2, 3]
    assert [r.metrics["train/skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert [r.metrics["Health/skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert float(trainer.callback_metrics["msprobe/alerts"]) == 1.0
    logged = [line.split(",") for line in (tmp_path / "csv" / "metrics.csv").read_text().splitlines()]
    column, step = logged[0].index("msprobe/alerts"), logged[0].index("step")
    rows = [(int(row[step]), float(row[column])) for row in logged[1:] if row[column]]
    assert [s for s, _ in rows] == [1, 2, 3] and rows[-1][1] == 1.0  # the logger's, at each global_step
    assert [r.metrics["Health/alerts"] for r in records] == [0.0, 1.0, 1.0]
    assert [r.metrics["train/lr"] for r in records] == [1e-3] * 3
    assert all(r.metrics["Health/tokens_per_s"] > 0 and r.metrics["Health/samples_per_s"] > 0 for r in records[1:])
    assert capfd.readouterr().err.count("msprobe: writing the run to") == 1
    hyper = _environment(callback)["hyperparameters"]
    assert hyper["trainer"]["accumulate_grad_batches"] == GAS and hyper["trainer"]["max_steps"] == 3
    assert [(o["type"], o["lr"]) for o in hyper["optimizers"]] == [("AdamW", 1e-3)]
    assert hyper["module"] == {}  # the LightningModule saved no hyper-parameters


def test_alerts_go_through_tqdm_write_while_the_trainer_runs_and_not_after(tmp_path, monkeypatch):
    from tqdm.auto import tqdm

    written = []
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, s, file=None, **kw: written.append(s)))
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's log capture: as if logging were not set up
    logger = logging.getLogger("msprobe_engine")
    assert not logger.hasHandlers()
    hf_run(tmp_path, _skip_config(tmp_path), faults={1})
    assert any(line.startswith("msprobe alert non_finite start at step 2") for line in written), written
    assert any(line.startswith("msprobe: writing the run to") for line in written)
    assert not logger.handlers  # removed at the end of training


# ---- the loss scale (fp16 AMP's GradScaler) and a step its overflow skipped ------------------------------
SCALE = 2.0 ** 10
ACTV_GRADS = {"activation_grads": True}  # measured in the loss-scaled backward


def _scaler():
    import torch

    return torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)


def _assert_overflow_is_no_alert(records, monitor, plain_monitor) -> None:
    """The second step's backward overflowed (its gradients inf, its forward finite: what too
    large a loss scale does): under the scaler no alert, that step's loss-scaled rows dropped,
    the others' kept; without a scaler the same gradients fire `non_finite`."""
    assert list(monitor.alert_log) == [] and [r.alerts for r in records] == [[], [], []]
    assert ["grad/global/norm" in r.metrics for r in records] == [True, False, True]
    assert (plain_monitor.alert_log[0].rule, plain_monitor.alert_log[0].step) == ("non_finite", 2)


def test_hf_loss_scale_and_a_step_the_scaler_skipped_on_an_overflow(tmp_path):
    """accelerate builds its GradScaler for fp16 on accelerators only: the same torch scaler is
    given to the real Trainer's accelerator on the CPU (loss scaled in the backward, gradients
    unscaled by the scaler's step, which skips a step whose gradients hold an inf or nan)."""
    import math

    runs = {}
    for scaled in (False, True):
        out = tmp_path / ("scaled" if scaled else "plain")
        runs[scaled] = hf_run(out, action_config(out, watch=ACTV_GRADS), overflows={1},
                              scaler=_scaler() if scaled else None,
                              max_grad_norm=0.0, logging_steps=1)
    (plain_callback, _), (callback, trainer) = runs[False], runs[True]
    records, plain = list(callback.monitor.history), list(plain_callback.monitor.history)
    assert [r.step for r in records] == [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3]
    assert [r.metrics["Health/loss_scale"] for r in records] == [SCALE, SCALE, SCALE / 2]  # halved after the overflow
    assert [r.metrics["train/skipped"] for r in records] == [r.metrics["Health/skipped"] for r in records] == \
        [0.0, 1.0, 0.0]
    assert math.isfinite(records[2].metrics["train/loss"])  # the overflow step was not applied
    assert "Health/loss_scale" not in plain[0].metrics and [r.metrics["train/skipped"] for r in plain] == [0.0] * 3
    _assert_overflow_is_no_alert(records, callback.monitor, plain_callback.monitor)
    # the gradients are measured unscaled: those of the run without a scaler (a power of 2: exactly)
    assert records[0].metrics["grad/global/norm"] == pytest.approx(plain[0].metrics["grad/global/norm"], rel=1e-9)
    _assert_activation_grads_unscaled(records[0].metrics, plain[0].metrics, rel=1e-9)


def test_lightning_loss_scale_and_a_step_the_scaler_skipped_on_an_overflow(tmp_path):
    """Lightning's 16-mixed precision plugin with its GradScaler, on the CPU (torch autocasts to
    fp16 there too; Lightning's `precision="16-mixed"` alone would switch a CPU run to bf16)."""
    import math

    from lightning.pytorch.plugins import MixedPrecision

    seen = []

    import lightning.pytorch as pl

    class GlobalStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % GAS == GAS - 1:
                seen.append(trainer.global_step)

    plain, _ = lightning_run(tmp_path / "plain", action_config(tmp_path / "plain", watch=ACTV_GRADS), overflows={1})
    callback, trainer = lightning_run(tmp_path / "scaled", action_config(tmp_path / "scaled", watch=ACTV_GRADS),
                                      overflows={1},
                                      plugins=[MixedPrecision("16-mixed", "cpu", scaler=_scaler())],
                                      callbacks=[GlobalStep()])
    records = list(callback.monitor.history)
    assert [r.step for r in records] == seen == [1, 2, 3]  # the skipped step is a step of its own
    assert [r.metrics["Health/loss_scale"] for r in records] == [SCALE, SCALE, SCALE / 2]
    assert [r.metrics["train/skipped"] for r in records] == [r.metrics["Health/skipped"] for r in records] == \
        [0.0, 1.0, 0.0]
    assert math.isfinite(records[2].metrics["train/loss"])
    assert "Health/loss_scale" not in plain.monitor.history[0].metrics
    _assert_overflow_is_no_alert(records, callback.monitor, plain.monitor)
    # Lightning unscales before on_before_optimizer_step: the fp32 run's gradients, to fp16 autocast's precision
    first = plain.monitor.history[0].metrics["grad/global/norm"]
    assert records[0].metrics["grad/global/norm"] == pytest.approx(first, rel=2e-2)
    _assert_activation_grads_unscaled(records[0].metrics, plain.monitor.history[0].metrics, rel=2e-2)


def _assert_activation_grads_unscaled(scaled: dict, plain: dict, rel: float) -> None:
    """Every activation-gradient statistic of a loss-scaled step is the unscaled run's (the
    loss scale, 1024, divided out of min, max, mean and norm)."""
    keys = [k for k in plain if k.startswith(("actv_grad/", "actv_in_grad/")) and k.endswith(("/norm", "/max", "/min"))]
    assert len(keys) >= 6
    for key in keys:
        assert scaled[key] == pytest.approx(plain[key], rel=rel, abs=1e-9), key
