"""`nan_count`: how many elements are nan, exact."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("nan_count")
class NanCount(Statistic):
    needs = ("nan_count",)

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        return p["nan_count"]
