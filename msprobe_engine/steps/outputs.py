"""Where a monitor writes: the run directory, its sinks and the one writer thread."""
from __future__ import annotations

from dataclasses import dataclass

from msprobe_engine.config.schema import MonitorConfig
from msprobe_engine.run_dir import RunDir, open_run_dir
from msprobe_engine.sinks import BackgroundWriter, Sink, create_sinks


@dataclass
class Outputs:
    """`run`: <output_dir>/<run name>/ and this rank's directory in it; `sinks`: this rank's
    (none on a rank that does not write); `writer`: the thread that writes every file."""

    run: RunDir
    sinks: list[Sink]
    writer: BackgroundWriter


def open_outputs(config: MonitorConfig, rank: int, writes: bool | None) -> Outputs:
    """The run directory (created and checked now, before training), the sinks, built here and
    opened on the writer thread. `writes` (None: rank 0, or every rank with `per_rank`)."""
    if writes is None:  # an integration may choose, e.g. one writer per pipeline stage
        writes = rank == 0 or config.per_rank
    writes = writes and bool(config.sinks)
    run = open_run_dir(config.output_dir, config.run_name, config.resume, rank, writes, config.incidents.dir)
    sinks = create_sinks(config.sinks, run.rank_dir, run.incidents, config) if writes else []
    writer = BackgroundWriter(config.writer.queue_size, config.writer.when_full, strict=config.strict)
    for sink in sinks:
        writer.submit(sink.open, f"{sink.name} sink open")
    return Outputs(run, sinks, writer)
