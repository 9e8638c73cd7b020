"""Weights & Biases: one `run.log(..., step=)` per monitored step, tags as W&B keys.

Our tags are already W&B's convention: the part before the first `/` is the panel section
(`grad/...`, `actv/...`, `optim/...`, `train/...`, `alert/...`). The run is created on the
writer thread at `open` and finished at `close`; `mode` (online/offline/disabled) defaults
to W&B's own setting (`WANDB_MODE`, `wandb offline`). Per-layer tags are many: limit what
W&B gets with `tags`, e.g. ``{name: wandb, project: p, tags: ["train/*", "grad/global/*"]}``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msprobe_engine.fields import choices
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.scalars import record_scalars


@register_sink("wandb")
class WandbSink(Sink):
    """Metrics and alert episodes of every monitored step to a W&B run."""

    requires = ("wandb",)

    @dataclass(kw_only=True, slots=True)
    class Config(Sink.Config):
        """`project`/`entity`/`run_name`/`group`: the W&B run (empty: W&B's defaults);
        `run_tags`: W&B's own run tags; `mode`: online, offline or disabled (empty: W&B's
        setting); `dir`: where W&B keeps its files (empty: the monitor's run directory)."""
        project: str = "msprobe"
        entity: str = ""
        run_name: str = ""
        group: str = ""
        run_tags: list[str] = field(default_factory=list)
        mode: str = field(default="", metadata=choices("", "online", "offline", "disabled"))
        dir: str = ""

    config: "WandbSink.Config"
    _run: Any

    def open(self) -> None:
        import wandb

        c = self.config
        options = {"entity": c.entity, "name": c.run_name, "group": c.group, "mode": c.mode}
        self._run = wandb.init(project=c.project, dir=c.dir or str(self.run_dir), tags=c.run_tags or None,
                               reinit="create_new", **{k: v for k, v in options.items() if v})

    def write(self, record: StepRecord) -> None:
        self._run.log(record_scalars(record), step=record.step)

    def close(self) -> None:
        self._run.finish()
