"""MLflow: one `log_batch` per monitored step into one MLflow run, through `MlflowClient`.

Metric keys are our tags (`grad/layers.0.mlp/norm`): MLflow allows letters, digits, `_ - . /`,
spaces and `:`; any other character becomes `_`. The run is created on the writer thread at
`open` (in `experiment`, created when missing) and set FINISHED at `close`. `tracking_uri`
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
from msprobe_engine.sinks.scalars import record_scalars

#: MLflow's limit of metrics per `log_batch` call
BATCH_LIMIT = 1000
_NOT_ALLOWED = re.compile(r"[^/\w.\- :]")


@register_sink("mlflow")
class MlflowSink(Sink):
    """Metrics and alert episodes of every monitored step as MLflow metrics (step = our step)."""

    requires = ("mlflow",)

    @dataclass(kw_only=True, slots=True)
    class Config(Sink.Config):
        """`tracking_uri` (empty: MLflow's default), `experiment`, `run_name` (empty: MLflow's),
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
        self._keys: dict[str, str] = {}

    def open(self) -> None:
        from mlflow.tracking import MlflowClient

        c = self.config
        self._client = MlflowClient(tracking_uri=c.tracking_uri or None)
        experiment = self._client.get_experiment_by_name(c.experiment)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(c.experiment)
        tags = dict(tag.partition("=")[::2] for tag in c.run_tags)
        run = self._client.create_run(experiment_id, run_name=c.run_name or None, tags=tags)
        self.run_id = run.info.run_id

    def write(self, record: StepRecord) -> None:
        from mlflow.entities import Metric

        millis = int((record.wall_time or time.time()) * 1000)
        metrics = [Metric(self._key(tag), value, millis, record.step) for tag, value in record_scalars(record).items()]
        for start in range(0, len(metrics), BATCH_LIMIT):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + BATCH_LIMIT])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)

    def _key(self, tag: str) -> str:
        key = self._keys.get(tag)
        if key is None:
            key = self._keys[tag] = _NOT_ALLOWED.sub("_", tag)
        return key
