"""The overview of a step, `Health/*`: the few numbers that say whether the run is healthy.

Computed on the host from the step's rows after the one transfer (a handful of numpy
reductions; the row layout is cached while the keys repeat), and put first in the
step's record, so that every sink gets them:

    Health/loss, Health/grad_norm          train/loss, grad/global/norm
    Health/alerts                          alert episodes started so far in the run (cumulative: a
                                           one-step alert stays visible, smoothing or not; carried
                                           through the saved state, so a resumed run goes on counting)
    Health/lr                              the learning rate, where the integration knows it (train/lr)
    Health/loss_scale                      the fp16 loss scale the step's backward used (train/loss_scale):
                                           HF's/accelerate's and Lightning's GradScaler, DeepSpeed's fp16
                                           loss scaler; an overflow step shows as Health/skipped = 1 and
                                           a lower scale on the next step
    Health/non_finite/<kind>               nan + inf elements in actv, actv_grad, grad, param, optim
    Health/worst_deviation                 the largest fold change of a row's norm from its running average
    Health/skipped                         1 when the step's optimizer step was skipped (train/skipped)
    Health/tokens_per_s, samples_per_s     throughput since the previous step's end, where the trainer
                                           callbacks see the batches (train/tokens_per_s, ...)
    Health/memory/cpu_rss_mb, device_mb    the process's peak RSS and torch's allocated device memory (MiB),
                                           host counters read at the step's end (train/cpu_rss_mb, ...)
    Health/open_alert/<rule>               1 while an episode of the rule is open, else 0 (every step;
                                           was Health/alert/<rule>: renamed to sort after the loss)
    Health/monitor_ms                      the monitor's host time at the step's transfer, rules and record

(`Health` is capitalised so that TensorBoard, which sorts groups by name, shows it first.)
"""
from __future__ import annotations

import numpy as np

from msprobe_engine.incident.deviation import RunningNorms
from msprobe_engine.records import AlertEvent
from msprobe_engine.stats import P_INF, P_NAN
from msprobe_engine.stats.table import MetricKey, StatTable

PREFIX = "Health/"
#: the fp16 loss scale of the step, where an integration knows it (Health/loss_scale)
LOSS_SCALE = MetricKey("train", "loss_scale")
#: the kinds whose non-finite elements are counted, in this order
KINDS = ("actv", "actv_grad", "grad", "param", "optim")


class HealthMeter:
    """Builds the `Health/*` metrics of each emitted step (training thread, host side)."""

    def __init__(self, rules: list[str]) -> None:
        self.rules = list(dict.fromkeys(rules))
        self._norms = RunningNorms()
        self._open: set[tuple[str, str]] = set()  # (rule, tag) of the open episodes
        #: alert episodes started so far (Health/alerts; saved with the monitor's state)
        self.started = 0
        self._keys: list[MetricKey] = []
        self._kind = np.zeros(0, dtype=np.int64)  # index into KINDS, -1 for other rows

    def __call__(self, table: StatTable, events: list[AlertEvent], metrics: dict[str, float],
                 monitor_ms: float) -> dict[str, float]:
        """`Health/*` of the step whose rows are `table`, followed by its `metrics`."""
        self.started += sum(event.phase == "start" for event in events)
        health = {f"{PREFIX}{name}": metrics[tag] for name, tag in
                  (("loss", "train/loss"), ("grad_norm", "grad/global/norm"), ("lr", "train/lr"),
                   ("loss_scale", "train/loss_scale"),
                   ("tokens_per_s", "train/tokens_per_s"), ("samples_per_s", "train/samples_per_s"),
                   ("memory/cpu_rss_mb", "train/cpu_rss_mb"), ("memory/device_mb", "train/device_mem_mb"))
                  if tag in metrics}
        health[f"{PREFIX}alerts"] = float(self.started)
        kind = self._kinds(table.keys)
        counts = np.bincount(kind + 1, weights=table.partials[:, P_NAN] + table.partials[:, P_INF],
                             minlength=len(KINDS) + 1)[1:]
        present = np.bincount(kind + 1, minlength=len(KINDS) + 1)[1:] > 0
        for i in np.flatnonzero(present):
            health[f"{PREFIX}non_finite/{KINDS[i]}"] = float(counts[i])
        measured = kind >= 0
        if measured.any():
            health[f"{PREFIX}worst_deviation"] = float(self._norms.deviation(table)[measured].max())
            self._norms.update(table)
        health[f"{PREFIX}skipped"] = metrics.get("train/skipped", 0.0)
        for event in events:
            (self._open.add if event.phase == "start" else self._open.discard)((event.rule, event.tag))
        open_rules = {rule for rule, _ in self._open}
        for rule in self.rules:
            health[f"{PREFIX}open_alert/{rule}"] = 1.0 if rule in open_rules else 0.0
        health[f"{PREFIX}monitor_ms"] = monitor_ms
        health.update(metrics)
        return health

    def restore(self, episodes: list[tuple[str, str]], started: int) -> None:
        """A resumed run: the (rule, tag) of the episodes open when it was saved, and the number
        of episodes started until then."""
        self._open = set(episodes)
        self.started = started

    def _kinds(self, keys: list[MetricKey]) -> np.ndarray:
        if keys != self._keys:
            index = {kind: i for i, kind in enumerate(KINDS)}
            self._keys = list(keys)
            self._kind = np.array([index.get(key.kind, -1) for key in keys], dtype=np.int64)
        return self._kind
