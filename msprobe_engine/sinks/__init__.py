"""Where statistics go: TensorBoard, CSV, JSONL (and registered sinks), behind one background writer."""
from msprobe_engine.sinks.base import SINKS, Sink, create_sinks, register_sink
from msprobe_engine.sinks.writer import BackgroundWriter

__all__ = ["SINKS", "Sink", "create_sinks", "register_sink", "BackgroundWriter"]
