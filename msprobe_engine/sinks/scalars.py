"""A step record as the flat `name -> value` scalars that metric services (W&B, MLflow) log."""
from __future__ import annotations

from msprobe_engine.records import StepRecord


def record_scalars(record: StepRecord) -> dict[str, float]:
    """Every metric of `record`, plus `alert/<rule>` = 1 when an alert episode starts and 0
    when it ends (the convention of the TensorBoard and CSV sinks)."""
    scalars = dict(record.metrics)
    for alert in record.alerts:
        scalars[f"alert/{alert.rule}"] = 1.0 if alert.phase == "start" else 0.0
    return scalars
