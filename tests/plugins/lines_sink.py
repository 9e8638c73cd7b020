"""A user's sink: `<prefix>.txt` in the run directory, one `step tag value` line per metric."""
from dataclasses import dataclass

from msprobe_engine.sinks import Sink, register_sink


@register_sink("lines")
class LinesSink(Sink):
    @dataclass(kw_only=True, slots=True)
    class Config(Sink.Config):
        prefix: str = "metrics"

    def open(self) -> None:
        self._file = open(self.run_dir / f"{self.config.prefix}.txt", "a", encoding="utf-8")

    def write(self, record) -> None:
        self._file.writelines(f"{record.step} {tag} {value}\n" for tag, value in record.metrics.items())

    def close(self) -> None:
        self._file.close()
