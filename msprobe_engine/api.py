"""The public API of the engine, in one place."""
from msprobe_engine.config import ConfigError, MonitorConfig, load_config
from msprobe_engine.incident.actions import StepDecision, TrainingStopped
from msprobe_engine.monitor import Monitor
from msprobe_engine.records import AlertEvent, StepRecord

__all__ = ["Monitor", "MonitorConfig", "ConfigError", "load_config", "StepRecord", "AlertEvent",
           "StepDecision", "TrainingStopped"]
