"""`inf_count`: how many elements are +inf or -inf, exact."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("inf_count")
class InfCount(Statistic):
    needs = ("inf_count",)

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        return p["inf_count"]
