"""Megatron-core: `MegatronMonitor(model_chunks, optimizer, config=...)`.

Tensor-, data-, pipeline- and expert-parallel aware monitoring of Megatron-core (0.16.1, 0.19.2)
training; see docs/megatron.md for the placement in a training loop, what is
covered and how it interacts with Megatron's own nan check.
"""
from msprobe_integrations.megatron.monitor import MegatronMonitor

__all__ = ["MegatronMonitor"]
