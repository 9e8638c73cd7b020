"""What the framework-neutral pre-check calls on the torch side."""
from msprobe_engine.frameworks.torch.precheck.replay import replay
from msprobe_engine.frameworks.torch.precheck.repro import repro_script

__all__ = ["replay", "repro_script"]
