"""Where statistics go: TensorBoard, CSV, JSONL, behind one background writer."""
from msprobe_engine.sinks.base import Sink, create_sinks, register_sink
from msprobe_engine.sinks.writer import BackgroundWriter

__all__ = ["Sink", "create_sinks", "register_sink", "BackgroundWriter"]
