"""TensorBoard event files written with the tensorboard package itself (no torch needed)."""
from __future__ import annotations

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.base import Sink, register_sink


@register_sink("tensorboard")
class TensorBoardSink(Sink):
    """One scalar per metric tag; alerts as `alert/<rule>` = 1 at start, 0 at end."""

    _writer: EventFileWriter

    def open(self) -> None:
        self._writer = EventFileWriter(str(self.run_dir))

    def write(self, record: StepRecord) -> None:
        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in record.metrics.items()]
        for alert in record.alerts:
            values.append(Summary.Value(tag=f"alert/{alert.rule}",
                                        simple_value=1.0 if alert.phase == "start" else 0.0))
        event = Event(wall_time=record.wall_time, step=record.step, summary=Summary(value=values))
        self._writer.add_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
