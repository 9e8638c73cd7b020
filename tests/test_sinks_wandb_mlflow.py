"""The wandb and mlflow sinks, read back with the tools' own readers: an offline W&B run
(its transaction log, W&B's record schema) and a local MLflow file store (`MlflowClient`)."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from msprobe_engine.config import ConfigError, load_config
from msprobe_integrations.torch import TorchMonitor
from tests.wandb_reader import history

STEPS = 4
NAN_STEP = 2


def train(config: dict) -> list[float]:
    """A small model written here; the output of `body.1` is nan at step NAN_STEP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = {"now": 0}
    model[1].register_forward_hook(lambda m, a, out: out * float("nan") if step["now"] == NAN_STEP else None)
    losses = []
    with TorchMonitor(model, opt, {"strict": True, **config}) as monitor:
        for step["now"] in range(STEPS):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            monitor.step_end(loss)
            losses.append(loss.item())
    return losses


@pytest.mark.slow  # wandb starts its service process (~5 s)
def test_wandb_offline_run_holds_the_selected_metrics_and_the_alert(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    losses = train({"output_dir": str(tmp_path), "sinks": [
        {"name": "wandb", "project": "probe-test", "run_name": "tiny", "run_tags": ["ci"],
         "tags": ["train/*", "grad/global/*", "actv/1/*"]}]})
    rows, run = history(tmp_path / "rank0")
    assert (run.project, run.display_name, list(run.tags)) == ("probe-test", "tiny", ["ci"])
    assert [row["_step"] for row in rows] == list(range(STEPS))
    logged = {key for row in rows for key in row if not key.startswith("_")}
    assert "train/loss" in logged and "grad/global/norm" in logged and "actv/1/output/norm" in logged
    assert not any(key.startswith(("grad/0.", "actv/0/")) for key in logged)  # filtered out by `tags`
    for row, loss in zip(rows, losses):
        assert row["train/loss"] == pytest.approx(loss, rel=1e-6, nan_ok=True)
    assert math.isnan(rows[NAN_STEP]["actv/1/output/norm"])
    assert rows[NAN_STEP]["alert/non_finite"] == 1
    assert "alert/non_finite" not in rows[NAN_STEP - 1]


@pytest.mark.slow  # mlflow's import and file store (~5 s)
def test_mlflow_file_store_holds_every_step_and_the_alert(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    losses = train({"output_dir": str(tmp_path / "out"), "sinks": [
        {"name": "mlflow", "tracking_uri": uri, "experiment": "probe", "run_name": "tiny", "run_tags": ["team=ci"]}]})
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("probe").experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED" and run.data.tags["team"] == "ci"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in loss] == list(range(STEPS))
    for metric, value in zip(loss, losses):
        assert metric.value == pytest.approx(value, rel=1e-6, nan_ok=True)
    norm = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "actv/1/output/norm")}
    assert math.isnan(norm[NAN_STEP]) and math.isfinite(norm[NAN_STEP - 1])
    alert = client.get_metric_history(run.info.run_id, "alert/non_finite")
    assert [(m.step, m.value) for m in alert][0] == (NAN_STEP, 1.0)


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_sink_whose_package_is_missing_fails_at_load_naming_it(monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees when it is not installed
    with pytest.raises(ConfigError, match=rf"sinks\[1\].*'{package}'.*pip install {package}"):
        load_config({"sinks": ["jsonl", {"name": package}]})


def test_sink_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.mode"):
        load_config({"sinks": [{"name": "wandb", "mode": "sometimes"}]})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.projekt: unknown key .did you mean 'project'"):
        load_config({"sinks": [{"name": "wandb", "projekt": "x"}]})


def _incident_config(out) -> dict:
    return {"output_dir": str(out), "run_name": "tiny-run", "alerts": [{"rule": "non_finite"}]}


@pytest.mark.slow  # wandb starts its service process (~5 s)
def test_wandb_reuses_the_active_run_filters_by_default_and_keeps_incidents_as_artifacts(tmp_path, monkeypatch):
    import wandb

    from tests.wandb_reader import finished_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    theirs = wandb.init(project="trainer", name="the-trainers-run", dir=str(tmp_path))
    theirs.log({"trainer/loss": 1.0})
    train({**_incident_config(tmp_path / "out"), "sinks": ["wandb"]})
    assert wandb.run is theirs  # left open for its owner
    theirs.finish()
    assert not list((tmp_path / "out").glob("**/offline-run-*"))  # no second run
    rows, run = history(tmp_path)
    assert run.display_name == "the-trainers-run"
    logged = {key for row in rows for key in row if not key.startswith("_")}
    assert {"trainer/loss", "train/loss", "grad/global/norm", "actv/1/output/norm", "msprobe/step"} <= logged
    assert "actv/1/output/max" not in logged and not any(k.startswith("optim/") for k in logged)  # TensorBoard's filter
    assert [row["msprobe/step"] for row in rows if "msprobe/step" in row] == list(range(STEPS))
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = finished_records(path)
    config = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update}
    assert config["msprobe.output_dir"] == str(tmp_path / "out") and config["msprobe.run_name"] == "tiny-run"
    assert json.loads(config["msprobe.alerts"])[0]["rule"] == "non_finite"  # the monitor's config, as the run's
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [(a.name, a.type) for a in artifacts] == [(f"incident-step{NAN_STEP}-rank0-non_finite", "incident")]
    assert "incident.json" in {entry.path for entry in artifacts[0].manifest.contents}


@pytest.mark.slow  # wandb starts its service process (~5 s)
def test_a_wandb_run_of_our_own_is_named_after_the_monitors_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train({**_incident_config(tmp_path), "sinks": ["wandb"]})
    _, run = history(tmp_path / "tiny-run" / "rank0")
    assert run.display_name == "tiny-run"


@pytest.mark.slow  # mlflow's import and file store (~5 s)
def test_mlflow_reuses_the_active_run_filters_by_default_and_logs_incidents_as_artifacts(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_name="the-trainers-run") as theirs:
            train({**_incident_config(tmp_path / "out"), "sinks": ["mlflow"]})
            assert mlflow.active_run().info.run_id == theirs.info.run_id
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.run_id == theirs.info.run_id and run.info.run_name == "the-trainers-run"
        assert run.data.params["msprobe.run_name"] == "tiny-run" and run.data.params["msprobe.schedule.interval"] == "1"
        keys = set(run.data.metrics)
        assert {"train/loss", "grad/global/norm", "actv/1/output/norm"} <= keys
        assert "actv/1/output/max" not in keys and not any(k.startswith("optim/") for k in keys)
        incident = f"incidents/step{NAN_STEP}-rank0-non_finite"
        assert "incident.json" in {Path(f.path).name for f in client.list_artifacts(run.info.run_id, incident)}
    finally:
        mlflow.set_tracking_uri("")
