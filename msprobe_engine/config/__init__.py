"""Typed monitor configuration: schema, loading and validation."""
from msprobe_engine.errors import ConfigError
from msprobe_engine.config.loader import ConfigSource, load_config
from msprobe_engine.config.schema import MonitorConfig, ModuleSelection, Schedule, Watch, Writer

__all__ = ["ConfigError", "ConfigSource", "load_config", "MonitorConfig", "ModuleSelection", "Schedule",
           "Watch", "Writer"]
