"""Weights & Biases: one `run.log(..., step=)` per monitored step, tags as W&B keys.

Our tags are already W&B's convention: the part before the first `/` is the panel section
(`grad/...`, `actv/...`, `optim/...`, `train/...`, `alert/...`). When a W&B run is active as
the monitor starts (`wandb.run`: the HF Trainer's `report_to="wandb"`, Lightning's
`WandbLogger`, your own `wandb.init`), the metrics go into that run, which is left open;
otherwise a run is created on the writer thread at `open` (named after the monitor's run
unless `run_name` is given) and finished at `close`. `mode` (online/offline/disabled) defaults
to W&B's own setting (`WANDB_MODE`, `wandb offline`). Per-layer tags are many: as the
TensorBoard sink, only the kinds in `layer_kinds` with the statistics in `layer_stats` are
sent (`layer_filter.py`); `tags` limits further, e.g. ``{name: wandb, tags: ["train/*"]}``.
In a run that is not ours, W&B's step is the trainer's: our step is logged as `msprobe/step`.
The monitor's config is the run's config (`msprobe.<key>...`).
At `close` each incident directory becomes an artifact (type `incident`, `incident-<name>`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msprobe_engine.fields import choices
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink
from msprobe_engine.sinks.layer_filter import LayerChoice, LayerFilter
from msprobe_engine.sinks.scalars import config_params, incident_directories, record_scalars, run_name

#: our step, logged as a metric into a run whose step the trainer owns
STEP_KEY = "msprobe/step"


@register_sink("wandb")
class WandbSink(Sink):
    """Metrics and alert episodes of every monitored step to a W&B run (the active one, if any)."""

    requires = ("wandb",)

    @dataclass(kw_only=True, slots=True)
    class Config(LayerChoice):
        """`project`/`entity`/`run_name`/`group`: a run created here (empty: W&B's defaults;
        `run_name` empty: the monitor's run name); `run_tags`: W&B's own run tags; `mode`:
        online, offline or disabled (empty: W&B's setting); `dir`: where W&B keeps its files
        (empty: the monitor's run directory)."""
        project: str = "msprobe"
        entity: str = ""
        run_name: str = ""
        group: str = ""
        run_tags: list[str] = field(default_factory=list)
        mode: str = field(default="", metadata=choices("", "online", "offline", "disabled"))
        dir: str = ""

    config: "WandbSink.Config"
    _run: Any

    def __init__(self, config: "WandbSink.Config", run_dir: Path) -> None:
        super().__init__(config, run_dir)
        import wandb

        self._active = wandb.run  # the trainer's (or the user's) run, seen from the training thread
        self._keeps = LayerFilter(config)

    def open(self) -> None:
        self._run = self._active if self._active is not None else self._create()
        self._run.config.update(config_params(self.monitor_config), allow_val_change=True)

    def _create(self) -> Any:
        import wandb

        c = self.config
        options = {"entity": c.entity, "group": c.group, "mode": c.mode}
        return wandb.init(project=c.project, name=c.run_name or run_name(self.run_dir),
                               dir=c.dir or str(self.run_dir), tags=c.run_tags or None,
                               reinit="create_new", **{k: v for k, v in options.items() if v})

    def write(self, record: StepRecord) -> None:
        scalars = self._keeps.metrics(record_scalars(record))
        if self._active is None:
            self._run.log(scalars, step=record.step)
        else:  # the trainer owns the run's step: ours goes along as a metric
            self._run.log({**scalars, STEP_KEY: record.step})

    def close(self) -> None:
        import wandb

        for directory in incident_directories(self.incidents_dir):
            artifact = wandb.Artifact(f"incident-{directory.name}", type="incident")
            artifact.add_dir(str(directory))
            self._run.log_artifact(artifact)
        if self._active is None:
            self._run.finish()
