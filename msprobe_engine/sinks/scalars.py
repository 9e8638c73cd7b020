"""What the metric services' sinks (W&B, MLflow) share: a step record as flat `name -> value`
scalars, the run's name, its incident directories, the monitor's config as parameters."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from msprobe_engine.records import StepRecord


def record_scalars(record: StepRecord) -> dict[str, float]:
    """Every metric of `record`, plus `alert/<rule>` = 1 when an alert episode starts and 0
    when it ends (the convention of the TensorBoard and CSV sinks)."""
    scalars = dict(record.metrics)
    for alert in record.alerts:
        scalars[f"alert/{alert.rule}"] = 1.0 if alert.phase == "start" else 0.0
    return scalars


def run_name(run_dir: Path) -> str:
    """The monitor's run name from this rank's directory (``<output_dir>/<run name>/rank<R>``)."""
    return run_dir.resolve().parent.name


def incident_directories(incidents_dir: Path | None) -> list[Path]:
    """The run's incident directories written so far (each holds its incident.json)."""
    if incidents_dir is None or not incidents_dir.is_dir():
        return []
    return sorted(path.parent for path in incidents_dir.glob("*/incident.json"))


def config_params(config: Any, prefix: str = "msprobe") -> dict[str, str]:
    """The monitor's config as flat `prefix.key.subkey` -> value strings (lists and the
    components' entries as JSON), for a metric service's run parameters."""
    if config is None:
        return {}
    flat: dict[str, str] = {}
    todo = [(prefix, dataclasses.asdict(config))]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{path}.{key}", item) for key, item in value.items()]
        else:
            flat[path] = value if isinstance(value, str) else json.dumps(value, default=str)
    return dict(sorted(flat.items()))
