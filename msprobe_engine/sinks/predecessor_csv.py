"""The predecessor's CSV layout (its monitor's ``format: csv``), readable by its CSV tools.

``sinks: [predecessor_csv]`` writes, next to this rank's run directory (in its parent, the run's
directory, as the predecessor's ``MONITOR_OUTPUT_DIR``), ``<Mon><DD>_<HH>-<MM>-<SS>-rank<R>-msprobe_engine/``
with one file per kind of metric and span of steps, ``<kind>_<first>-<last>.csv``:

==============  =========================================  ====================================
file (kind)     from our tags                              ``name``
==============  =========================================  ====================================
actv            ``actv/<module>/<role>/<stat>``             ``<module>.<role>`` (``input.0`` ->
                                                           ``input_0``), ``micro_step`` 0
actv_grad       ``actv_grad/<module>/<role>/<stat>``        ``<module>.<role>_grad``
grad_reduced    ``grad/<param>/<stat>``                     ``<param>``
param_updated   ``param/<param>/<stat>``                    ``<param>``
exp_avg(_sq)    ``optim/<param>/exp_avg(_sq)/<stat>``       ``<param>``
==============  =========================================  ====================================

Columns: ``vpp_stage, name, step[, micro_step]`` then one per statistic under its name there
(``min max mean norm`` as they are, ``nan_count`` -> ``nans``, ``zero_frac`` -> ``zeros``).
``steps_per_file`` is its ``step_count_per_record``. Other tags (loss, alerts, ratios) are not
part of that layout: use another sink beside it.
"""
from __future__ import annotations

import csv
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from msprobe_engine.fields import at_least
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink

#: our statistic -> its op name
OPS = {"min": "min", "max": "max", "mean": "mean", "norm": "norm", "nan_count": "nans", "zero_frac": "zeros"}
#: our optimizer state -> its file
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
HEADER = ["vpp_stage", "name", "step"]
MICRO_KINDS = ("actv", "actv_grad")


@register_sink("predecessor_csv")
class PredecessorCsvSink(Sink):
    """One CSV per kind and span of steps, in the predecessor's columns (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Sink.Config):
        """`steps_per_file`: steps per file (the predecessor's step_count_per_record)."""
        steps_per_file: int = field(default=1, metadata=at_least(1))

    def open(self) -> None:
        rank = re.search(r"(\d+)$", self.run_dir.name)
        stamp = time.strftime("%b%d_%H-%M-%S")
        self.directory = self.run_dir.parent / f"{stamp}-rank{int(rank.group(1)) if rank else 0}-msprobe_engine"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._rows: dict[tuple[str, str], dict[str, float]] = {}

    def write(self, record: StepRecord) -> None:
        rows: dict[str, dict[str, dict[str, float]]] = {}
        for tag, value in record.metrics.items():
            placed = _place(tag)
            if placed is not None:
                kind, name, op = placed
                rows.setdefault(kind, {}).setdefault(name, {})[op] = value
        span = self.config.steps_per_file
        first = record.step // span * span
        for kind, names in rows.items():
            self._append(self.directory / f"{kind}_{first}-{first + span - 1}.csv", kind, record.step, names)

    @staticmethod
    def _append(path: Path, kind: str, step: int, names: dict[str, dict[str, float]]) -> None:
        ops = [op for op in OPS.values() if any(op in values for values in names.values())]
        micro = kind in MICRO_KINDS
        new = not path.exists()
        with open(path, "a", encoding="utf-8", newline="") as f:
            out = csv.writer(f)
            if new:
                out.writerow(HEADER + (["micro_step"] if micro else []) + ops)
            for name, values in names.items():
                cells = [values.get(op, "nan") for op in ops]
                out.writerow([0, name, step] + ([0] if micro else []) + cells)


def _place(tag: str) -> tuple[str, str, str] | None:
    """(file kind, name, op) of one of our tags, or None when the layout has no place for it."""
    parts = tag.split("/")
    op = OPS.get(parts[-1])
    if op is None:
        return None
    kind = parts[0]
    if kind in ("actv", "actv_grad") and len(parts) == 4:
        base, _, index = parts[2].partition(".")
        role = f"{base}_grad" if kind == "actv_grad" else base
        return kind, f"{parts[1]}.{role}" + (f"_{index}" if index else ""), op
    if kind in ("grad", "param") and len(parts) == 3 and parts[1] != "global":
        return ("grad_reduced" if kind == "grad" else "param_updated"), parts[1], op
    if kind == "optim" and len(parts) == 4 and parts[2] in STATES:
        return STATES[parts[2]], parts[1], op
    return None
