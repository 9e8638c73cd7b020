"""The sink interface and the registry that picks sinks by name.

A sink is a registered class with its own `Config` (the keys of its entry in the config's
`sinks` list): ``sinks: [tensorboard, {name: jsonl}, {name: wandb, project: x, tags: ["Health/*"]}]``.
It is built on the training thread without touching files; every other call (`open`,
`write`, `flush`, `close`) runs on the one writer thread. `requires` names the optional
packages it needs: a config that selects it fails at load when one is missing.
"""
from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from msprobe_engine.errors import ConfigError
from msprobe_engine.records import StepRecord
from msprobe_engine.registry import Registry


class Sink:
    """Base of every sink; subclasses register with `@register_sink(name)`."""

    name: ClassVar[str]
    #: where the run's incidents go (`create_sinks` sets it), for sinks that show them
    incidents_dir: Path | None = None
    #: the monitor's whole config (a dataclass; `create_sinks` sets it), for sinks that log it
    monitor_config: Any = None
    #: optional packages this sink imports (checked when a config selects it)
    requires: ClassVar[tuple[str, ...]] = ()

    @dataclass(kw_only=True, slots=True)
    class Config:
        """`name`: the registered sink; `tags`: glob patterns of the tags it gets (all by default)."""
        name: str
        tags: list[str] = field(default_factory=lambda: ["*"])

    def __init__(self, config: "Sink.Config", run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self._everything = config.tags == ["*"]
        self._wanted: dict[str, bool] = {}

    def open(self) -> None:
        """Create the sink's files (writer thread)."""

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push what was written to disk."""

    def close(self) -> None:
        """Flush and release the sink's files."""

    def selected(self, record: StepRecord) -> StepRecord:
        """`record` with only the metrics whose tags match `config.tags`."""
        if self._everything:
            return record
        wanted = self._wanted
        keep = {}
        for tag, value in record.metrics.items():
            hit = wanted.get(tag)
            if hit is None:
                hit = wanted[tag] = any(fnmatch.fnmatchcase(tag, p) for p in self.config.tags)
            if hit:
                keep[tag] = value
        return replace(record, metrics=keep)

    @classmethod
    def check_available(cls, where: str) -> None:
        """Raise `ConfigError` naming a missing package this sink needs."""
        for package in cls.requires:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"{where}: the {cls.name} sink needs the package '{package}', which is not "
                                  f"installed (pip install {package})")


SINKS: Registry[type[Sink]] = Registry("sink", "msprobe_engine.sinks.builtin")
register_sink = SINKS.register


def create_sinks(configs: list[Sink.Config], run_dir: Path, incidents_dir: Path | None = None,
                 monitor_config: Any = None) -> list[Sink]:
    """The configured sinks writing under `run_dir` (e.g. <output_dir>/<run>/rank0), told
    where the run's incidents go and the monitor's config; no file is touched until their
    `open` runs on the writer thread."""
    sinks = [SINKS.get(config.name)(config, run_dir) for config in configs]
    for sink in sinks:
        sink.incidents_dir = incidents_dir
        sink.monitor_config = monitor_config
    return sinks
