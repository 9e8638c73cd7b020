"""The sink interface and the registry that picks sinks by name."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from msprobe_engine.records import StepRecord


class Sink(Protocol):
    """Writes step records somewhere; called only on the writer thread."""

    def write(self, record: StepRecord) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


_REGISTRY: dict[str, Callable[[Path], Sink]] = {}


def register_sink(name: str) -> Callable:
    """Class decorator: make a sink selectable by `name` in the config's `sinks` list."""
    def add(cls: Callable[[Path], Sink]) -> Callable[[Path], Sink]:
        _REGISTRY[name] = cls
        return cls
    return add


def create_sinks(names: list[str], run_dir: Path) -> list[Sink]:
    """Instantiate the named sinks writing under `run_dir` (e.g. <output_dir>/rank0)."""
    from msprobe_engine.sinks import csv_sink, jsonl_sink, tensorboard_sink  # noqa: F401 (registration)
    run_dir.mkdir(parents=True, exist_ok=True)
    return [_REGISTRY[name](run_dir) for name in names]
