"""A loss-scale overflow, as a step's table shows it: fp16 training multiplies the loss by a
scale before the backward, and a loss scaler (torch's GradScaler, DeepSpeed's) skips exactly
the optimizer steps whose gradients then hold an inf or a nan, lowering the scale. Those
gradients were thrown away, not applied: their rows are no model anomaly, and are dropped
before the rules see them (the skip shows as `train/skipped`, the scale as `train/loss_scale`)."""
from __future__ import annotations

from msprobe_engine.health import LOSS_SCALE
from msprobe_engine.incident.graph import INPUT_GRAD_KIND
from msprobe_engine.stats import P_INF, P_NAN
from msprobe_engine.stats.table import StatTable

#: rows multiplied by the loss scale in the backward: void on an overflow step
SCALED_KINDS = frozenset({"grad", "actv_grad", INPUT_GRAD_KIND})


def overflowed(table: StatTable) -> bool:
    """Whether the table's parameter gradients hold an inf or a nan."""
    grads = table.select("grad")
    return bool(grads.any() and (table.partials[grads][:, [P_NAN, P_INF]] > 0).any())


def without_scaled(table: StatTable) -> StatTable:
    """`table` without its loss-scaled rows (`SCALED_KINDS`), its rank spread kept."""
    keep = [i for i, key in enumerate(table.keys) if key.kind not in SCALED_KINDS]
    screened = StatTable.from_rows([table.keys[i] for i in keep], table.partials[keep])
    screened.ranks = table.ranks
    return screened


def screen_scaler_overflow(table: StatTable) -> StatTable:
    """A step's table as the rules see it under a GradScaler: the step the scaler skipped (it has
    a loss scale, `LOSS_SCALE`, and non-finite gradients) without its loss-scaled rows."""
    return without_scaled(table) if LOSS_SCALE in table.keys and overflowed(table) else table
