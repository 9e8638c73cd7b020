"""MLflow: one `log_batch` per monitored step into one MLflow run, through `MlflowClient`.

Metric keys are our tags (`grad/layers.0.mlp/norm`): MLflow allows letters, digits, `_ - . /`,
spaces and `:`; any other character becomes `_`. The run is created on the writer thread at
`open` (in `experiment`, created when missing; named after the monitor's run unless
`run_name` is given) and set FINISHED at `close` -- unless an MLflow run is active as the
monitor starts (`mlflow.active_run()`: the HF Trainer's `report_to="mlflow"`, your own
`mlflow.start_run()`): then the metrics go
into that run, which is left open. As the TensorBoard sink, only the per-layer tags of
`layer_kinds` with the statistics of `layer_stats` are logged (`layer_filter.py`). At `close`
each incident directory is logged as artifacts under `incidents/<name>/`. The monitor's config
is logged as the run's parameters (`msprobe.<key>...`, lists as JSON). `tracking_uri`
empty: MLflow's own (`MLFLOW_TRACKING_URI`). A `file:` store needs `MLFLOW_ALLOW_FILE_STORE=true`
with MLflow 3 (MLflow's rule; mlflow-skinny has no database backend).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.layer_filter import LayerChoice, LayerFilter
from msprobe_engine.sinks.scalars import config_params, incident_directories, record_scalars, run_name

#: MLflow's limits: metrics and parameters per `log_batch` call, characters of a parameter's value
BATCH_LIMIT = 1000
PARAM_BATCH = 100
PARAM_LIMIT = 6000
_NOT_ALLOWED = re.compile(r"[^/\w.\- :]")


@register_sink("mlflow")
class MlflowSink(Sink):
    """Metrics and alert episodes of every monitored step as MLflow metrics (step = our step)."""

    requires = ("mlflow",)

    @dataclass(kw_only=True, slots=True)
    class Config(LayerChoice):
        """`tracking_uri` (empty: MLflow's default), `experiment`, `run_name` (empty: the
        monitor's run name),
        `run_tags`: MLflow run tags as "name=value" (a bare name: an empty value)."""
        tracking_uri: str = ""
        experiment: str = "msprobe"
        run_name: str = ""
        run_tags: list[str] = field(default_factory=list)

    config: "MlflowSink.Config"
    _client: Any
    run_id: str

    def __init__(self, config: "MlflowSink.Config", run_dir) -> None:
        super().__init__(config, run_dir)
        import mlflow

        self._keys: dict[str, str] = {}
        self._keeps = LayerFilter(config)
        active = mlflow.active_run()  # the trainer's (or the user's) run, seen from the training thread
        self._active = active.info.run_id if active is not None else None
        self._active_uri = mlflow.get_tracking_uri() if active is not None else None

    def open(self) -> None:
        from mlflow.tracking import MlflowClient

        c = self.config
        if self._active is not None:
            self._client, self.run_id = MlflowClient(tracking_uri=self._active_uri), self._active
        else:
            self._client = MlflowClient(tracking_uri=c.tracking_uri or None)
            self.run_id = self._create()
        self._log_params()

    def _create(self) -> str:
        c = self.config
        experiment = self._client.get_experiment_by_name(c.experiment)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(c.experiment)
        tags = dict(tag.partition("=")[::2] for tag in c.run_tags)
        return self._client.create_run(experiment_id, run_name=c.run_name or run_name(self.run_dir),
                                       tags=tags).info.run_id

    def _log_params(self) -> None:
        """The monitor's config as the run's parameters (`msprobe.<key>...`)."""
        from mlflow.entities import Param

        params = [Param(key, value[:PARAM_LIMIT]) for key, value in config_params(self.monitor_config).items()]
        for start in range(0, len(params), PARAM_BATCH):
            self._client.log_batch(self.run_id, params=params[start:start + PARAM_BATCH])

    def write(self, record: StepRecord) -> None:
        from mlflow.entities import Metric

        millis = int((record.wall_time or time.time()) * 1000)
        scalars = self._keeps.metrics(record_scalars(record))
        metrics = [Metric(self._key(tag), value, millis, record.step) for tag, value in scalars.items()]
        for start in range(0, len(metrics), BATCH_LIMIT):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + BATCH_LIMIT])

    def close(self) -> None:
        for directory in incident_directories(self.incidents_dir):
            self._client.log_artifacts(self.run_id, str(directory), f"incidents/{directory.name}")
        if self._active is None:
            self._client.set_terminated(self.run_id)

    def _key(self, tag: str) -> str:
        key = self._keys.get(tag)
        if key is None:
            key = self._keys[tag] = _NOT_ALLOWED.sub("_", tag)
        return key
