"""`norm`: the L2 norm, sqrt of the sum of squares (0 for an empty tensor)."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("norm")
class Norm(Statistic):
    needs = ("sumsq",)

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        return np.sqrt(p["sumsq"])
