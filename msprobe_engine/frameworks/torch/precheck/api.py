"""What the framework-neutral pre-check calls on the torch side."""
from msprobe_engine.frameworks.torch.precheck.replay import replay

__all__ = ["replay"]
