"""msprobe_engine: hooks, statistics, dumps and analysis for training numerics.

Importing the package does not import torch or mindspore; backends and
integrations load them lazily.
"""
from msprobe_engine.api import (AlertEvent, ConfigError, Monitor, MonitorConfig, StepDecision, StepRecord,
                                TrainingStopped, load_config)

__version__ = "0.1.0"
__all__ = ["Monitor", "MonitorConfig", "ConfigError", "load_config", "StepRecord", "AlertEvent",
           "StepDecision", "TrainingStopped"]
